"""The rules every free-form value must pass before it reaches a file or an argv: one table, used by the CLI (each
option's callback, provision/options.py), the fleet role's Ansible module (roles/gpuprov/module_utils/gpuprov_values.py
is a link to this file) and the runtime's settings (/etc/gpuprov/runtime.json, provision/inject/settings.py).

So this module imports nothing of gpuprov's (the module runs with the node's own Python, where gpuprov cannot be
imported) and nothing costly: the runtime reads its settings on every container start. `json` and `re` are already
loaded there (its settings are JSON; json imports re); urllib.parse is imported only by the URL rule, which the runtime
never uses.

Each rule is a check that returns the value (unchanged) or raises BadValue naming the value and the rule."""
from __future__ import annotations

import json  # (the runtime has it loaded already: its settings are JSON)
import re

MAX_PATH = 4096  # PATH_MAX


class BadValue(ValueError):
    """A value that breaks its rule. str(): `'VALUE': RULE`, the words every caller puts after the option's name."""

    def __init__(self, value, rule: str):
        self.value, self.rule = value, rule
        super().__init__(f"{value!r}: {rule}")


def _controls(text: str) -> bool:
    """Control characters (C0, DEL, C1) or NUL: what would split a line in a file or hide text in a terminal."""
    return re.search("[\x00-\x1f\x7f-\x9f]", text) is not None


def _too_long(text: str) -> bool:
    # at most 4 bytes a character in UTF-8: only a long text needs encoding to be measured
    return len(text) > MAX_PATH // 4 and len(text.encode(errors="surrogateescape")) > MAX_PATH


def _text(value, rule: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadValue(value, rule)
    return value


def _matching(value, pattern: str, rule: str) -> str:
    """The value as text when it is all `pattern`; BadValue naming `rule` otherwise."""
    text = _text(value, rule)
    if not re.fullmatch(pattern, text):
        raise BadValue(value, rule)
    return text


# --- the rules -----------------------------------------------------------------------------------------------------

URL_TEXT = ("a URL with scheme http, https or file (http/https with a host), only URL characters: no whitespace, "
            "no control characters")
# RFC 3986's characters (unreserved, reserved and %): nothing else reaches an apt line, a .repo file or an argv.
URL_CHARS = r"[A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=%-]+"


def url(value) -> str:
    text = _text(value, URL_TEXT)
    if not re.fullmatch(URL_CHARS, text):
        raise BadValue(value, URL_TEXT)
    from urllib.parse import urlsplit  # lazy: ~3 ms (-X importtime); only options with a URL need it

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        raise BadValue(value, URL_TEXT) from None
    ok = parts.scheme in ("http", "https") and bool(parts.hostname) or \
        parts.scheme == "file" and parts.path.startswith("/") and parts.netloc in ("", "localhost")
    if not ok:
        raise BadValue(value, URL_TEXT)
    return text


KERNEL_TEXT = ("a kernel release as /lib/modules holds it (`uname -r`, e.g. 6.1.0-28-amd64): letters, digits and "
               ". _ + ~ -, starting with a letter or digit, at most 64 characters, no '/' and no '..'")


def kernel_release(value) -> str:
    text = _text(value, KERNEL_TEXT)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}", text) or ".." in text:
        raise BadValue(value, KERNEL_TEXT)
    return text


NAME_TEXT = ("a name of letters, digits, '_' and '-', starting with a letter or digit, at most 63 characters "
             "(a key in the engine's config and a Kubernetes RuntimeClass handler)")


def runtime_name(value) -> str:
    return _matching(value, r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", NAME_TEXT)


DRIVER_TEXT = "auto, skip or a driver branch of ASCII digits (e.g. 535)"


def driver(value) -> str:
    text = _text(value, DRIVER_TEXT)
    if text not in ("auto", "skip") and not re.fullmatch(r"[0-9]{1,4}", text):
        raise BadValue(value, DRIVER_TEXT)
    return text


PATH_TEXT = f"a path without control characters, at most {MAX_PATH} bytes"


def path(value) -> str:
    text = _text(value, PATH_TEXT)
    if _controls(text) or _too_long(text):
        raise BadValue(value, PATH_TEXT)
    return text


ABS_PATH_TEXT = (f"an absolute path without '..', quotes, backslashes or control characters, at most {MAX_PATH} "
                 "bytes")


def abs_path(value) -> str:
    """A path written into a file that root reads back and may execute (runtime.json, an engine's config): absolute,
    so that it does not depend on the reader's working directory, without `..`, so that it says where it leads, and
    without quotes or backslashes, so that it reads the same in JSON, TOML and a shell line."""
    text = _text(value, ABS_PATH_TEXT)
    if not text.startswith("/") or ".." in text.split("/") or _controls(text) or _too_long(text) or \
            re.search("[\"'\\\\]", text):
        raise BadValue(value, ABS_PATH_TEXT)
    return text


ABS_PATHS_TEXT = "a colon-separated list of absolute paths, each without '..', quotes, backslashes or control characters"


def abs_paths(value) -> str:
    """PATH:PATH… (e.g. CDI spec directories), each an abs_path; empty items are skipped, as the callers do."""
    text = _text(value, ABS_PATHS_TEXT)
    for item in text.split(":"):
        try:
            if item:
                abs_path(item)
        except BadValue:
            raise BadValue(value, ABS_PATHS_TEXT) from None
    return text


PACKAGES_TEXT = ("a comma list of package names: letters, digits and . + _ ~ : -, each starting with a letter or "
                 "digit (never an option)")


PACKAGE = r"[A-Za-z0-9][A-Za-z0-9.+_~:-]{0,127}"  # Debian policy's names, with an epoch/arch ':' allowed


def packages(value) -> str:
    text = _text(value, PACKAGES_TEXT)
    if not all(re.fullmatch(PACKAGE, p) for p in text.split(",") if p):
        raise BadValue(value, PACKAGES_TEXT)
    return text


PACKAGE_TEXT = ("a package name: letters, digits and . + _ ~ : -, starting with a letter or digit (never an option), "
                "at most 128 characters")


def package(value) -> str:
    """One package name (the install record's; `packages` is the comma list the options take)."""
    return _matching(value, PACKAGE, PACKAGE_TEXT)


HANDLER_TEXT = "a CRI handler name (lowercase letters, digits and '-', at most 63, like Kubernetes' RuntimeClass.handler)"


def cri_handler(value) -> str:
    """The runtime's name under containerd and CRI-O: a TOML key there, and the RuntimeClass handler pods name."""
    return _matching(value, r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", HANDLER_TEXT)


NAMESPACE_TEXT = ("a Kubernetes namespace: lower-case letters, digits and '-', starting and ending with a letter or "
                  "digit, at most 63 characters")


def namespace(value) -> str:
    return _matching(value, r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", NAMESPACE_TEXT)


NVIDIA_VENDOR = 0x10DE  # PCI vendor id: facts (sysfs), decisions and this rule read this one
PCI_ID_TEXT = "a PCI id VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE] in hex, the vendor NVIDIA's 10de (e.g. 10de:2330)"
PCI_ID = r"([0-9a-fA-F]{4}):([0-9a-fA-F]{4})(?::([0-9a-fA-F]{4}):([0-9a-fA-F]{4}))?"  # decide/gputable.py parses it


def pci_id(value) -> str:
    """An NVIDIA device's id: another vendor's (8086:1234) was taken as "NVIDIA device 8086:1234", exit 0."""
    text = _matching(value, PCI_ID, PCI_ID_TEXT)
    if int(text[:4], 16) != NVIDIA_VENDOR:
        raise BadValue(value, PCI_ID_TEXT)
    return text


KEY_TEXT = "a gpg key: a fingerprint, key id or user id, not starting with '-', without control characters"


def gpg_key(value) -> str:
    text = _text(value, KEY_TEXT)
    if text.startswith("-") or _controls(text) or len(text) > 256:
        raise BadValue(value, KEY_TEXT)
    return text


LISTEN_TEXT = ("HOST:PORT, the host a name or an IPv4 address, or an IPv6 address in brackets, and a port 1-65535 "
               "(e.g. 127.0.0.1:9400, [::1]:9400)")


def listen_address(value) -> tuple[str, int]:
    """HOST:PORT as (host, port); the host of `[::1]:9400` is `::1`."""
    text = _text(value, LISTEN_TEXT)
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?)\]:([0-9]{1,5})|([A-Za-z0-9_.-]+):([0-9]{1,5})", text)
    if not m:
        raise BadValue(value, LISTEN_TEXT)
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if not 0 < int(port) < 65536:
        raise BadValue(value, LISTEN_TEXT)
    return host, int(port)


def listen(value) -> str:
    listen_address(value)
    return value


BOOL_TEXT = "true or false (a JSON boolean, not a string or a number)"


def boolean(value) -> bool:
    if not isinstance(value, bool):
        raise BadValue(value, BOOL_TEXT)
    return value


# daemon.json keys that gpuprov's own options set (--runtime-name, --default-runtime/--no-default-runtime, --cdi):
# never through --engine-option, so that its merge keeps deciding them (conflicts, uninstall's undo).
GPUPROV_DAEMON_KEYS = ("runtimes", "default-runtime", "features")
# The example is quoted for a shell: pasted, `log-driver="local"` reached gpuprov as log-driver=local (the shell
# strips the JSON string's quotes) and failed again (issue 39)
ENGINE_OPTION_TEXT = ("KEY=JSON: a daemon.json key (lower-case letters, digits and '-', at most 64; not "
                      f"{', '.join(GPUPROV_DAEMON_KEYS)}: gpuprov's own options set those) and its value as JSON "
                      "(e.g. --engine-option 'log-driver=\"local\"', --engine-option live-restore=true), at most "
                      "4096 characters")


def engine_option(value) -> str:
    """One key of Docker's daemon.json and its JSON value (bootstrap --engine-option, the role's
    gpuprov_engine_options): geerlingguy.docker's docker_daemon_options, merged by gpuprov, never written whole."""
    text = _text(value, ENGINE_OPTION_TEXT)
    key, sep, doc = text.partition("=")
    if not sep or not re.fullmatch(r"[a-z][a-z0-9-]{0,63}", key) or key in GPUPROV_DAEMON_KEYS or len(text) > 4096:
        raise BadValue(value, ENGINE_OPTION_TEXT)
    try:
        json.loads(doc)
    except ValueError:
        if re.fullmatch(r"[\w.:/@+-]+", doc):  # a bare word: a JSON string whose quotes the shell took
            raise BadValue(value, f"KEY=JSON: {doc} is not JSON: a string keeps its double quotes, and the option "
                                  "goes in single quotes so that the shell leaves them: --engine-option "
                                  f"'{key}={json.dumps(doc)}'") from None  # (no quote in a word that matched)
        raise BadValue(value, ENGINE_OPTION_TEXT) from None
    return text


def engine_option_text(key: str, value) -> str:
    """KEY=JSON for one entry of the role's gpuprov_engine_options dict: what the module passes as --engine-option."""
    return f"{key}={json.dumps(value, sort_keys=True, separators=(',', ':'))}"


USER_TEXT = ("a user name: lower-case letters, digits, '_' and '-', starting with a letter or '_', at most 32 "
             "characters")


def user_name(value) -> str:
    """A local account (bootstrap --engine-user, added to the engine's group): what useradd accepts by default."""
    return _matching(value, r"[a-z_][a-z0-9_-]{0,31}", USER_TEXT)


# rule name -> check; the names are what the tables below, options.py and inject/settings.py refer to
RULES = {f.__name__: f for f in (url, kernel_release, runtime_name, cri_handler, driver, path, abs_path, abs_paths,
                                 namespace, pci_id, gpg_key, listen, packages, package, boolean, engine_option,
                                 user_name)}

# The fleet role's module parameters (the bootstrap options they pass, options.MODULE_PARAMS) -> the rule of each
# value, for lists each element and for `mirrors` each URL. bootstrap's options take the same rules from this table
# (options.param_rule), so a value the role accepts is one the CLI accepts (tests/faults/test_values_round2.py).
# Parameters with choices (the stages included) are held to options.py's enums by tests/unit/test_option_choices.py.
PARAMS = {
    "driver": "driver",
    "runtime_name": "runtime_name",
    "bundle": "path",
    "bundle_keyring": "path",
    "for_gpus": "pci_id",
    "kernels": "kernel_release",
    "mirrors": "url",
    "engine_options": "engine_option",  # the dict's entries, each as KEY=JSON (engine_option_text)
    "engine_users": "user_name",
}


def check(rule: str, value):
    """`value` if it passes `rule`, else BadValue. None passes (an option not given); a list or tuple is checked
    element by element and a dict by its values (the role's `mirrors`)."""
    fn = RULES[rule]
    if value is None:
        return value
    if rule == "engine_option" and isinstance(value, dict):  # the role's dict: each entry as its KEY=JSON option
        for k, v in value.items():
            fn(engine_option_text(str(k), v))
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
    for v in items:
        fn(v.__fspath__() if hasattr(v, "__fspath__") else v)  # a pathlib.Path option is checked as its text
    return value


def check_params(params: dict) -> list[str]:
    """The module's parameters against PARAMS: one `NAME VALUE: RULE` line per value that breaks its rule."""
    out = []
    for name, rule in PARAMS.items():
        try:
            check(rule, params.get(name))
        except BadValue as exc:
            out.append(f"{name} {exc}")
    return out

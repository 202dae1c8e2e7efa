"""The runtime's settings file, /etc/gpuprov/runtime.json (GPUPROV_RUNTIME_CONFIG overrides the path, for tests):
its keys, the rule each value follows (provision/values.py, the rules the CLI's options follow too) and its strict
reading. provision/inject/settings.py turns the result into the typed `Settings`.

Strict, so that a mistake fails closed: a value of the wrong type (`"accept_env_unprivileged": "false"`, a string,
is truthy), an unknown or repeated key, a file that is not one JSON object or cannot be read, each refuses GPU
containers with one line naming the file and the key, instead of running them under a policy nobody set.

Kept apart from settings.py and import-light (no dataclasses: 13 ms, -X importtime): the Python front-end reads
`runc` here on every container start, GPU or not."""
from __future__ import annotations

import json
import os

from provision import paths
from provision.errors import CONFIG_INVALID, GpuprovError, Refused
from provision.values import BadValue, abs_path, boolean

DEFAULT_PATH = "/etc/gpuprov/runtime.json"

# key -> (rule, default, may be null). The defaults are what a host without the file gets.
FIELDS = {
    # the low-level runtime to hand over to; null = runc found on PATH
    "runc": (abs_path, None, True),
    # where the driver's userspace lives: "/", "/usr/local/nvidia", "/run/nvidia/driver"
    "driver_root": (abs_path, "/", False),
    # where the host's /dev and /proc are (tests point these at a tree of real mknod nodes and a capture)
    "dev_root": (abs_path, "/", False),
    "proc_root": (abs_path, "/", False),
    "cache": (abs_path, paths.DISCOVERY_CACHE, False),
    # Multi-tenant hosts turn this off: unprivileged containers then get GPUs only through device-list mounts
    # under /var/run/nvidia-container-devices/ (what Kubernetes device plugins pass), never from their own env.
    "accept_env_unprivileged": (boolean, True, False),
    # Written by `gpuprov share enable`: where MPS runs, its defaults; no file there = sharing off.
    "share_state": (abs_path, paths.SHARE_STATE, False),
}
DEFAULTS = {k: default for k, (_, default, _) in FIELDS.items()}


class SettingsInvalid(GpuprovError):
    """runtime.json breaks a rule: GPU containers are refused (the runtime) and commands that read it stop."""
    exit_code = CONFIG_INVALID


class SettingsMissing(Refused):
    """No runtime.json: the runtime was never installed here, or was uninstalled while an engine still names it.
    A GPU container is refused (exit 10) without acting on the defaults: no discovery, no cache under /var/lib/gpuprov
    for a driver root nobody chose. Containers without GPUs still start."""


def settings_path() -> str:
    return os.environ.get("GPUPROV_RUNTIME_CONFIG", DEFAULT_PATH)


def _refuse(path: str, what: str) -> SettingsInvalid:
    return SettingsInvalid(f"{path}: {what}; GPU containers are refused until it is fixed "
                           "(`gpuprov runtime install` writes a valid one)")


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"the key {k!r} is given twice")
        seen[k] = v
    return seen


def check_fields(raw, path: str, only: tuple[str, ...] | None = None) -> dict:
    """Every key known, every value by its rule: the settings as a dict of all keys (defaults for those not given).
    Raises SettingsInvalid naming the file and the first key that breaks its rule. `only`: check just these keys."""
    if not isinstance(raw, dict):
        raise _refuse(path, "not a JSON object")
    for key, value in raw.items():
        if only is not None and key not in only:
            continue
        if key not in FIELDS:
            raise _refuse(path, f"unknown key {key!r} (known: {', '.join(FIELDS)})")
        rule, _, nullable = FIELDS[key]
        if value is None and nullable:
            continue
        try:
            rule(value)
        except BadValue as exc:
            raise _refuse(path, f"{key!r} is {json.dumps(value)}, must be {exc.rule}") from None
    return {**DEFAULTS, **raw}


def read_fields(path: str | None = None, only: tuple[str, ...] | None = None, required: bool = False) -> dict:
    """The file's settings, checked (check_fields); the defaults when there is no file, unless `required` (a GPU
    create): then SettingsMissing, before anything is read or written under the defaults' paths."""
    path = path or settings_path()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        if required:
            raise SettingsMissing(f"{path} does not exist: GPU containers are refused until "
                                  "`gpuprov runtime install` writes it") from None
        return dict(DEFAULTS)
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror})") from None
    try:
        raw = json.loads(data, object_pairs_hook=_no_repeats)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a repeated key
        raise _refuse(path, f"not valid JSON ({exc})") from None
    return check_fields(raw, path, only)


def runc_program(fields: dict | None = None) -> str:
    """The low-level runtime to exec: the setting, else runc on PATH. Without `fields`, the file's `runc` alone is
    checked: a container that asks for no GPU runs whatever the other keys say (as under the compiled front-end,
    which has runc built in), while every GPU container is refused until the file is valid."""
    fields = read_fields(only=("runc",)) if fields is None else fields
    if fields["runc"]:
        return fields["runc"]
    import shutil  # lazy: 2.2 ms (-X importtime -I -S, min of 15) on each runtime start; only without a runc setting

    return shutil.which("runc") or "/usr/sbin/runc"

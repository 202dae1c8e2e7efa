"""containerd: gpuprov's runtime goes into a drop-in, `conf.d/99-gpuprov.toml` beside the main config, which the main
config imports (the way `nvidia-ctk` does it). The operator's config.toml keeps every byte but one `imports` entry;
removing the drop-in and that entry unregisters the runtime.

How containerd reads imports decides what the drop-in must hold (measured with `containerd config dump`, see
tests/unit/test_containerd_dropin.py and tests/cri/):
- containerd 1.x (1.6 bookworm, 1.7 trixie): a plugin section in an imported file *replaces* that plugin's whole
  section from earlier files. A drop-in holding only `runtimes.nvidia` would wipe the operator's CRI settings
  (sandbox_image, registry mirrors, their runc entry — and with it the default runtime, so the CRI plugin would not
  start). So on 1.x the drop-in carries the CRI section exactly as containerd reads it today (from the last file
  that defines it: config.toml or one of its imports) plus gpuprov's runtime.
- containerd 2.x merges imported plugin sections key by key: the drop-in holds gpuprov's keys only.
Files are read in containerd's order (the main config, then its imports breadth first, relative paths from the
importing file's directory, globs sorted), so what gpuprov copies is what containerd would use.

After writing, `containerd config dump` (the binary of the live daemon when one reads this config, else the one on
PATH) must show the runtime, and every setting the dump showed before must still be there with the same value;
otherwise configure rolls both files back (engines/configure.py).
"""
from __future__ import annotations

import base64
import copy
import fnmatch
import glob
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tomlkit

from provision import effects
from provision.engines import cri as cri_names
from provision.engines import validate
from provision.engines.base import (
    Change,
    ContainerRun,
    Daemon,
    Engine,
    EnginePlan,
    FileEdit,
    ImageImport,
    Run,
    RuntimeRequest,
    Validation,
    flag_value,
    read_config,
    undo_text,
)
from provision.engines.dropin import undo_dropin
from provision.errors import ConfigInvalid, RuntimeConflict, StepFailed
from provision.facts.engine_data import StoredData, containerd_store
from provision.facts.engines import CRI_PLUGIN, spec
from provision.facts.rootfs import is_live, under

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # pragma: no cover - Python 3.9/3.10
    tomllib = None

CONFIG = "/etc/containerd/config.toml"
LIVE = Path("/")
DROPIN = Path("conf.d") / "99-gpuprov.toml"  # relative to the main config's directory
# The CRI plugin per config version: CRI_PLUGIN (facts/engines.py). Runtimes live in its `containerd.runtimes`;
# enable_cdi and cdi_spec_dirs directly in it (version 3 split the CRI plugin; the runtime part holds all three).
CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]
RUNC_TYPE = "io.containerd.runc.v2"
ZERO = ("", 0, False, [], {})  # Go's zero values as a dump shows them
HEADER = ("# Written by gpuprov (engine configure containerd): its GPU runtime as a CRI handler.\n"
          "# To unregister, remove this file and its entry in the main config's `imports`.\n")


@dataclass(frozen=True)
class Binary:
    """The containerd that will read the config: its path and version decide the import semantics and CDI."""

    path: str | None
    version: tuple[int, int] | None  # (major, minor); None: unknown (no binary)

    @property
    def deep_merge(self) -> bool:
        return self.version is not None and self.version >= (2, 0)

    @property
    def cdi(self) -> bool:
        """CDI in the CRI plugin (`enable_cdi`) exists from 1.7. Unknown: written (1.6 ignores the key)."""
        return self.version is None or self.version >= (1, 7)

    @property
    def native_version(self) -> int:
        return 3 if self.deep_merge else 2


def binary_version(path: str) -> tuple[int, int] | None:
    """`containerd --version` → (major, minor), e.g. "containerd github.com/containerd/containerd/v2 2.1.9+unknown"."""
    r = effects.try_run([path, "--version"], timeout=20)
    if r is None:
        return None
    m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_binary(live_exe: str | None = None) -> Binary:
    path = live_exe or shutil.which("containerd")
    return Binary(path, binary_version(path) if path else None)


# --- reading configs as containerd does ----------------------------------------------------------------------------

@dataclass
class Source:
    path: Path
    doc: dict  # plain values
    version: int

    def cri(self) -> dict | None:
        node = self.doc.get("plugins", {}).get(CRI_PLUGIN[self.version])
        return node if isinstance(node, dict) else None


def parse(text: str, path: Path | str):
    """A tomlkit document of a containerd config, refused (ConfigInvalid, exit 6) where containerd would refuse it
    or where gpuprov could not edit it without losing something: not TOML, duplicate keys, `version` not an
    integer containerd knows, `imports` not a list of strings, a runtime that is not a table."""
    try:
        doc = tomlkit.parse(text)
    except Exception as exc:  # tomlkit's ParseError subclasses (duplicate keys included)
        raise ConfigInvalid(f"{path} is not valid TOML ({exc}); fix it, then run again (the file was not "
                            "changed)") from None
    plain = doc.unwrap()
    version = plain.get("version", 1)
    if type(version) is not int or version not in CRI_PLUGIN:
        raise ConfigInvalid(f"{path}: `version = {tomlkit.item(version).as_string()}` is not a containerd config "
                            "version (an integer: 1, 2 or 3); fix it, then run again (the file was not changed)")
    imports = plain.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise ConfigInvalid(f"{path}: `imports` must be a list of file names; fix it, then run again (the file "
                            "was not changed)")
    cri = plain.get("plugins", {}).get(CRI_PLUGIN[version], {}) if isinstance(plain.get("plugins"), dict) else {}
    runtimes = cri.get("containerd", {}).get("runtimes", {}) if isinstance(cri, dict) else {}
    for name, rt in (runtimes.items() if isinstance(runtimes, dict) else [("", runtimes)]):
        if not isinstance(rt, dict) or not isinstance(rt.get("options", {}), dict):
            raise ConfigInvalid(f"{path}: runtime {name!r} is not a table; fix it, then run again (the file was "
                                "not changed)")
    return doc


def _at(root: Path, path: Path | str) -> Path:
    """A host path as read under `root` (a `--root` tree); itself on the live host."""
    return Path(path) if root == LIVE else under(root, str(path))


def resolve_imports(importer: Path, entries: list[str], root: Path = LIVE) -> list[Path]:
    """containerd's resolveImports: relative to the importing file's directory; globs expanded (in the tree under
    `root`) and sorted. Host paths: what containerd on that host would open."""
    out: list[Path] = []
    for e in entries:
        p = e if os.path.isabs(e) else os.path.join(os.path.dirname(importer), e)
        if any(c in p for c in "*?["):
            found = sorted(glob.glob(str(_at(root, p))))
            out += [Path(x) if root == LIVE else Path("/", os.path.relpath(x, root)) for x in found]
        else:
            out.append(Path(p))
    return out


def _same(a: Path, b: Path, root: Path = LIVE) -> bool:
    return os.path.realpath(_at(root, a)) == os.path.realpath(_at(root, b))


def load_chain(main: Path, main_doc, skip: Path, root: Path = LIVE) -> list[Source]:
    """The files containerd reads for `main`, in its order (breadth first, each once), without `skip` (our own
    drop-in: what it holds is what we are about to compute). Paths are the host's, read under `root`."""
    sources: list[Source] = []
    pending: list[tuple[Path, object]] = [(main, main_doc)]
    seen: set[str] = set()
    while pending:
        path, doc = pending.pop(0)
        key = os.path.realpath(_at(root, path))
        if key in seen:
            continue
        seen.add(key)
        if doc is None:
            text = read_config(_at(root, path))
            if text is None:
                raise ConfigInvalid(f"{path} (imported by the containerd config) does not exist: containerd would "
                                    "not start; fix the `imports` list, then run again (nothing was changed)")
            doc = parse(text, path)
        plain = doc.unwrap()
        if not _same(path, skip, root):
            sources.append(Source(path, plain, plain.get("version", 1)))
        pending += [(p, None) for p in resolve_imports(path, plain.get("imports", []), root)]
    return sources


def imports_cover(main: Path, entries: list[str], target: Path, root: Path = LIVE) -> bool:
    """Whether one of `entries` (as containerd resolves them) names `target`, existing yet or not."""
    t = os.path.realpath(_at(root, target))
    for e in entries:
        p = e if os.path.isabs(e) else os.path.join(os.path.dirname(main), e)
        at = os.path.realpath(_at(root, p))
        if at == t or (any(c in p for c in "*?[") and fnmatch.fnmatch(t, at)):
            return True
    return False


def _non_zero(d: dict) -> dict:
    """A dump's entry without Go zero values ("", 0, false, []): an entry containerd decodes from a file starts from
    zero values, so leaving them out changes nothing and keeps the drop-in short."""
    out = {}
    for k, v in d.items():
        v = _non_zero(v) if isinstance(v, dict) else v
        if v not in ZERO or v is True:
            out[k] = v
    return out


def _merge_deep(into: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge_deep(into[k], v)
        else:
            into[k] = copy.deepcopy(v)
    return into


def effective_cri(sources: list[Source], binary: Binary, version: int) -> dict:
    """The CRI plugin table containerd would use, as the operator wrote it (no defaults). 1.x: the last file that
    defines it wins whole; 2.x: all files merged key by key."""
    mine = [s for s in sources if s.cri() is not None]
    other = [s for s in mine if s.version != version]
    if other and not binary.deep_merge:
        raise ConfigInvalid(f"{other[0].path} is a version-{other[0].version} containerd config and defines the CRI "
                            f"plugin, but {sources[0].path} is version {version}: make them one version "
                            "(`containerd config migrate`), then run again (nothing was changed)")
    if binary.deep_merge:
        out: dict = {}
        for s in mine:
            if s.version == version:
                _merge_deep(out, s.cri())
        return out
    return copy.deepcopy(mine[-1].cri()) if mine else {}


# --- the plan --------------------------------------------------------------------------------------------------------

@dataclass
class DropinPlan:
    """The two files (main config, drop-in) as they are and as gpuprov would write them, and what changes."""

    main: Path
    dropin: Path
    main_old: str | None
    main_new: str
    dropin_old: str | None
    dropin_new: str
    changes: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def edits(self) -> list[tuple[Path, str | None, str]]:
        """Drop-in first: the import line must never name a file that is not there yet."""
        return [(p, o, n) for p, o, n in ((self.dropin, self.dropin_old, self.dropin_new),
                                         (self.main, self.main_old, self.main_new)) if o != n]


def dropin_path(main: Path) -> Path:
    return main.parent / DROPIN


def unimport(main: Path, text: str, dropin: Path, rec: dict | None, root: Path = LIVE) -> str | None:
    """The main config without the `imports` entry naming gpuprov's drop-in (None: it has none; "": gpuprov
    created the file and nothing else is in it). An operator's glob that covers the drop-in stays. The `imports`
    key goes too where gpuprov added it. The operator's exact bytes where gpuprov's line changes come out cleanly
    (base.undo_text) and read the same; else tomlkit's edit of the parsed file (comments and layout kept)."""
    doc = parse(text, main)
    imports = doc.unwrap().get("imports", [])
    ours = [i for i, e in enumerate(imports) if not any(ch in e for ch in "*?[") and _same(
        Path(e if os.path.isabs(e) else os.path.join(os.path.dirname(main), e)), dropin, root)]
    if not ours:
        return None
    old = rec.get("old") if rec else None
    had_imports = old is not None and "imports" in parse(old, main).unwrap()
    for i in reversed(ours):
        del doc["imports"][i]
    if not doc["imports"] and not had_imports:
        del doc["imports"]
    if rec and old is None and set(doc.unwrap()) <= {"version"}:
        return ""  # gpuprov wrote the file (version + imports) and the operator added nothing
    undone = undo_text(old, rec["written"], text) if rec else None
    if undone is not None and parse(undone, main).unwrap() == doc.unwrap():
        return undone
    return tomlkit.dumps(doc)


def plan(main: Path, *, runtime_name: str, runtime_path: str, default: bool = False, cdi: bool = False,
         replace: bool = False, binary: Binary, runc_from_dump: dict | None = None, root: Path = LIVE) -> DropinPlan:
    """What configuring containerd would write. Reads files only. `runc_from_dump`: the runc entry exactly as
    `containerd config dump` shows it (defaults filled in), used where the operator wrote none. `main` and every
    path in the plan (the `imports` entry written into the file included) are host paths, read under `root`."""
    cri_names.validate(runtime_name, runtime_path)
    dropin = dropin_path(main)
    main_old = read_config(_at(root, main))
    main_doc = parse(main_old, main) if main_old is not None else tomlkit.document()
    version = main_doc.unwrap().get("version", 1) if main_old is not None else binary.native_version
    if version == 1 and binary.deep_merge:
        raise ConfigInvalid(f"{main} is a version-1 containerd config, which containerd "
                            f"{'.'.join(map(str, binary.version))} no longer reads: run `containerd config migrate`, "
                            "then run again (nothing was changed)")
    if version == 3 and binary.version is not None and not binary.deep_merge:
        # 1.x reads a version-3 file without a word and ignores its plugin sections (CRI is not where it looks).
        raise ConfigInvalid(f"{main} is a version-3 containerd config, which only containerd 2.0 and later read; "
                            f"this containerd is {'.'.join(map(str, binary.version))}, which reads versions 1 and 2: "
                            "write it as `version = 2` (or upgrade containerd), then run again (nothing was changed)")
    sources = load_chain(main, main_doc, dropin, root) if main_old is not None else []
    cri = effective_cri(sources, binary, version)
    _refuse_operators_runtime(cri, runtime_name, runtime_path, default, replace)
    section, changes, warnings = _cri_section(cri, binary, version, runtime_name, runtime_path, default, cdi,
                                              runc_from_dump)
    doc = tomlkit.document()
    doc["version"] = version
    doc["plugins"] = {CRI_PLUGIN[version]: section}
    dropin_new = HEADER + tomlkit.dumps(doc)

    main_new = main_old
    imports = main_doc.unwrap().get("imports", [])
    if not imports_cover(main, imports, dropin, root):
        if main_old is None:
            main_doc["version"] = version
        if "imports" in main_doc:
            main_doc["imports"].append(str(dropin))
        else:
            main_doc["imports"] = [str(dropin)]
        main_new = tomlkit.dumps(main_doc)
        changes.append(("imports", f"+ {dropin}"))
    return DropinPlan(main, dropin, main_old, main_new or "", read_config(_at(root, dropin)), dropin_new, changes,
                      warnings)


def _refuse_operators_runtime(cri: dict, runtime_name: str, runtime_path: str, default: bool, replace: bool) -> None:
    """A runtime of that name pointing elsewhere, or another default runtime, is the operator's: exit 14 unless
    --replace-runtime."""
    containerd = cri.get("containerd", {})
    theirs = containerd.get("runtimes", {}).get(runtime_name)
    if theirs is not None and theirs.get("options", {}).get("BinaryName") != runtime_path and not replace:
        raise RuntimeConflict(f"containerd already has a runtime {runtime_name!r} "
                              f"({theirs.get('options', {}).get('BinaryName') or theirs.get('runtime_type')}): it is "
                              f"yours, so gpuprov leaves it; use another --runtime-name, or --replace-runtime to "
                              "replace it (nothing was changed)")
    current_default = containerd.get("default_runtime_name")
    if default and current_default not in (None, "runc", runtime_name) and not replace:
        raise RuntimeConflict(f"containerd's default runtime is {current_default!r}, set by you: gpuprov leaves it; "
                              "drop --default, or add --replace-runtime (nothing was changed)")


def _cri_section(cri: dict, binary: Binary, version: int, runtime_name: str, runtime_path: str, default: bool,
                 cdi: bool, runc_from_dump: dict | None) -> tuple[dict, list[tuple[str, str]], list[str]]:
    """The drop-in's CRI plugin section, the changes it makes and the warnings. 2.x merges imports key by key, so
    the section holds only ours; 1.x replaces a whole section, so it repeats the effective one with ours added."""
    runtimes = cri.get("containerd", {}).get("runtimes", {})
    # The runc entry as containerd uses it: from its own dump when there is a binary (defaults such as 2.x's
    # `sandboxer` filled in), else as written in the files.
    runc = _non_zero(runc_from_dump or {}) or runtimes.get("runc") or {"runtime_type": RUNC_TYPE}
    # Ours: the runc entry's settings (SystemdCgroup, sandboxer, …) with gpuprov's runtime as the binary. Never a
    # previous entry of the same name: its args and options belonged to another binary.
    ours = copy.deepcopy(runc)
    ours["runtime_type"] = RUNC_TYPE
    ours.setdefault("options", {})["BinaryName"] = runtime_path
    changes = [(f"{CRI_PLUGIN[version]}.containerd.runtimes.{runtime_name}", runtime_path)]
    warnings: list[str] = []
    if binary.deep_merge:
        section: dict = {"containerd": {"runtimes": {runtime_name: ours}}}
    else:
        section = copy.deepcopy(cri)
        rts = section.setdefault("containerd", {}).setdefault("runtimes", {})
        # An explicit runtimes table replaces containerd's default one: keep a runc entry (the default handler).
        rts.setdefault("runc", copy.deepcopy(runc))
        rts[runtime_name] = ours
    if default:
        section.setdefault("containerd", {})["default_runtime_name"] = runtime_name
        changes.append(("default_runtime_name", runtime_name))
    if cdi:
        if binary.cdi:
            section["enable_cdi"] = True
            section["cdi_spec_dirs"] = cri.get("cdi_spec_dirs", CDI_DIRS)
            changes.append(("enable_cdi", "true"))
        else:
            warnings.append(f"containerd {'.'.join(map(str, binary.version))} has no CDI support (1.7 and later "
                            "have): GPUs reach containers through the runtime (device plugin envvar or "
                            "volume-mounts strategy)")
    return section, changes, warnings


# --- checks with containerd itself ---------------------------------------------------------------------------------

def config_dump(binary: str, main: Path) -> dict:
    """`containerd --config MAIN config dump` as data (its stdout; warnings go to stderr)."""
    try:
        p = effects.run([binary, "--config", str(main), "config", "dump"], check=False, timeout=60)
    except StepFailed as exc:
        raise StepFailed(f"`{binary} config dump` could not run: {exc}") from None
    if p.returncode != 0:
        raise StepFailed(f"`{binary} --config {main} config dump` failed: {p.stderr.strip()[-300:]}")
    return _toml_loads(p.stdout)


def operators_dump(binary: str, main: Path) -> dict:
    """`config dump` of the operator's own configuration: without gpuprov's drop-in (a copy of the main config whose
    imports are resolved as containerd resolves them, minus the drop-in), so that a re-run compares with what the
    operator has now, not with gpuprov's earlier copy."""
    dropin = dropin_path(main)
    if not main.exists():
        return config_dump(binary, Path("/dev/null"))  # containerd's defaults (an empty file reads as one)
    if not dropin.exists():
        return config_dump(binary, main)
    doc = parse(read_config(main) or "", main)
    doc["imports"] = [str(p) for p in resolve_imports(main, doc.unwrap().get("imports", [])) if not _same(p, dropin)]
    with tempfile.TemporaryDirectory(prefix="gpuprov-containerd-") as td:
        copy_ = Path(td) / "config.toml"
        copy_.write_text(tomlkit.dumps(doc))
        return config_dump(binary, copy_)


def dump_cri(dump: dict) -> dict:
    """The CRI runtime table of a dump (dumps are always the binary's native version: 2 on 1.x, 3 on 2.x)."""
    plugins = dump.get("plugins", {})
    return plugins.get(CRI_PLUGIN[dump.get("version", 2)], {})


def dump_runtime(dump: dict, runtime_name: str) -> dict | None:
    return dump_cri(dump).get("containerd", {}).get("runtimes", {}).get(runtime_name)


def runtime_in_dump(dump_text: str, runtime_name: str) -> bool:
    """Whether `containerd config dump` output (its text) lists the runtime (verify uses it on remote hosts)."""
    try:
        return dump_runtime(_toml_loads(dump_text), runtime_name) is not None
    except ValueError:
        return False


def _toml_loads(text: str) -> dict:
    if tomllib is None:  # pragma: no cover - hosts with Python 3.9/3.10
        try:
            return tomlkit.parse(text).unwrap()
        except Exception as exc:
            raise ValueError(str(exc)) from None
    return tomllib.loads(text)


def _leaves(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, (*prefix, k))
    else:
        yield prefix, d


def lost_settings(before: dict, after: dict, *, runtime_name: str, default: bool, cdi: bool) -> list[str]:
    """Settings `containerd config dump` showed before that are gone or changed after, except gpuprov's own."""
    cri = ("plugins", CRI_PLUGIN[before.get("version", 2)])
    ours = {(*cri, "containerd", "runtimes", runtime_name), ("imports",)}
    if default:
        ours.add((*cri, "containerd", "default_runtime_name"))
    if cdi:
        ours |= {(*cri, "enable_cdi"), (*cri, "cdi_spec_dirs")}
    lost = []
    for path, value in _leaves(before):
        if any(path[:len(o)] == o for o in ours):
            continue
        node = after
        for k in path:
            node = node.get(k, KeyError) if isinstance(node, dict) else KeyError
        if node != value and not (node is KeyError and value in ZERO):  # an absent key reads as Go's zero value
            lost.append(".".join(path))
    return lost


def check_dump(binary: str, main: Path, *, runtime_name: str, runtime_path: str, default: bool, cdi: bool,
               before: dict | None) -> str | None:
    """None when containerd reads the written config as intended; else why not (one line)."""
    try:
        after = config_dump(binary, main)
    except StepFailed as exc:
        return str(exc)
    rt = dump_runtime(after, runtime_name)
    if rt is None or rt.get("options", {}).get("BinaryName") != runtime_path:
        return f"`containerd config dump` does not show runtime {runtime_name!r} -> {runtime_path}"
    if default and dump_cri(after).get("containerd", {}).get("default_runtime_name") != runtime_name:
        return f"`containerd config dump` does not show default_runtime_name = {runtime_name!r}"
    if before is not None:
        lost = lost_settings(before, after, runtime_name=runtime_name, default=default, cdi=cdi)
        if lost:
            return f"the edit would change settings of yours: {', '.join(lost[:5])}"
    return None


# The CRI plugin's ids in `disabled_plugins` (containerd 1.x/2.x; version 3 configs split it, the runtime part holds
# the handlers).
CRI_IDS = {"cri", "io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"}


def _refuse_cri_disabled(path: Path, dump: dict | None) -> None:
    """Docker's containerd.io ships a config.toml with `disabled_plugins = ["cri"]`: runtime handlers live in the CRI
    plugin, so with it off a registered runtime exists for no one. That is the operator's setting (Docker needs no
    CRI): refused (exit 14) with the way to turn it on, nothing changed."""
    off = [p for p in (dump or {}).get("disabled_plugins") or () if p in CRI_IDS]
    if off:
        raise RuntimeConflict(
            f"{path}: disabled_plugins lists {off[0]!r} (the default of Docker's containerd.io): containerd's CRI "
            "plugin, where runtime handlers live, is off, so gpuprov's runtime would be registered for no one. "
            f"Remove {off[0]!r} from disabled_plugins (Docker keeps working) and restart containerd, then run "
            "again; nothing was changed")


# --- the adapter ---------------------------------------------------------------------------------------------------

def _names_binary(info: str, binary: str) -> bool:
    """`ctr containers info`'s JSON names `binary` in its runtime options: plain, or inside the protobuf of
    Runtime.Options.value (base64: runc's options message carries BinaryName as its bytes)."""
    try:
        opts = (json.loads(info).get("Runtime") or {}).get("Options") or {}
    except (ValueError, AttributeError):
        return False
    raw = opts.get("value", "") if isinstance(opts, dict) else ""
    try:
        decoded = base64.b64decode(raw) if isinstance(raw, str) else b""
    except ValueError:
        decoded = b""
    return binary.encode() in decoded or binary in json.dumps(opts)


class ContainerdEngine(Engine):
    """containerd behind the Engine interface: plan = the drop-in and the `imports` entry; check = `containerd config
    dump` (runtime listed, nothing of the operator's changed; else configure rolls both files back); apply = a
    restart (containerd reads its config only at start)."""

    name = "containerd"
    title = "containerd"
    default_config = CONFIG
    daemon_names = ("containerd",)
    unit = "containerd"
    ready_argv = ("ctr", "version")
    serves_cri = True
    check_log = True  # ctr's own stdout can drop a short-lived container's output (plan/steps.RunContainer)
    cgroup_prefixes = (("cri-containerd-", "containerd"),)

    # Debian's containerd (and Docker CE's containerd.io): their purge deletes nothing under /var/lib/containerd
    # (bookworm's 1.6.20 and trixie's 1.7.24 postrm: the unit's state only), so a purge keeps it.
    data_root = "/var/lib/containerd"
    data_packages = tuple(o.package for o in spec("containerd").packages)

    def stored(self, root: Path) -> StoredData | None:
        """The live containerd's containers and images in every namespace but gpuprov's own and dockerd's (`moby`:
        Docker's containers, counted as Docker's), as NAMESPACE/NAME; without its daemon, what its files hold."""
        if not under(root, self.data_root).is_dir():
            return None
        r = effects.try_run(["ctr", "namespaces", "ls", "-q"], timeout=20, probe=True) \
            if is_live(root) and validate.ctr_reachable() else None
        if r is None or r.returncode != 0:
            return containerd_store(root, self.data_root)
        containers, images = [], []
        for ns in (n for n in r.stdout.split() if n not in (validate.CTR_NAMESPACE, "moby")):
            for kind, out in (("containers", containers), ("images", images)):
                got = effects.try_run(["ctr", "-n", ns, kind, "ls", "-q"], timeout=30, probe=True)
                if got is None or got.returncode != 0:
                    return containerd_store(root, self.data_root)
                out += [f"{ns}/{x}" for x in got.stdout.split()]
        return StoredData(self.data_root, "the running containerd", tuple(sorted(containers)), tuple(sorted(images)))

    def tasks_under(self, binary: str) -> list[str]:
        """The running tasks, in every namespace (`ctr`, CRI's k8s.io included), whose container's runtime options
        name `binary` as runc (BinaryName: CRI's handler `nvidia`, `ctr run --runc-binary`): NAMESPACE/ID. Their
        shim execs that binary to kill and delete them, whatever containerd's config says by then. [] without an
        answer."""
        r = effects.try_run(["ctr", "namespaces", "ls", "-q"], timeout=20) if validate.ctr_reachable() else None
        out = []
        for ns in (r.stdout.split() if r is not None and r.returncode == 0 else []):
            t = effects.try_run(["ctr", "-n", ns, "tasks", "ls"], timeout=20)
            rows = [ln.split() for ln in (t.stdout if t is not None and t.returncode == 0 else "").splitlines()[1:]]
            for cid in [row[0] for row in rows if len(row) >= 3 and row[-1] == "RUNNING"]:
                info = effects.try_run(["ctr", "-n", ns, "containers", "info", cid], timeout=20)
                if info is not None and info.returncode == 0 and _names_binary(info.stdout, binary):
                    out.append(f"{ns}/{cid}")
        return out

    def __init__(self) -> None:
        self.binary: Binary | None = None
        self.before: dict | None = None
        self.restarted = False

    def packages(self, target, source: str) -> tuple[str, ...]:
        return ("containerd",) if target.family == "debian" else ("containerd.io",)

    def validation(self, runtime_name: str, runtime_path: str, gpu: bool) -> Validation:
        """The image as an OCI archive in gpuprov's namespace, a leftover container removed, then the containers
        run with `runtime_path` (the binary the handler names) as runc, their output read from the shim's log."""
        image = ImageImport(validate.CTR_IMAGE, (*validate.CTR, "images", "import", "-"), oci=True)
        runs = [ContainerRun(validate.ctr_remove_argv(), may_fail=True)]
        runs += [ContainerRun(a, validate.ctr_log(), expect=None if i else validate.OK_WORD)
                 for i, a in enumerate(validate.ctr_run_argvs(runtime_path, gpu))]
        return Validation(image, tuple(runs), f" (containerd, namespace {validate.CTR_NAMESPACE})")

    def node_probe(self, run: Run) -> str | None:
        rc, out, _ = run(list(self.ready_argv))
        return out if rc == 0 and "Server:" in out else None

    def node_runtime(self, run: Run, probe: object, name: str, runtime_path: str) -> tuple[str | None, str | None]:
        rc, out, err = run(["containerd", "config", "dump"])
        if rc != 0:
            return None, f"`containerd config dump` failed: {(err or out).strip()[-200:]}"
        if not runtime_in_dump(out, name):
            return None, f"runtime {name!r} is not in containerd's CRI config: run gpuprov engine configure containerd"
        return runtime_path, None

    def check_container_argv(self, cid: str, env: dict[str, str], argv: list[str], runtime_path: str, rootfs: str,
                             log: str) -> list[str]:
        """A plain rootfs (`ctr run --rootfs`) through the runtime binary as runc, its output written to `log`."""
        envs = [a for k, v in {"PATH": "/usr/bin:/bin", **env}.items() for a in ("--env", f"{k}={v}")]
        logs = ["--log-uri", f"file://{log}"] if log else []  # a bare rootfs has no image config: PATH as docker's
        return [*validate.CTR, "run", "--rm", *logs, "--runc-binary", runtime_path, *envs, "--rootfs", rootfs, cid,
                *argv]

    def prepare_check_image(self, rootfs: str) -> None:
        """The check image's files unpacked at `rootfs`, once per image (its stamp)."""
        root = Path(rootfs)
        stamp = root / ".gpuprov-image"
        if stamp.exists() and stamp.read_text() == validate.IMAGE:
            return
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, mode=0o755)
        with tarfile.open(fileobj=io.BytesIO(validate.build_image_tar())) as tar:
            tar.extractall(root)  # our own tar, built a moment ago from this host's files
        stamp.write_text(validate.IMAGE)

    def cri_handler(self, run: Run, has_command, name: str) -> tuple[str, str] | None:
        rc, dump, _ = run(["containerd", "config", "dump"])
        if rc != 0:
            return None
        if not runtime_in_dump(dump, name):
            return "fail", f"containerd's merged config has no runtime {name!r}: run gpuprov k8s node"
        return "pass", self.title

    def has_cdi(self) -> bool:
        """containerd applies CDI from 1.7 (`enable_cdi`; 1.6 ignores the key, so CDI annotations would give pods no
        GPU)."""
        return find_binary().cdi

    def plan_under(self, root: Path, path: Path, req: RuntimeRequest) -> EnginePlan:
        """`plan` asks the live containerd (its version, `config dump`); a host tree's containerd cannot be run:
        planned from the files alone, as for a containerd of unknown version."""
        p = plan(path, runtime_name=req.name, runtime_path=req.path, default=req.default, cdi=req.cdi,
                 replace=req.replace, binary=Binary(None, None), root=root)
        return EnginePlan([FileEdit(f, old, new) for f, old, new in p.edits], [], p.warnings)

    def find_binary(self, path: Path) -> Binary:
        """The live daemon's own binary when one reads this config (its version is what counts), else PATH's."""
        daemon = self.live_daemon(path)
        exe = None
        if daemon is not None:
            try:
                exe = os.readlink(f"/proc/{daemon.pid}/exe")
                exe = exe if daemon.in_our_mount_namespace() and os.path.exists(exe) else None
            except OSError:
                exe = None
        return find_binary(exe)

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        cri_names.validate(req.name, req.path)
        self.binary = self.find_binary(path)
        if path.exists():  # refuse what gpuprov cannot read (exit 6) before asking containerd anything
            load_chain(path, parse(read_config(path) or "", path), dropin_path(path))
        if self.binary.path:
            try:
                self.before = operators_dump(self.binary.path, path)
            except StepFailed as exc:
                raise ConfigInvalid(f"containerd itself rejects {path} as it is ({exc}); fix it, then run again "
                                    "(nothing was changed)") from None
        _refuse_cri_disabled(path, self.before)
        p = plan(path, runtime_name=req.name, runtime_path=req.path, default=req.default, cdi=req.cdi,
                 replace=req.replace, binary=self.binary,
                 runc_from_dump=dump_runtime(self.before, "runc") if self.before else None)
        # containerd re-reads its config only at start: every change needs a restart.
        return EnginePlan([FileEdit(f, old, new) for f, old, new in p.edits],
                          [Change(k, v, reload=False) for k, v in p.changes] if p.edits else [], p.warnings)

    def daemon_config(self, argv: list[str]) -> str:
        return flag_value(argv, spec("containerd").config_flags) or CONFIG

    def unplan(self, path: Path, entry: dict | None, *, root: Path = Path("/")) -> EnginePlan:
        """The `imports` entry out of the main config (unimport: first, so that it never names a missing file),
        then gpuprov's drop-in removed (only gpuprov's keys out of it, and the import kept, where the operator added
        to it: dropin.undo_dropin); the conf.d directory gpuprov created goes with the step (uninstall)."""
        dropin = dropin_path(path)
        files = (entry or {}).get("files", {})
        undo = undo_dropin(dropin, read_config(_at(root, dropin)), (files.get(str(dropin)) or {}).get("written"),
                           HEADER.splitlines(), reload=False)  # containerd reads it only at start
        edits, removals, changes = list(undo.edits), list(undo.removals), list(undo.changes)
        current = read_config(_at(root, path))
        if current is not None and dropin in undo.removals:  # a drop-in that keeps the operator's keys stays imported
            new = unimport(path, current, dropin, files.get(str(path)), root)
            if new is not None:
                if new == "":
                    removals.append(path)
                else:
                    edits.append(FileEdit(path, current, new))
                changes.append(Change("imports", f"- {dropin}", reload=False))
        return EnginePlan(edits, changes, removals=sorted(removals, key=lambda p: p != path))

    def apply_how(self, restart: bool) -> str:
        return ("systemctl restart containerd (it reads its config only at start; running containers keep running: "
                "their shims outlive it)")

    def check(self, path: Path, req: RuntimeRequest) -> bool | None:
        if not (self.binary and self.binary.path):
            return None
        self.check_error = check_dump(self.binary.path, path, runtime_name=req.name, runtime_path=req.path,
                                      default=req.default, cdi=req.cdi, before=self.before)
        if self.check_error and "does not show runtime" in self.check_error and not self.binary.deep_merge:
            self.check_error += (f"; containerd {'.'.join(map(str, self.binary.version or ()))} lets a file imported "
                                 f"after {dropin_path(path)} that defines the CRI plugin replace its whole section: "
                                 "import gpuprov's drop-in last")
        return self.check_error is None

    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        if daemon.is_unit(self.unit):
            effects.restart_unit(self.unit, check=False)
            self.restarted = True
            return f"systemctl restart {self.unit}"
        return f"restart containerd (pid {daemon.pid}) to apply the change (it reads its config only at start)"

    def verify(self, daemon: Daemon, req: RuntimeRequest, *, wait: bool = True) -> bool | None:
        """After a restart: the CRI plugin loaded (`ctr plugins ls`: a CRI config containerd cannot use leaves it in
        `error`, and kubelet without a runtime)."""
        ctr = effects.which("ctr")
        if not (self.restarted and ctr and self.before is not None):
            return None
        address = self.before.get("grpc", {}).get("address") or "/run/containerd/containerd.sock"
        return effects.wait_for(lambda: cri_plugin_ok(address, ctr), 30 if wait else 0)


def cri_plugin_ok(address: str, ctr: str = "ctr") -> bool:
    """Whether the containerd on `address` runs its CRI plugin (`ctr plugins ls`: TYPE ID PLATFORMS STATUS; a CRI
    config it cannot use leaves `io.containerd.grpc.v1 cri` in `error`)."""
    p = effects.run([ctr, "--address", address, "plugins", "ls"], check=False, timeout=10)
    return p.returncode == 0 and any(ln.split()[:2] == ["io.containerd.grpc.v1", "cri"] and ln.split()[-1] == "ok"
                                     for ln in p.output.splitlines())

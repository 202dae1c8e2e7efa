"""CRI-O: gpuprov's runtime as a drop-in, `/etc/crio/crio.conf.d/99-gpuprov.conf`, never an edit of crio.conf.

CRI-O reads crio.conf, then every file of crio.conf.d in name order, later files overriding earlier ones key by
key; `99-` puts gpuprov's last. The drop-in is written with tomlkit (every string escaped as TOML wants it) from a
validated handler name and runtime path; its name is fixed, so no name can move it out of crio.conf.d. A runtime of
the same name pointing elsewhere, or another default runtime, in the operator's files is theirs: exit 14 unless
--replace-runtime.
"""
from __future__ import annotations

from pathlib import Path

import tomlkit

from provision import effects
from provision.engines import cri as cri_names
from provision.engines.base import (
    Change,
    Daemon,
    Engine,
    EnginePlan,
    FileEdit,
    RuntimeRequest,
    flag_value,
    read_config,
    same_file,
)
from provision.errors import ConfigInvalid, RuntimeConflict
from provision.facts.rootfs import under

MAIN = "/etc/crio/crio.conf"
DROPIN_DIR = "/etc/crio/crio.conf.d"
DROPIN_NAME = "99-gpuprov.conf"
RUNTIME_ROOT = "/run/gpuprov-runtime"  # the state directory CRI-O passes as the runtime's --root
CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]
HEADER = ("Written by gpuprov (engine configure crio): its GPU runtime as a CRI handler.\n"
          "Remove this file to unregister it.")
# CRI-O's own default runtimes (crun from 1.31; runc before): never the operator's choice to protect.
ENGINE_DEFAULTS = (None, "runc", "crun")


def dropin_path(runtime_name: str = "nvidia") -> str:
    """The drop-in's path (one file whatever the handler's name)."""
    return f"{DROPIN_DIR}/{DROPIN_NAME}"


def render(*, runtime_name: str = "nvidia", runtime_path: str, default: bool = False, cdi: bool = False) -> str:
    cri_names.validate(runtime_name, runtime_path)
    doc = tomlkit.document()
    for line in HEADER.splitlines():
        doc.add(tomlkit.comment(line))
    runtime = tomlkit.table()
    if default:
        runtime["default_runtime"] = runtime_name
    if cdi:
        runtime["cdi_spec_dirs"] = CDI_DIRS  # CRI-O's default too; written so that the node says what it serves
    entry = tomlkit.table()
    entry.update({"runtime_path": runtime_path, "runtime_type": "oci", "runtime_root": RUNTIME_ROOT})
    runtime["runtimes"] = {runtime_name: entry}
    doc["crio"] = {"runtime": runtime}
    return tomlkit.dumps(doc)


def _load(path: Path) -> dict:
    text = read_config(path)
    try:
        return tomlkit.parse(text or "").unwrap()
    except Exception as exc:  # tomlkit's ParseError subclasses (duplicate keys included)
        raise ConfigInvalid(f"{path} is not valid TOML ({exc}); fix it, then run again (nothing was "
                            "changed)") from None


def operator_files(dropin: Path) -> list[Path]:
    """crio.conf and the other drop-ins beside ours, in the order CRI-O reads them."""
    main = Path(MAIN) if dropin.parent == Path(DROPIN_DIR) else dropin.parent.parent / "crio.conf"
    others = sorted(p for p in dropin.parent.glob("*") if p.is_file() and not same_file(p, dropin)) \
        if dropin.parent.is_dir() else []
    return [p for p in [main, *others] if p.is_file()]


def conflicts(dropin: Path, req: RuntimeRequest) -> None:
    for f in operator_files(dropin):
        runtime = _load(f).get("crio", {}).get("runtime", {})
        theirs = runtime.get("runtimes", {}).get(req.name)
        if isinstance(theirs, dict) and theirs.get("runtime_path") not in (None, req.path) and not req.replace:
            raise RuntimeConflict(f"{f} already defines CRI-O runtime {req.name!r} ({theirs.get('runtime_path')}): "
                                  "it is yours, so gpuprov leaves it; use another --runtime-name, or "
                                  "--replace-runtime to override it (nothing was changed)")
        if req.default and runtime.get("default_runtime") not in (*ENGINE_DEFAULTS, req.name) and not req.replace:
            raise RuntimeConflict(f"{f} sets CRI-O's default_runtime = {runtime['default_runtime']!r}: gpuprov "
                                  "leaves it; drop --default, or add --replace-runtime (nothing was changed)")


class CrioEngine(Engine):
    name = "crio"
    default_config = DROPIN_DIR
    daemon_names = ("crio",)

    def config_path(self, config: str | None, req: RuntimeRequest) -> Path:
        """--config names the drop-in file, or the drop-in directory (then gpuprov's file goes in it)."""
        p = Path(config or DROPIN_DIR)
        return p / DROPIN_NAME if p.is_dir() or p.name.endswith(".d") else p

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        cri_names.validate(req.name, req.path)
        old = read_config(path)
        if old is not None:
            _load(path)  # ours, but edited by hand into something CRI-O cannot read: refuse, untouched
        conflicts(path, req)
        text = render(runtime_name=req.name, runtime_path=req.path, default=req.default, cdi=req.cdi)
        if text == old:
            return EnginePlan([], [])
        changes = [Change(f"crio.runtime.runtimes.{req.name}", req.path, reload=False)]
        if req.default:
            changes.append(Change("crio.runtime.default_runtime", req.name, reload=False))
        return EnginePlan([FileEdit(path, old, text)], changes)

    def check(self, path: Path, req: RuntimeRequest) -> bool | None:
        """The written file reads back as TOML with the runtime (CRI-O itself is not needed for that)."""
        rt = _load(path).get("crio", {}).get("runtime", {}).get("runtimes", {}).get(req.name, {})
        ok = rt.get("runtime_path") == req.path
        self.check_error = None if ok else f"{path} does not read back with runtime {req.name!r}"
        return ok

    def daemon_config(self, argv: list[str]) -> str:
        return flag_value(argv, ("--config-dir", "-d")) or DROPIN_DIR

    def unplan(self, path: Path, entry: dict | None, *, root: Path = Path("/")) -> EnginePlan:
        """gpuprov's drop-in removed, when it is gpuprov's (its header); the operator's files are never edited."""
        text = read_config(under(root, str(path)))
        if text is None or not text.startswith("# " + HEADER.splitlines()[0]):
            return EnginePlan([], [])
        return EnginePlan([], [Change(str(path), "removed", reload=False)], removals=[path])

    def apply_how(self, restart: bool) -> str:
        return "systemctl restart crio (it reads its drop-ins only at start)"

    def live_daemon(self, path: Path) -> Daemon | None:
        # CRI-O reads every file of its drop-in directory: the daemon that reads PATH is the one whose directory
        # holds it.
        for d in self.running_daemons():
            if same_file(path.parent, Path(d.path_in_its_root(d.config))):
                return d
        return None

    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        if daemon.is_unit("crio"):
            effects.run(["systemctl", "restart", "crio"], check=False)
            return "systemctl restart crio"
        return f"restart crio (pid {daemon.pid}) to apply the change (it reads its drop-ins only at start)"

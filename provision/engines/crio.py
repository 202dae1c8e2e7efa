"""CRI-O: gpuprov's runtime as a drop-in, `/etc/crio/crio.conf.d/99-gpuprov.conf`, never an edit of crio.conf.

CRI-O reads crio.conf, then every file of crio.conf.d in name order, later files overriding earlier ones key by
key; `99-` puts gpuprov's late, but not necessarily last (`zz-local.conf` sorts after it). The drop-in is written
with tomlkit (every string escaped as TOML wants it) from a validated handler name and runtime path; its name is
fixed, so no name can move it out of crio.conf.d. A runtime of the same name pointing elsewhere, or another default
runtime, in the operator's files is theirs: exit 14 unless --replace-runtime.

The proof is the merged configuration: `effective` folds every file in CRI-O's order, remembering which file set
each key last. A file read after gpuprov's that sets any of gpuprov's keys (its handler, `default_runtime` with
--default, `cdi_spec_dirs` with --cdi) would win over it: that is a conflict (exit 14 naming the file, at plan time),
and the written result is checked the same way (tests/faults/test_crio_merged_config.py).
"""
from __future__ import annotations

from pathlib import Path

import tomlkit

from provision import effects
from provision.engines import dropin
from provision.engines.base import (
    Change,
    Daemon,
    EnginePlan,
    FileEdit,
    RuntimeRequest,
    flag_value,
    monitored_by_gpuprov,
    same_file,
)
from provision.errors import RuntimeConflict

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
    doc = dropin.document(HEADER, RuntimeRequest(runtime_name, runtime_path))
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


_load = dropin.load


def operator_files(dropin: Path) -> list[Path]:
    """crio.conf and the other drop-ins beside ours, in the order CRI-O reads them."""
    return [p for p in read_order(dropin) if not same_file(p, dropin)]


def read_order(dropin: Path) -> list[Path]:
    """Every file CRI-O reads, gpuprov's drop-in included at its place (whether it exists yet or not)."""
    main = Path(MAIN) if dropin.parent == Path(DROPIN_DIR) else dropin.parent.parent / "crio.conf"
    inside = {p.name: p for p in dropin.parent.glob("*") if p.is_file()} if dropin.parent.is_dir() else {}
    inside = {n: p for n, p in inside.items() if not same_file(p, dropin)} | {dropin.name: dropin}
    return [p for p in [main] if p.is_file()] + [inside[n] for n in sorted(inside)]


def _fold(into: dict, origin: dict, doc: dict, path: Path, prefix: tuple = ()) -> None:
    for k, v in doc.items():
        if isinstance(v, dict):
            node = into.setdefault(k, {})
            if not isinstance(node, dict):
                node = into[k] = {}
            _fold(node, origin, v, path, (*prefix, k))
        else:
            into[k] = v
            origin[(*prefix, k)] = path


def effective(files: list[tuple[Path, dict]]) -> tuple[dict, dict[tuple, Path]]:
    """The configuration CRI-O builds from `files` (in its order), and for each key the file that set it last."""
    merged: dict = {}
    origin: dict[tuple, Path] = {}
    for path, doc in files:
        _fold(merged, origin, doc, path)
    return merged, origin


def owned_keys(req: RuntimeRequest) -> list[tuple]:
    """gpuprov's keys (prefixes): anything under them that a later file sets changes what gpuprov configured."""
    keys = [("crio", "runtime", "runtimes", req.name)]
    if req.default:
        keys.append(("crio", "runtime", "default_runtime"))
    if req.cdi:
        keys.append(("crio", "runtime", "cdi_spec_dirs"))
    return keys


def overridden(dropin: Path, ours: dict, req: RuntimeRequest) -> tuple[Path, str] | None:
    """(the file, the key) when a file CRI-O reads after gpuprov's drop-in sets one of gpuprov's keys."""
    order = read_order(dropin)
    later = set(order[[same_file(p, dropin) for p in order].index(True) + 1:])
    _, origin = effective([(p, ours if same_file(p, dropin) else _load(p)) for p in order])
    for key, path in origin.items():
        if path in later and any(key[:len(k)] == k for k in owned_keys(req)):
            return path, ".".join(key)
    return None


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


class CrioEngine(dropin.DropinEngine):
    """CRI-O: configured on an existing Kubernetes node (its drop-in), never installed or started by gpuprov."""
    name = "crio"
    title = "CRI-O"
    default_config = DROPIN_DIR
    main_config = MAIN
    dropin_name = DROPIN_NAME
    header = HEADER
    daemon_names = ("crio",)
    unit = "crio"
    serves_cri = True
    cgroup_prefixes = (("crio-", "cri-o"),)

    def cri_handler(self, run, has_command, name: str) -> tuple[str, str] | None:
        if run(["test", "-f", dropin_path(name)])[0] == 0:
            return "pass", self.title
        if has_command(self.daemon):
            return "fail", f"CRI-O has no gpuprov drop-in {dropin_path(name)}: run gpuprov k8s node"
        return None

    def has_cdi(self) -> bool:
        return True  # CRI-O always applies CDI devices

    def stranded(self, names: tuple[str, ...]) -> list[str]:
        """CRI-O's running containers under gpuprov's runtime, seen through their monitors (base.monitored_by_gpuprov:
        conmon or conmon-rs started with the handler's runtime path). CRI-O stops them through the handler its
        configuration names, which uninstall takes away with the drop-in, so uninstall refuses while one runs.
        Named as CRI-O names them (`-n`: k8s_CONTAINER_POD_…)."""
        return [m.name for m in monitored_by_gpuprov() if not m.podman]

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        old = dropin.read_ours(path, req)
        text = render(runtime_name=req.name, runtime_path=req.path, default=req.default, cdi=req.cdi)
        late = overridden(path, tomlkit.parse(text).unwrap(), req)
        if late:
            raise RuntimeConflict(f"{late[0]} is read after {path.name} and sets {late[1]}, so CRI-O would use its "
                                  "value, not gpuprov's: remove that setting from it or rename it to sort before "
                                  f"{path.name}, then run again (nothing was changed)")
        conflicts(path, req)
        if text == old:
            return EnginePlan([], [])
        changes = [Change(f"crio.runtime.runtimes.{req.name}", req.path, reload=False)]
        if req.default:
            changes.append(Change("crio.runtime.default_runtime", req.name, reload=False))
        return EnginePlan([FileEdit(path, old, text)], changes)

    def check(self, path: Path, req: RuntimeRequest) -> bool | None:
        """CRI-O's merged configuration over every file as written (CRI-O itself is not needed for that) has the
        runtime, and the default when asked, as gpuprov wrote them."""
        merged, _ = effective([(p, _load(p)) for p in read_order(path)])
        runtime = merged.get("crio", {}).get("runtime", {})
        late = overridden(path, _load(path), req)
        if runtime.get("runtimes", {}).get(req.name, {}).get("runtime_path") != req.path:
            self.check_error = f"CRI-O's merged configuration does not have runtime {req.name!r} -> {req.path}"
        elif req.default and runtime.get("default_runtime") != req.name:
            self.check_error = f"CRI-O's merged configuration does not have default_runtime = {req.name!r}"
        else:
            self.check_error = f"{late[0]} overrides {late[1]}" if late else None
        return self.check_error is None

    def daemon_config(self, argv: list[str]) -> str:
        return flag_value(argv, ("--config-dir", "-d")) or DROPIN_DIR

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
        if daemon.is_unit(self.unit):
            effects.restart_unit(self.unit, check=False)
            return f"systemctl restart {self.unit}"
        return f"restart crio (pid {daemon.pid}) to apply the change (it reads its drop-ins only at start)"

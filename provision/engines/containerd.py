"""containerd config.toml (v1: no version key, v2, v3) edited with tomlkit, keeping comments and other settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from provision import effects
from provision.engines.base import Change, Daemon, Engine, EnginePlan, FileEdit, RuntimeRequest, flag_value, read_config
from provision.errors import ConfigInvalid

CONFIG = "/etc/containerd/config.toml"
CRI_PATHS = {
    1: ("plugins", "cri", "containerd"),
    2: ("plugins", "io.containerd.grpc.v1.cri", "containerd"),
    3: ("plugins", "io.containerd.cri.v1.runtime", "containerd"),
}


@dataclass
class TomlResult:
    text: str
    changed: bool
    changes: list[str] = field(default_factory=list)


def _table(parent, key):
    import tomlkit

    if key not in parent:
        parent[key] = tomlkit.table()
    return parent[key]


def merge(text: str, *, runtime_name: str = "nvidia", runtime_path: str, default: bool = False,
          cdi: bool = False, new_version: int = 2, path: str = CONFIG) -> TomlResult:
    import tomlkit

    try:
        doc = tomlkit.parse(text) if text.strip() else tomlkit.document()
    except Exception as exc:  # tomlkit raises its own ParseError subclasses
        raise ConfigInvalid(f"{path} is not valid TOML ({exc}); fix it, then run again (the file was not changed)") from None
    if not text.strip():
        doc["version"] = new_version
    version = int(doc.get("version", 1))
    if version not in CRI_PATHS:
        raise ConfigInvalid(f"{path}: unsupported config version {version}; gpuprov knows 1, 2 and 3")
    node = doc
    for k in CRI_PATHS[version]:
        node = _table(node, k)
    cri_plugin = doc["plugins"][CRI_PATHS[version][1]]
    runtimes = _table(node, "runtimes")
    before = tomlkit.dumps(doc)
    rt = _table(runtimes, runtime_name)
    rt["runtime_type"] = "io.containerd.runc.v2"
    opts = _table(rt, "options")
    runc_opts = runtimes.get("runc", {}).get("options", {}) if "runc" in runtimes else {}
    for k, v in runc_opts.items():  # keep the runc entry's options (e.g. SystemdCgroup) for ours
        if k != "BinaryName" and k not in opts:
            opts[k] = v
    opts["BinaryName"] = runtime_path
    if default:
        node["default_runtime_name"] = runtime_name
    if cdi:
        cri_plugin["enable_cdi"] = True
        if "cdi_spec_dirs" not in cri_plugin:
            cri_plugin["cdi_spec_dirs"] = ["/etc/cdi", "/var/run/cdi"]
    after = tomlkit.dumps(doc)
    if after == before and text.strip():
        return TomlResult(text, False, [])
    changes = [f"{'.'.join(CRI_PATHS[version])}.runtimes.{runtime_name} -> {runtime_path}"]
    if default:
        changes.append(f"default_runtime_name -> {runtime_name}")
    if cdi:
        changes.append("enable_cdi -> true")
    return TomlResult(after, True, changes)


def runtime_in_dump(dump_text: str, runtime_name: str) -> bool:
    """Whether `containerd config dump` output lists our runtime (any config version)."""
    import tomlkit

    doc = tomlkit.parse(dump_text).unwrap()
    for path in CRI_PATHS.values():
        node = doc
        for k in path:
            node = node.get(k, {}) if isinstance(node, dict) else {}
        if runtime_name in (node.get("runtimes") or {}):
            return True
    return False


class ContainerdEngine(Engine):
    """containerd on the Engine interface (a straight port of the previous behaviour: the main config edited in
    place, checked with `containerd config dump`, restarted under systemd)."""

    name = "containerd"
    default_config = CONFIG
    daemon_names = ("containerd",)

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        old = read_config(path)
        m = merge(old or "", runtime_name=req.name, runtime_path=req.path, default=req.default, cdi=req.cdi,
                  path=str(path))
        # containerd re-reads its config only at start: every change needs a restart.
        changes = [Change(*c.split(" -> ", 1), reload=False) for c in m.changes]
        return EnginePlan([FileEdit(path, old, m.text)] if m.changed else [], changes)

    def daemon_config(self, argv: list[str]) -> str:
        return flag_value(argv, ("--config", "-c")) or CONFIG

    def check(self, path: Path, req: RuntimeRequest) -> bool | None:
        if not effects.which("containerd"):
            return None
        dump = effects.run(["containerd", "--config", str(path), "config", "dump"], check=False)
        return dump.returncode == 0 and runtime_in_dump(dump.output, req.name)

    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        if effects.has_systemd():
            effects.run(["systemctl", "restart", "containerd"], check=False)
            return "systemctl restart containerd"
        return f"restart containerd (pid {daemon.pid}) to apply the change (no systemd here)"

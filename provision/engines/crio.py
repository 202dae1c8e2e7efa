"""CRI-O: a drop-in under /etc/crio/crio.conf.d/, never an edit of crio.conf itself."""
from __future__ import annotations

from pathlib import Path

from provision import effects
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

DROPIN_DIR = "/etc/crio/crio.conf.d"


def dropin_path(runtime_name: str = "nvidia") -> str:
    return f"{DROPIN_DIR}/99-gpuprov-{runtime_name}.toml"


def render(*, runtime_name: str = "nvidia", runtime_path: str, default: bool = False) -> str:
    from provision import render as tpl

    return tpl.render("crio-runtime.toml.j2", runtime_name=runtime_name, runtime_path=runtime_path, default=default)


class CrioEngine(Engine):
    """CRI-O on the Engine interface (a port of the previous behaviour: the drop-in is rendered whole)."""

    name = "crio"
    default_config = DROPIN_DIR
    daemon_names = ("crio",)

    def config_path(self, config: str | None, req: RuntimeRequest) -> Path:
        return Path(config or dropin_path(req.name))

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        old = read_config(path)
        text = render(runtime_name=req.name, runtime_path=req.path, default=req.default)
        if text == old:
            return EnginePlan([], [])
        return EnginePlan([FileEdit(path, old, text)],
                          [Change(f"crio.runtime.runtimes.{req.name}", req.path, reload=False)])

    def daemon_config(self, argv: list[str]) -> str:
        return flag_value(argv, ("--config-dir",)) or DROPIN_DIR

    def live_daemon(self, path: Path) -> Daemon | None:
        # CRI-O reads every file of its drop-in directory: the daemon that reads PATH is the one whose directory
        # holds it.
        for d in self.running_daemons():
            if same_file(path.parent, Path(d.path_in_its_root(d.config))):
                return d
        return None

    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        if effects.has_systemd():
            effects.run(["systemctl", "restart", "crio"], check=False)
            return "systemctl restart crio"
        return f"restart crio (pid {daemon.pid}) to apply the change (no systemd here)"

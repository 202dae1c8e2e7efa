"""`gpuprov engine configure`: merge the runtime into an engine's config, back up, write atomically, restart only
when something changed, and check the engine lists the runtime."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from provision import effects
from provision.engines import containerd, crio, docker
from provision.errors import ConfigInvalid, StepFailed
from provision.fsutil import atomic_write_text

MERGERS = {"docker": (docker.DAEMON_JSON, docker.merge), "containerd": (containerd.CONFIG, containerd.merge)}
# daemon.json keys dockerd reloads on SIGHUP without touching running containers.
RELOADABLE = ("runtimes", "default-runtime")


@dataclass
class ConfigureResult:
    engine: str
    path: str
    changed: bool
    changes: list[str] = field(default_factory=list)
    diff: str = ""
    backup: str | None = None
    restart: str | None = None
    verified: bool | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise ConfigInvalid(f"cannot read {path}: {exc.strerror}") from None


def configure(engine: str, *, config: str | None = None, runtime_name: str = "nvidia", runtime_path: str,
              default: bool = False, cdi: bool = False, dry_run: bool = False, restart: bool = True,
              unit_root: Path = Path("/")) -> ConfigureResult:
    if engine in MERGERS:  # structural merges of the engine's own file
        default_path, merge = MERGERS[engine]
        path = Path(config or default_path)
        old = _read(path)
        m = merge(old, runtime_name=runtime_name, runtime_path=runtime_path, default=default, cdi=cdi, path=str(path))
        res = ConfigureResult(engine, str(path), m.changed, m.changes)
    if engine == "docker":
        if m.changed:
            new_doc = docker.parse(m.text, str(path))
            clashes = docker.conflicts(new_doc, docker.unit_flags(unit_root))
            ours = [c for c in clashes if c.split("'")[1] in ("runtimes", "default-runtime", "features")]
            if ours:
                raise ConfigInvalid("; ".join(ours) + ": dockerd would refuse to start. Remove the flag from the "
                                    "unit (systemctl edit docker) or leave this key out; daemon.json was not changed")
            res.warnings += clashes
    elif engine == "crio":
        path = Path(config or crio.dropin_path(runtime_name))
        old = _read(path)
        text = crio.render(runtime_name=runtime_name, runtime_path=runtime_path, default=default)
        m = docker.MergeResult(text, text != old, [f"crio.runtime.runtimes.{runtime_name} -> {runtime_path}"]
                               if text != old else [])
        res = ConfigureResult("crio", str(path), m.changed, m.changes)
    elif engine not in MERGERS:
        raise ConfigInvalid(f"unknown engine {engine!r}: use docker, containerd or crio", exit_code=2)
    res.diff = effects.unified_diff(old, m.text, str(path)) if m.changed else ""
    hook_pending = engine == "docker" and effects.gpus_hook_pending()
    if hook_pending:
        res.changes.append("restart dockerd so that it finds the --gpus hook")
    if dry_run or (not m.changed and not (hook_pending and restart)):
        if not dry_run and engine == "docker" and restart:
            rts = effects.docker_runtimes()
            res.verified = None if rts is None else runtime_name in rts
        res.changed = m.changed or hook_pending
        return res
    if not m.changed:
        res.changed = True
        res.restart = effects.restart_dockerd()
        res.verified = runtime_name in (effects.docker_runtimes() or [])
        return res
    bak = atomic_write_text(path, m.text, mode=0o644, backup=bool(old))
    res.backup = str(bak) if bak else None
    if restart:
        _apply_engine(res, engine, runtime_name, str(path))
    return res


def _apply_engine(res: ConfigureResult, engine: str, runtime_name: str, path: str) -> None:
    if engine == "docker":
        if effects.docker_runtimes() is None and effects.dockerd_pid() is None:
            res.restart = "dockerd not running: the change applies when it starts"
            return
        reloadable = all(c.split(" ")[0].split(".")[0] in RELOADABLE for c in res.changes)
        res.restart = effects.reload_or_restart_docker(reloadable)
        res.verified = effects.wait_for(lambda: runtime_name in (effects.docker_runtimes() or []), 30)
        if not res.verified:
            raise StepFailed(f"dockerd does not list runtime {runtime_name!r} after `{res.restart}`; "
                             f"check {path} and `docker info`")
    elif engine == "containerd" and effects.which("containerd"):
        dump = effects.run(["containerd", "--config", path, "config", "dump"], check=False)
        res.verified = dump.returncode == 0 and containerd.runtime_in_dump(dump.output, runtime_name)
        if not res.verified:
            raise StepFailed(f"`containerd config dump` does not show runtime {runtime_name!r}: {dump.output[-300:]}")
        if effects.has_systemd():
            effects.run(["systemctl", "restart", "containerd"], check=False)
            res.restart = "systemctl restart containerd"
    elif engine == "crio" and effects.has_systemd():
        effects.run(["systemctl", "restart", "crio"], check=False)
        res.restart = "systemctl restart crio"

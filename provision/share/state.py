"""The MPS share state (`gpuprov share enable` writes it, the runtime reads it on every GPU container start) and a
container's sharing request, as typed records. One JSON form each: `MpsState.to_json`/`from_json` are the only
code that knows the state file's keys (the file's format is unchanged since sharing landed; `max_memory` came
later and is optional). Import-light: the runtime's editor loads this module."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace


class ShareStateInvalid(ValueError):
    """The state file is not what `gpuprov share enable` writes (garbled, a field missing or of the wrong type)."""


def _int(doc: dict, key: str, *, optional: bool = False) -> int | None:
    v = doc.get(key)
    if v is None:
        if optional:
            return None
        raise ShareStateInvalid(f"'{key}' is missing")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ShareStateInvalid(f"'{key}' must be an integer (got {v!r})")
    return v


def _str(doc: dict, key: str) -> str:
    v = doc.get(key)
    if v is None:
        raise ShareStateInvalid(f"'{key}' is missing")
    if not isinstance(v, str):
        raise ShareStateInvalid(f"'{key}' must be a string (got {v!r})")
    return v


def _pid(doc: dict) -> int:
    pid = _int(doc, "daemon_pid")
    if pid <= 0:  # kill(0 or -N, 0) would "find" a whole process group
        raise ShareStateInvalid(f"'daemon_pid' must be a process id (got {pid})")
    return pid


@dataclass(frozen=True, slots=True)
class MpsState:
    """What runs: the control binary, its pipe/log directories, the daemon and how it is supervised, and the
    defaults containers get (bytes / percent; None = not set)."""
    control: str  # nvidia-cuda-mps-control's path
    pipe_dir: str
    log_dir: str
    gpus: tuple[int, ...] = ()  # () = every GPU
    max_clients: int | None = None
    default_memory: int | None = None  # bytes, for containers that ask for none
    default_compute: int | None = None  # percent
    max_memory: int | None = None  # bytes: the daemon's ceiling no client can lift
    uid: int = 0  # the daemon's uid: clients must run as it
    supervisor: str = ""  # "systemd (gpuprov-mps.service)" | "background process"
    daemon_pid: int = 0  # 0 while it is being started

    @property
    def systemd(self) -> bool:
        return self.supervisor.startswith("systemd")

    def to_json(self) -> str:
        doc = {"control": self.control, "pipe_dir": self.pipe_dir, "log_dir": self.log_dir, "gpus": list(self.gpus),
               "max_clients": self.max_clients, "default_memory": self.default_memory,
               "default_compute": self.default_compute, "max_memory": self.max_memory, "uid": self.uid,
               "supervisor": self.supervisor, "daemon_pid": self.daemon_pid}
        return json.dumps(doc, indent=2) + "\n"

    def to_dict(self) -> dict:
        """The `share enable --json` document (the state file's keys)."""
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> MpsState:
        """Raises ShareStateInvalid (a ValueError) naming what is wrong."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ShareStateInvalid(f"not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ShareStateInvalid("not a JSON object")
        gpus = doc.get("gpus") or []
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
            raise ShareStateInvalid(f"'gpus' must be a list of GPU indices (got {gpus!r})")
        return cls(control=_str(doc, "control"), pipe_dir=_str(doc, "pipe_dir"), log_dir=_str(doc, "log_dir"),
                   gpus=tuple(gpus), max_clients=_int(doc, "max_clients", optional=True),
                   default_memory=_int(doc, "default_memory", optional=True),
                   default_compute=_int(doc, "default_compute", optional=True),
                   max_memory=_int(doc, "max_memory", optional=True),  # absent in files from before --max-memory
                   uid=_int(doc, "uid", optional=True) or 0, supervisor=_str(doc, "supervisor"),
                   daemon_pid=_pid(doc))

    def started(self, supervisor: str, daemon_pid: int) -> MpsState:
        return replace(self, supervisor=supervisor, daemon_pid=daemon_pid)


@dataclass(frozen=True, slots=True)
class ShareRequest:
    """One container's MPS client settings: memory per visible GPU index (bytes) and a compute percentage."""
    memory: dict[int, int] | None = None
    compute: int | None = None

"""The MPS share state (`gpuprov share enable` writes it, the runtime reads it on every GPU container start) and a
container's sharing request, as typed records. One JSON form each: `MpsState.to_json`/`from_json` are the only
code that knows the state file's keys (the file's format is unchanged since sharing landed; `max_memory`,
`daemon_start` and `previous_compute_modes` came later and are optional). Import-light: the runtime's editor loads
this module."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

DAEMON_COMM = "nvidia-cuda-mps"  # nvidia-cuda-mps-control's name as the kernel keeps it (15 characters)


def proc_identity(pid: int) -> tuple[str, int] | None:
    """(comm, start time in clock ticks after boot) of a live process, from /proc/PID/stat; None for no process or a
    zombie. One read: the runtime asks it on every GPU start on a sharing host."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    end = text.rfind(")")  # comm may hold spaces and parentheses: it ends at the last ')'
    fields = text[end + 2:].split()
    if end < 0 or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return text[text.find("(") + 1:end], int(fields[19])  # fields[0] is field 3 (state); starttime is field 22


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


def _modes(doc: dict) -> tuple[tuple[str, str], ...]:
    v = doc.get("previous_compute_modes") or {}  # absent in files from before compute modes were set
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(m, str) for k, m in v.items()):
        raise ShareStateInvalid(f"'previous_compute_modes' must map GPU UUIDs to compute modes (got {v!r})")
    return tuple(v.items())


def _policy(doc: dict) -> str:
    from provision.share.policy import BY_NAME  # lazy: 1 ms (-X importtime), only a sharing host reads a state

    v = doc.get("policy") or ""  # absent in files from before policies
    if not isinstance(v, str) or (v and (v not in BY_NAME or not BY_NAME[v].supported)):
        raise ShareStateInvalid(f"'policy' must name a policy gpuprov can honour (got {v!r})")
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
    # The daemon's start time (clock ticks after boot, /proc/PID/stat field 22): with the pid it names one process,
    # so a pid reused after the daemon died is never taken for it. 0 = not recorded (files from before).
    daemon_start: int = 0
    # GPU UUID -> its compute mode before `share enable` set EXCLUSIVE_PROCESS (`share disable` restores it);
    # empty when the modes were left as they were (--keep-compute-mode).
    previous_compute_modes: tuple[tuple[str, str], ...] = ()
    # The cGPU policy's name (share/policy.py); "" in files from before policies (then policy.DEFAULT applies).
    policy: str = ""
    # cGPU's prio_ratio: the SM percentage a high-priority container may take (None: no ceiling for it).
    prio_ratio: int | None = None

    @property
    def systemd(self) -> bool:
        return self.supervisor.startswith("systemd")

    def to_json(self) -> str:
        doc = {"control": self.control, "pipe_dir": self.pipe_dir, "log_dir": self.log_dir, "gpus": list(self.gpus),
               "max_clients": self.max_clients, "default_memory": self.default_memory,
               "default_compute": self.default_compute, "max_memory": self.max_memory, "uid": self.uid,
               "supervisor": self.supervisor, "daemon_pid": self.daemon_pid, "daemon_start": self.daemon_start,
               "previous_compute_modes": dict(self.previous_compute_modes), "policy": self.policy,
               "prio_ratio": self.prio_ratio}
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
                   daemon_pid=_pid(doc), daemon_start=_int(doc, "daemon_start", optional=True) or 0,
                   previous_compute_modes=_modes(doc), policy=_policy(doc),
                   prio_ratio=_int(doc, "prio_ratio", optional=True))

    def started(self, supervisor: str, daemon_pid: int, daemon_start: int = 0) -> MpsState:
        return replace(self, supervisor=supervisor, daemon_pid=daemon_pid, daemon_start=daemon_start)

    def daemon_running(self) -> bool:
        """The daemon this state names still runs: its pid is an MPS control daemon started when the state says
        (a pid the kernel gave to another process after the daemon died does not count)."""
        ident = proc_identity(self.daemon_pid)
        return ident is not None and ident[0] == DAEMON_COMM and (not self.daemon_start or ident[1] == self.daemon_start)

    def gone(self, path: str) -> str:
        """The one line for this state (at `path`) when its daemon is gone: crashed, killed, or its pid reused."""
        return (f"GPU sharing is on ({path}) but its MPS control daemon (pid {self.daemon_pid}) is no longer running: "
                "run `gpuprov share disable` then `gpuprov share enable`")

    def shares(self, index: int) -> bool:
        """Whether `share enable` shared this GPU (nvidia-smi's index); no --gpus shared every GPU."""
        return not self.gpus or index in self.gpus


@dataclass(frozen=True, slots=True)
class ShareRequest:
    """One container's MPS client settings: memory per visible GPU index (bytes), a compute percentage, its MPS
    client priority (0 normal, 1 below normal; None: not set) and one-line notes for the runtime's log."""
    memory: dict[int, int] | None = None
    compute: int | None = None
    priority: int | None = None
    notes: tuple[str, ...] = ()

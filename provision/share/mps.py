"""The MPS control daemon: start it for chosen GPUs (systemd unit where systemd runs, a background process
otherwise), set its defaults, report clients per container, stop it cleanly. Never changes GPU settings."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from provision import effects, paths
from provision.errors import CONFIG_INVALID, GpuprovError, StepFailed, UntrustedPath
from provision.fsutil import make_dirs, read_trusted, write_file
from provision.metrics import nvml, usage
from provision.render import render
from provision.share.state import MpsState, ShareStateInvalid

PIPE_DIR = paths.MPS_PIPE_DIR
LOG_DIR = "/var/log/gpuprov/mps"
UNIT = "/etc/systemd/system/gpuprov-mps.service"


def find_control() -> str:
    for cand in (shutil.which("nvidia-cuda-mps-control"), "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
                 "/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control"):
        if cand and os.path.exists(cand):
            return cand
    raise GpuprovError("nvidia-cuda-mps-control not found: install the NVIDIA driver (gpuprov bootstrap)", exit_code=4)


def _env(state: MpsState) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_MPS_PIPE_DIRECTORY": state.pipe_dir,
           "CUDA_MPS_LOG_DIRECTORY": state.log_dir}
    if state.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in state.gpus)
    return env


def control(state: MpsState, command: str, timeout: float = 10) -> str:
    p = effects.run([state.control], check=False, input_text=command + "\n", env=_env(state), timeout=timeout)
    return (p.stdout or "").strip()


def daemon_pid(state: MpsState) -> int | None:
    """The control daemon's PID from its pid file in the pipe directory."""
    try:
        pid = int(Path(state.pipe_dir, "nvidia-cuda-mps-control.pid").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def invalid_state(path: str, exc: ShareStateInvalid) -> str:
    """The one line for a state file that is not `share enable`'s, with the way out."""
    return (f"{path} is not a gpuprov share state ({exc}): run `gpuprov share disable` to clear it, then "
            "`gpuprov share enable`")


def read_state(path: str) -> MpsState | None:
    """None when sharing was never enabled (no file); raises ShareStateInvalid for a file that is not `enable`'s."""
    try:  # only a state nobody but root could have written (fsutil.open_trusted): the runtime acts on it
        data = read_trusted(path)
    except UntrustedPath as exc:
        raise ShareStateInvalid(str(exc)) from None
    except OSError as exc:
        raise ShareStateInvalid(f"unreadable: {exc.strerror}") from None
    if data is None:
        return None
    try:
        return MpsState.from_json(data.decode())
    except UnicodeDecodeError:
        raise ShareStateInvalid("not UTF-8 text") from None


def load_state(path: str) -> MpsState | None:
    """The state for the CLI: None when sharing is off; an invalid file is exit 6 with the way out."""
    try:
        return read_state(path)
    except ShareStateInvalid as exc:
        raise GpuprovError(invalid_state(path, exc), exit_code=CONFIG_INVALID) from None


def enable(state_path: str, *, gpus: list[int] | None, max_clients: int | None, default_memory: int | None,
           default_compute: int | None, max_memory: int | None = None) -> MpsState:
    try:
        old = read_state(state_path)
    except ShareStateInvalid:  # a broken file names no daemon: it is replaced below
        old = None
    if old and daemon_pid(old):
        raise GpuprovError(f"GPU sharing is already on (MPS daemon pid {daemon_pid(old)}); "
                           "`gpuprov share disable` first to change its settings", exit_code=2)
    state = MpsState(control=find_control(), pipe_dir=PIPE_DIR, log_dir=LOG_DIR, gpus=tuple(gpus or ()),
                     max_clients=max_clients, default_memory=default_memory, default_compute=default_compute,
                     max_memory=max_memory, uid=os.getuid())
    for d in (state.pipe_dir, state.log_dir):
        make_dirs(d, 0o755)
    if Path("/run/systemd/system").is_dir():
        unit = render("gpuprov-mps.service.j2", control=state.control,
                      environment={k: v for k, v in _env(state).items() if k != "PATH"})
        write_file(UNIT, unit, mode=0o644, backup=False)
        effects.run(["systemctl", "daemon-reload"], check=False)
        effects.run(["systemctl", "start", "gpuprov-mps"])
        supervisor = "systemd (gpuprov-mps.service)"
    else:
        effects.run([state.control, "-d"], env=_env(state))
        supervisor = "background process"
    for _ in range(50):
        if daemon_pid(state):
            break
        time.sleep(0.1)
    pid = daemon_pid(state)
    if not pid:
        raise StepFailed(f"the MPS control daemon did not start; see {state.log_dir}/control.log")
    state = state.started(supervisor, pid)
    # The daemon's default pinned-memory limit is a ceiling no client can lift, even one that sets its own
    # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (measured on an H200: a client asking 8G under a 2G default got 2G).
    # Per-container limits below it come from the runtime; --default-memory is what containers asking nothing get.
    if max_memory:
        for i in range(len(gpus) if gpus else 1):
            control(state, f"set_default_device_pinned_mem_limit {i} {max_memory // (1 << 20)}M")
    if default_compute:
        control(state, f"set_default_active_thread_percentage {default_compute}")
    write_file(state_path, state.to_json(), mode=0o644, keep_mode=False, backup=False)  # its directories: 0755
    return state


def disable(state_path: str) -> dict:
    try:
        state = read_state(state_path)
    except ShareStateInvalid as exc:  # the way out that invalid_state() names: the file goes, MPS left is listed
        Path(state_path).unlink(missing_ok=True)
        return {"stopped": False, "note": f"removed {state_path}, which was not a gpuprov share state ({exc})",
                "left_running": _mps_processes()}
    if not state:
        return {"stopped": False, "note": "GPU sharing was not on"}
    pid = daemon_pid(state)
    if pid:
        if state.systemd:
            effects.run(["systemctl", "stop", "gpuprov-mps"], check=False)
        else:
            control(state, "quit")
        for _ in range(100):
            if not daemon_pid(state) and not _mps_processes():
                break
            time.sleep(0.1)
    left = _mps_processes()
    Path(state_path).unlink(missing_ok=True)
    return {"stopped": True, "daemon_pid": pid, "left_running": left}


def _mps_processes() -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                comm = Path(f"/proc/{d}/comm").read_text().strip()
            except OSError:
                continue
            if comm in ("nvidia-cuda-mps", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
                out.append(int(d))
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def status(state_path: str) -> dict:
    state = load_state(state_path)
    if not state or not daemon_pid(state):
        return {"enabled": False, "daemon": None, "clients": []}
    servers = [s for s in control(state, "get_server_list").split() if s.isdigit()]
    clients = []
    # One code path with `gpuprov metrics`: NVML's process lists (MPS clients included) mapped to containers by cgroup.

    procs = usage.by_pid(nvml.snapshot())
    for srv in servers:
        for c in control(state, f"get_client_list {srv}").split():
            if not c.isdigit():
                continue
            pid = int(c)
            env = _env_of(pid)
            _, ref, mem = procs.get(pid, (None, None, None))
            clients.append({"pid": pid, "server": int(srv), "container": ref.id if ref else None,
                            "container_name": ref.container if ref else None, "pod": ref.pod if ref else None,
                            "namespace": ref.namespace if ref else None,
                            "memory_used_mib": mem >> 20 if mem is not None else None,
                            "memory_limit": env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
                            "compute_percent": env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")})
    return {"enabled": True, "daemon": {"pid": state.daemon_pid, "supervisor": state.supervisor,
                                        "gpus": list(state.gpus) or "all", "pipe_dir": state.pipe_dir,
                                        "default_memory": state.default_memory,
                                        "default_compute": state.default_compute},
            "servers": [int(s) for s in servers], "clients": clients}

"""The MPS control daemon: start it for chosen GPUs (systemd unit where systemd runs, a background process
otherwise), set its defaults, report clients per container, stop it cleanly. The one GPU setting it changes is the
shared GPUs' compute mode (EXCLUSIVE_PROCESS, as NVIDIA's MPS guide says; see compute_mode.py), put back by
`disable`; --keep-compute-mode leaves it alone."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from provision import effects, paths
from provision.errors import CONFIG_INVALID, UNSUPPORTED, USAGE, GpuprovError, StepFailed, UntrustedPath
from provision.fsutil import make_dirs, read_trusted, write_file
from provision.metrics import nvml, usage
from provision.render import render
from provision.share import compute_mode, policy
from provision.share.limits import BELOW_NORMAL, NORMAL
from provision.share.state import MpsState, ShareStateInvalid, proc_identity

PIPE_DIR = paths.MPS_PIPE_DIR
LOG_DIR = paths.MPS_LOG_DIR
UNIT = "/etc/systemd/system/gpuprov-mps.service"


def find_control() -> str:
    for cand in (shutil.which("nvidia-cuda-mps-control"), "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
                 "/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control"):
        if cand and os.path.exists(cand):
            return cand
    raise GpuprovError("nvidia-cuda-mps-control not found: install the NVIDIA driver (gpuprov bootstrap)", exit_code=UNSUPPORTED)


def _env(state: MpsState) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_MPS_PIPE_DIRECTORY": state.pipe_dir,
           "CUDA_MPS_LOG_DIRECTORY": state.log_dir}
    if state.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in state.gpus)
    return env


def control(state: MpsState, command: str, timeout: float = 10, check: bool = False) -> str:
    """One command to the daemon. check=True: a command the daemon refused (non-zero exit, as NVIDIA's device plugin
    reads it) is StepFailed (exit 5) naming the command and what the daemon said."""
    p = effects.run([state.control], check=False, input_text=command + "\n", env=_env(state), timeout=timeout)
    if check and p.returncode != 0:
        raise effects.failed(f"echo {command} | {state.control}", p.returncode, p.output)
    return (p.stdout or "").strip()


def _pid_file(state: MpsState) -> str:
    return os.path.join(state.pipe_dir, "nvidia-cuda-mps-control.pid")  # the daemon writes it (NVIDIA's MPS guide)


def daemon_pid(state: MpsState) -> int | None:
    """The control daemon's PID from its pid file in the pipe directory, while that process runs (a zombie that no
    init reaped does not)."""
    try:
        pid = int(Path(_pid_file(state)).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and proc_identity(pid) else None


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
           default_compute: int | None, max_memory: int | None = None, keep_compute_mode: bool = False,
           policy: str = "", prio_ratio: int | None = None) -> MpsState:
    """Start MPS on the chosen GPUs with their limits, or leave nothing: a step that fails (a compute mode, the
    daemon, any control command) stops the daemon started here, puts the compute modes back and writes no state."""
    try:
        old = read_state(state_path)
    except ShareStateInvalid:  # a broken file names no daemon: it is replaced below
        old = None
    if old and daemon_pid(old):
        raise GpuprovError(f"GPU sharing is already on (MPS daemon pid {daemon_pid(old)}); "
                           "`gpuprov share disable` first to change its settings", exit_code=USAGE)
    ctl = find_control()
    smi = compute_mode.find_smi(ctl)
    shared = compute_mode.chosen(compute_mode.query(smi), gpus)
    # A state whose daemon is gone claims limits nobody enforces: it goes now, so a failure below leaves none. The
    # compute modes it recorded are still the operator's originals (this run finds its own EXCLUSIVE_PROCESS).
    inherited = dict(old.previous_compute_modes) if old else {}
    Path(state_path).unlink(missing_ok=True)
    state = MpsState(control=ctl, pipe_dir=PIPE_DIR, log_dir=LOG_DIR, gpus=tuple(g.index for g in shared) if gpus else (),
                     max_clients=max_clients, default_memory=default_memory, default_compute=default_compute,
                     max_memory=max_memory, uid=os.getuid(), policy=policy, prio_ratio=prio_ratio)
    for d in (state.pipe_dir, state.log_dir):
        make_dirs(d, 0o755)
    undo: list = []  # what to take back, newest last
    try:
        if not keep_compute_mode:
            state = replace(state, previous_compute_modes=_exclusive(smi, shared, inherited, undo))
        state = _start_daemon(state, state_path, undo)
        _configure(state, len(shared))
        write_file(state_path, state.to_json(), mode=0o644, keep_mode=False, backup=False)  # its directories: 0755
    except BaseException:
        for step in reversed(undo):
            try:
                step()
            except Exception:  # noqa: BLE001 - the first failure is the one to report; undo the rest regardless
                pass
        raise
    return state


def _exclusive(smi: str, shared: list, inherited: dict[str, str], undo: list) -> tuple[tuple[str, str], ...]:
    """EXCLUSIVE_PROCESS on every shared GPU; returns each GPU's mode before (UUID -> mode) for `disable`."""
    before = []
    for g in shared:
        before.append((g.uuid, inherited.get(g.uuid, g.mode)))
        if g.mode != compute_mode.EXCLUSIVE:
            compute_mode.set_mode(smi, g.uuid, compute_mode.EXCLUSIVE)
            undo.append(lambda g=g: compute_mode.set_mode(smi, g.uuid, g.mode))
    return tuple(before)


def unit_text(state: MpsState, state_path: str) -> str:
    """gpuprov-mps.service: systemd restarts a daemon that died or quit (Restart=always; `systemctl stop` is no
    failure), and each start runs `share follow`, which gives the new daemon the state's limits and server and
    points the state at it; a follow that fails fails the start, so systemd stops that daemon (fail closed)."""
    follow = shlex.join([sys.executable, "-m", "provision", "share", "follow", "--state", state_path])
    return render("gpuprov-mps.service.j2", control=state.control, follow=follow, pid_file=_pid_file(state),
                  environment={k: v for k, v in _env(state).items() if k != "PATH"})


def _start_daemon(state: MpsState, state_path: str, undo: list) -> MpsState:
    if Path("/run/systemd/system").is_dir():
        unit = unit_text(state, state_path)
        write_file(UNIT, unit, mode=0o644, backup=False)
        effects.run(["systemctl", "daemon-reload"], check=False)
        undo.append(lambda: effects.run(["systemctl", "stop", "gpuprov-mps"], check=False, timeout=60))
        effects.run(["systemctl", "start", "gpuprov-mps"])
        supervisor = "systemd (gpuprov-mps.service)"
    else:
        undo.append(lambda: _stop(state))
        effects.run([state.control, "-d"], env=_env(state))
        supervisor = "background process"
    return _started(state, supervisor)


def _started(state: MpsState, supervisor: str) -> MpsState:
    """The state naming the daemon that just started (its pid file, bounded wait), with its start time."""
    for _ in range(50):
        if daemon_pid(state):
            break
        time.sleep(0.1)
    pid = daemon_pid(state)
    ident = proc_identity(pid) if pid else None
    if not pid or not ident:
        raise StepFailed(f"the MPS control daemon did not start; see {state.log_dir}/control.log")
    return state.started(supervisor, pid, ident[1])


def _configure(state: MpsState, n_gpus: int) -> None:
    """The daemon's defaults, then its server: the server holds the GPUs' one context from now on (under
    EXCLUSIVE_PROCESS nothing else can take it first), and a server reads the defaults when it starts."""
    _set_defaults(state, n_gpus)
    control(state, f"start_server -uid {state.uid}", check=True)


def follow(state_path: str) -> dict:
    """Run by gpuprov-mps.service after each start of the daemon: a daemon systemd restarted (it died, or was told to
    quit) gets the state's limits and its server, and the state then names it, so the runtime serves containers
    again. Takes no host lock: `share enable` holds it while systemd starts the unit, and there the state does not
    exist yet (enable configures its daemon itself). Fails (exit 5) when the daemon does not take the limits: the
    state keeps naming the old daemon, and the runtime keeps refusing."""
    state = load_state(state_path)
    if state is None:
        return {"followed": False, "note": f"no {state_path}: `share enable` configures the daemon it starts"}
    if state.daemon_running():
        return {"followed": False, "daemon_pid": state.daemon_pid, "note": "the state's daemon runs"}
    new = _started(state, state.supervisor)
    n = len(state.gpus) or len(compute_mode.query(compute_mode.find_smi(state.control)))
    _configure(new, n)
    write_file(state_path, new.to_json(), mode=0o644, backup=False)
    return {"followed": True, "daemon_pid": new.daemon_pid, "was": state.daemon_pid}


def _set_defaults(state: MpsState, n_gpus: int) -> None:
    """The daemon's defaults, each checked: a limit the daemon did not take fails `enable` (exit 5).
    The default pinned-memory limit is a ceiling no client can lift, even one that sets its own
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (measured on an H200: a client asking 8G under a 2G default got 2G). It is set on
    every shared GPU: the daemon numbers the GPUs it serves 0..n-1 (CUDA_VISIBLE_DEVICES remaps them).
    Per-container limits below it come from the runtime; --default-memory is what containers asking nothing get."""
    if state.max_memory:
        for i in range(n_gpus):
            control(state, f"set_default_device_pinned_mem_limit {i} {state.max_memory // (1 << 20)}M", check=True)
    if state.default_compute:
        control(state, f"set_default_active_thread_percentage {state.default_compute}", check=True)


def _stop(state: MpsState) -> None:
    """Quit the daemon (its servers finish their clients first) and wait for it, bounded."""
    if state.systemd:
        effects.run(["systemctl", "stop", "gpuprov-mps"], check=False, timeout=60)
    else:
        control(state, "quit")
    for _ in range(100):
        if not daemon_pid(state) and not _mps_processes():
            break
        time.sleep(0.1)


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
        _stop(state)
    left = _mps_processes()
    restored, failed = _restore_modes(state)
    Path(state_path).unlink(missing_ok=True)
    if failed:
        raise StepFailed(f"GPU sharing is off, but the compute mode of {'; '.join(failed)}")
    return {"stopped": True, "daemon_pid": pid, "left_running": left, "compute_modes_restored": restored}


def _restore_modes(state: MpsState) -> tuple[dict[str, str], list[str]]:
    """Each shared GPU back to the compute mode it had before `enable` (by UUID). Returns what was restored and,
    for each GPU that could not be, the command to run by hand."""
    restored, failed = {}, []
    todo = [(u, m) for u, m in state.previous_compute_modes if m != compute_mode.EXCLUSIVE]
    if not todo:
        return restored, failed
    try:
        smi = compute_mode.find_smi(state.control)
    except GpuprovError:
        return restored, [f"{u} could not be restored (no nvidia-smi): run `nvidia-smi -i {u} -c {m.upper()}`"
                          for u, m in todo]
    for uuid, mode in todo:
        try:
            compute_mode.set_mode(smi, uuid, mode)
            restored[uuid] = mode
        except StepFailed:
            failed.append(f"{uuid} could not be restored: run `nvidia-smi -i {uuid} -c {mode.upper()}`")
    return restored, failed


def _mps_processes() -> list[int]:
    """Live MPS processes (control daemon and servers; the kernel keeps 15 characters of their names)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            ident = proc_identity(int(d))
            if ident and ident[0] in ("nvidia-cuda-mps", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
                out.append(int(d))
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def status(state_path: str) -> dict:
    """cgpu-smi's view: the daemon and its policy; per container and GPU, memory used against the cap, the compute
    share, the priority and the processes; and each MPS client (`clients`, one per process)."""
    state = load_state(state_path)
    if not state:
        return {"enabled": False, "daemon": None, "clients": [], "containers": []}
    if not state.daemon_running():  # the runtime refuses GPU containers on the shared GPUs meanwhile
        return {"enabled": False, "daemon": None, "clients": [], "containers": [],
                "note": state.gone(state_path)}
    pol = policy.of(state.policy)
    servers = [s for s in control(state, "get_server_list").split() if s.isdigit()]
    pids = [(int(srv), int(c)) for srv in servers for c in control(state, f"get_client_list {srv}").split()
            if c.isdigit()]
    clients = []
    # One code path with `gpuprov metrics`: NVML's process lists (MPS clients included) mapped to containers by cgroup.
    procs = usage.by_pid(nvml.snapshot()) if pids else {}
    for srv, pid in pids:
        env = _env_of(pid)
        gpu, ref, mem = procs.get(pid, (None, None, None))
        clients.append({"pid": pid, "server": srv, "gpu": gpu, "container": ref.id if ref else None,
                        "container_name": ref.container if ref else None, "pod": ref.pod if ref else None,
                        "namespace": ref.namespace if ref else None,
                        "memory_used_mib": mem >> 20 if mem is not None else None,
                        "memory_limit": env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
                        "compute_percent": env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                        "priority": _priority(env.get("CUDA_MPS_CLIENT_PRIORITY"), pol)})
    return {"enabled": True, "daemon": {"pid": state.daemon_pid, "supervisor": state.supervisor,
                                        "gpus": list(state.gpus) or "all", "pipe_dir": state.pipe_dir,
                                        "policy": pol.name, "policy_number": pol.number,
                                        "max_clients": state.max_clients, "prio_ratio": state.prio_ratio,
                                        "default_memory": state.default_memory,
                                        "default_compute": state.default_compute},
            "compute_modes_before": dict(state.previous_compute_modes),
            "servers": [int(s) for s in servers], "clients": clients, "containers": by_container(clients)}


def _priority(value: str | None, pol: policy.Policy) -> str:
    """A client's priority in the seed's terms: under a policy with priorities every container runs below normal
    except the high-priority ones, so MPS's "normal" (0) is cGPU's high there."""
    if value == str(NORMAL):
        return "high" if pol.priorities else "normal"
    if value == str(BELOW_NORMAL):
        return "normal"
    return "normal (not set)"


def by_container(clients: list[dict]) -> list[dict]:
    """The clients grouped per container and GPU (a host process is its own group), as cgpu-smi lists them."""
    out: dict[tuple, dict] = {}
    for c in clients:
        key = (c["gpu"] if c["gpu"] is not None else -1, c["container"] or f"pid {c['pid']}")
        row = out.setdefault(key, {"gpu": c["gpu"], "container": c["container"], "container_name": c["container_name"],
                                   "pod": c["pod"], "namespace": c["namespace"], "memory_used_mib": None,
                                   "memory_limit": c["memory_limit"], "compute_percent": c["compute_percent"],
                                   "priority": c["priority"], "pids": []})
        if c["memory_used_mib"] is not None:
            row["memory_used_mib"] = (row["memory_used_mib"] or 0) + c["memory_used_mib"]
        row["pids"].append(c["pid"])
    return [out[k] for k in sorted(out, key=lambda k: (k[0], k[1]))]

"""MPS sharing, round two (issue 19, items 5-8): the limits are the operator's, not the container's.

`gpuprov share enable|disable` run as an operator runs them (the real CLI, host lock, state file), against stand-ins
for the two driver tools that need a GPU (tests/fake_mps.py: nvidia-smi's compute mode, nvidia-cuda-mps-control's
daemon and command pipe, built from real hosts' GPU lists). The runtime cases run the real editor on the fake driver
root built from the H200 capture, with real device nodes and a real live process under the MPS daemon's name.

What the fakes cannot show is what the GPU does in EXCLUSIVE_PROCESS mode (a second context refused): that is
NVIDIA's documented behaviour, and a lent GPU's mode may not be changed to prove it. These tests prove gpuprov's side:
the mode is set on exactly the shared GPUs before the daemon starts, recorded and put back, and every failure
leaves the host as it was.

Each case failed on the main before this change (6bd0942): enable never touched the compute mode, set the ceiling on
device 0 only, ignored a refused control command (exit 0, a state claiming the ceiling), and the runtime ran
containers uncapped when the state's daemon was gone and gave containers on unshared GPUs GPU 0's daemon."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import discover, modify
from provision.inject.discover import Node
from tests import fake_mps
from tests.conftest import run_cli
from tests.inject_helpers import fake_dev, gpu_bundle, python_front_end, settings, write_settings

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, the runtime's checks)")
STEP_FAILED, USAGE, REFUSED = 5, 2, 10  # README's exit codes; REFUSED is the runtime's refusal
GPU0, GPU1 = "GPU-08aa1c37-e432-8e19-72ec-9ba5febdb6c8", "GPU-594f31b4-5d45-2035-8447-19dfbe6dd533"  # h200x2


class Host:
    """A host with two (fake) H200s and gpuprov's state under tmp paths."""

    def __init__(self, base: Path, n_gpus: int = 2):
        self.base = base
        self.bin = fake_mps.install(base / "bin", n_gpus)
        self.state = base / "run/share.json"
        self.pipe = base / "run/mps"
        self.runtime_json = base / "runtime.json"
        self.runtime_json.write_text(json.dumps({"share_state": str(self.state)}))
        self.env = {"PATH": f"{self.bin}:{os.environ['PATH']}", "GPUPROV_RUN_DIR": str(base / "run"),
                    "GPUPROV_LOG_DIR": str(base / "log"), "GPUPROV_STATE_DIR": str(base / "state"),
                    "GPUPROV_RUNTIME_CONFIG": str(self.runtime_json), "GPUPROV_LOCK_DIR": str(base / "lock")}

    def share(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli("share", *args, env=self.env, timeout=120)

    def fail(self, prefix: str) -> None:
        doc = fake_mps.load(self.bin)
        (self.bin / "fake.json").write_text(json.dumps({**doc, "fail": prefix}))

    def set_mode(self, uuid: str, mode: str) -> None:
        doc = fake_mps.load(self.bin)
        for g in doc["gpus"]:
            if g["uuid"] == uuid:
                g["mode"] = mode
        (self.bin / "fake.json").write_text(json.dumps(doc))

    def calls(self) -> list[str]:
        return fake_mps.load(self.bin)["calls"]

    def daemon(self) -> int | None:
        try:
            pid = int((self.pipe / fake_mps.PID_FILE).read_text())
        except (OSError, ValueError):
            return None
        return pid if proc_identity(pid) else None


@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path)
    yield h
    fake_mps.stop_daemons(h.pipe)


def proc_identity(pid: int) -> tuple[str, int] | None:
    """(comm, start time) of a live process: the test's own reading of /proc/PID/stat (not gpuprov's)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return None if fields[0] in "ZX" else (text[text.find("(") + 1:text.rfind(")")], int(fields[19]))


def state_doc(pid: int, **kw) -> dict:
    """A share state as `share enable` writes it (its JSON keys; written by hand so that these tests also run against
    an older gpuprov, where they must fail)."""
    ident = proc_identity(pid)
    return {"control": "/usr/bin/nvidia-cuda-mps-control", "pipe_dir": "/run/gpuprov/mps", "log_dir": "/var/log/x",
            "gpus": [], "max_clients": None, "default_memory": None, "default_compute": None, "max_memory": None,
            "uid": 0, "supervisor": "background process", "daemon_pid": pid,
            "daemon_start": ident[1] if ident else 0, "previous_compute_modes": {}, **kw}


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# --- 5. No escape by environment: only the MPS server holds a context on a shared GPU -------------------------------

def test_enable_sets_exclusive_process_before_the_daemon_and_disable_restores(host):
    r = host.share("enable", "--json")
    assert r.returncode == 0, r.stderr
    assert fake_mps.modes(host.bin) == {GPU0: "Exclusive_Process", GPU1: "Exclusive_Process"}
    assert json.loads(host.state.read_text())["previous_compute_modes"] == {GPU0: "Default", GPU1: "Default"}
    calls = host.calls()
    daemon_at = next(i for i, c in enumerate(calls) if c.startswith("control -d"))
    sets = [i for i, c in enumerate(calls) if " -c EXCLUSIVE_PROCESS" in c]
    assert len(sets) == 2 and max(sets) < daemon_at, calls  # no moment with a daemon on a non-exclusive GPU
    assert "control: start_server -uid 0" in calls  # the server holds the context from enable on
    r = host.share("disable", "--json")
    assert r.returncode == 0, r.stderr
    assert fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Default"}
    assert json.loads(r.stdout)["compute_modes_restored"] == {GPU0: "Default", GPU1: "Default"}
    assert host.daemon() is None and not host.state.exists()


def test_only_the_shared_gpus_change_and_the_operators_mode_comes_back(host):
    host.set_mode(GPU1, "Prohibited")  # the operator's own setting on the GPU that will be shared
    r = host.share("enable", "--gpus", "1")
    assert r.returncode == 0, r.stderr
    assert fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Exclusive_Process"}
    assert "control -d CUDA_VISIBLE_DEVICES=1" in host.calls()
    assert host.share("disable").returncode == 0
    assert fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Prohibited"}  # what it was, not DEFAULT


def test_a_refused_mode_change_fails_enable_and_undoes_the_others(host):
    host.fail(f"-i {GPU1} -c EXCLUSIVE_PROCESS")
    r = host.share("enable")
    assert r.returncode == STEP_FAILED and "EXCLUSIVE_PROCESS" in _one_line(r), r.stderr
    assert fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Default"}  # GPU 0, set first, is back
    assert not any(c.startswith("control -d") for c in host.calls()) and host.daemon() is None
    assert not host.state.exists()


def test_a_restarted_share_keeps_the_original_modes(host):
    """The daemon died; enable again finds EXCLUSIVE_PROCESS, which is its own doing: disable still puts back Default."""
    assert host.share("enable").returncode == 0
    os.kill(host.daemon(), signal.SIGKILL)
    r = host.share("enable")
    assert r.returncode == 0, r.stderr
    assert json.loads(host.state.read_text())["previous_compute_modes"] == {GPU0: "Default", GPU1: "Default"}
    assert host.share("disable").returncode == 0
    assert fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Default"}


def test_keep_compute_mode_changes_nothing_and_says_so(host):
    r = host.share("enable", "--keep-compute-mode")
    assert r.returncode == 0, r.stderr
    assert "not held to the limits" in r.stdout
    assert not any(" -c " in c for c in host.calls()) and fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Default"}
    assert json.loads(host.state.read_text())["previous_compute_modes"] == {}


def test_a_gpu_the_host_lacks_is_a_usage_error(host):
    r = host.share("enable", "--gpus", "0,7")
    assert r.returncode == USAGE and "no GPU 7 on this host" in _one_line(r), r.stderr
    assert not any(" -c " in c for c in host.calls()) and host.daemon() is None


# --- 8. The ceiling is on every shared GPU; a refused control command fails enable ----------------------------------

def test_ceiling_without_gpus_is_set_on_every_gpu(host):
    r = host.share("enable", "--max-memory", "8G")
    assert r.returncode == 0, r.stderr
    limits = [c for c in host.calls() if "set_default_device_pinned_mem_limit" in c]
    assert limits == ["control: set_default_device_pinned_mem_limit 0 8192M",
                      "control: set_default_device_pinned_mem_limit 1 8192M"]
    start = host.calls().index("control: start_server -uid 0")
    assert start > host.calls().index(limits[-1])  # a server reads the defaults when it starts


@pytest.mark.parametrize("args,refused", [
    (("--max-memory", "8G"), "set_default_device_pinned_mem_limit 1"),
    (("--max-memory", "8G", "--default-compute", "50"), "set_default_active_thread_percentage"),
    (("--max-memory", "8G"), "start_server"),
])
def test_a_refused_control_command_fails_enable_and_leaves_nothing(host, args, refused):
    # A state from a daemon that died: it must not survive a failed enable either (it claims a ceiling too).
    dead = state_doc(2 ** 22 + 1, control=str(host.bin / "nvidia-cuda-mps-control"), pipe_dir=str(host.pipe),
                     max_memory=1 << 30)  # above the kernel's largest pid_max: never a live process
    host.state.parent.mkdir(parents=True)
    host.state.write_text(json.dumps(dead))
    host.fail(refused)
    r = host.share("enable", *args)
    assert r.returncode == STEP_FAILED, (r.returncode, r.stderr)
    assert refused in _one_line(r), r.stderr  # the line names the command the daemon refused
    assert not host.state.exists()
    assert host.daemon() is None and "control: quit" in host.calls()  # the daemon it started is stopped
    assert fake_mps.modes(host.bin) == {GPU0: "Default", GPU1: "Default"}


# --- 6, 7. The runtime: a dead daemon fails closed; only the shared GPUs are shared ---------------------------------

@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """The H200 capture's driver root, with a second GPU (the h200x2 host's UUID, /dev/nvidia1 195:1, real node)."""
    s = settings(tmp_path)
    disc = discover.discover(s.driver_root, proc_root=s.proc_root, dev_root=s.dev_root)
    g0 = disc.gpus[0]
    g1 = replace(g0, index=1, minor=1, uuid=GPU1, bus_id="00000000:00:07.0", node=Node("/dev/nvidia1", 195, 1))
    os.mknod(Path(s.dev_root) / "dev/nvidia1", 0o666 | 0o020000, os.makedev(195, 1))
    monkeypatch.setattr(modify, "load_discovery", lambda settings, *_: replace(disc, gpus=(g0, g1)))
    return s


@pytest.fixture
def mps_daemon(tmp_path):
    p = fake_mps.named_process(tmp_path)
    yield p
    p.kill()
    p.wait()


def _state(tmp_path, pid: int, **kw) -> Path:
    path = tmp_path / "share.json"
    path.write_text(json.dumps(state_doc(pid, **kw)))
    return path


def _create(tmp_path, s: dict, state: Path, visible: str, *extra: str) -> dict:
    (tmp_path / "bundle/rootfs/etc").mkdir(parents=True, exist_ok=True)
    cfg = {"root": {"path": "rootfs"}, "linux": {"namespaces": [{"type": "ipc"}]},
           "process": {"env": [f"NVIDIA_VISIBLE_DEVICES={visible}", *extra]}}
    modify.modify_config(cfg, str(tmp_path / "bundle"), replace(s, share_state=str(state)))
    return cfg


def _mps_env(cfg: dict) -> dict:
    return {k: v for k, v in (e.split("=", 1) for e in cfg["process"]["env"]) if k.startswith("CUDA_MPS_")}


def test_dead_daemon_refuses_gpu_containers(tmp_path, two_gpus, mps_daemon):
    state = _state(tmp_path, mps_daemon.pid, max_memory=2 << 30)
    assert _mps_env(_create(tmp_path, two_gpus, state, "0"))["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpuprov/mps"
    mps_daemon.kill()
    mps_daemon.wait()
    with pytest.raises(Refused, match=r"MPS control daemon \(pid \d+\) is no longer running: run `gpuprov share "
                                      r"disable` then `gpuprov share enable`"):
        _create(tmp_path, two_gpus, state, "0")


def test_a_pid_now_another_process_is_not_the_daemon(tmp_path, two_gpus, mps_daemon):
    other = subprocess.Popen(["sleep", "600"])  # alive, but not an MPS daemon
    try:
        with pytest.raises(Refused, match="no longer running"):
            _create(tmp_path, two_gpus, _state(tmp_path, other.pid), "0")
    finally:
        other.kill()
        other.wait()
    # A live MPS daemon under the state's pid, but not the one started then (the pid was reused): refused too.
    state = _state(tmp_path, mps_daemon.pid, daemon_start=proc_identity(mps_daemon.pid)[1] - 1)
    with pytest.raises(Refused, match="no longer running"):
        _create(tmp_path, two_gpus, state, "0")


def test_dead_daemon_refusal_is_the_runtimes_exit_code_in_one_line(tmp_path):
    """Through the runtime's front-end as an engine runs it: exit 10, one line naming the fix, runc never called."""
    exe = python_front_end(tmp_path)
    runc = tmp_path / "fake-runc"
    runc.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'runc-calls'}\n")
    runc.chmod(0o755)
    fake_dev(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    state = _state(tmp_path, gone.pid)
    rt = write_settings(tmp_path, runc=str(runc), share_state=str(state))
    b = gpu_bundle(tmp_path, "c1")
    r = subprocess.run([str(exe), "--root", "/run/x", "create", "--bundle", str(b), "id1"], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(rt)})
    assert r.returncode == REFUSED, (r.returncode, r.stderr)
    [line] = r.stderr.strip().splitlines()
    assert "no longer running" in line and "gpuprov share enable" in line
    assert not (tmp_path / "runc-calls").exists()


def test_unshared_gpu_gets_no_mps(tmp_path, two_gpus, mps_daemon):
    state = _state(tmp_path, mps_daemon.pid, gpus=[0], max_memory=2 << 30, default_memory=1 << 30)
    shared = _create(tmp_path, two_gpus, state, "0")
    assert _mps_env(shared)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    plain = _create(tmp_path, two_gpus, state, "1", "CUDA_MPS_PIPE_DIRECTORY=/elsewhere")
    assert _mps_env(plain) == {}  # neither ours nor the container's own
    assert not any(m["destination"] == "/run/gpuprov/mps" for m in plain.get("mounts", []))
    assert {"type": "ipc"} in plain["linux"]["namespaces"]  # its own IPC namespace, as without sharing
    mps_daemon.kill()
    mps_daemon.wait()
    assert _mps_env(_create(tmp_path, two_gpus, state, "1")) == {}  # GPU 1 never needed the daemon


@pytest.mark.parametrize("visible", ["0,1", "all", GPU1 + ",0"])
def test_shared_and_unshared_together_refused(tmp_path, two_gpus, mps_daemon, visible):
    state = _state(tmp_path, mps_daemon.pid, gpus=[0])
    with pytest.raises(Refused, match="asks for shared GPU 0 and unshared GPU 1: ask for shared GPUs only or "
                                      "unshared GPUs only"):
        _create(tmp_path, two_gpus, state, visible)


def test_limits_on_an_unshared_gpu_refused(tmp_path, two_gpus, mps_daemon):
    state = _state(tmp_path, mps_daemon.pid, gpus=[0])
    with pytest.raises(Refused, match="GPU 1 is not shared"):
        _create(tmp_path, two_gpus, state, "1", "GPUPROV_GPU_MEMORY=2G")


def test_every_gpu_shared_when_enable_named_none(tmp_path, two_gpus, mps_daemon):
    state = _state(tmp_path, mps_daemon.pid, max_memory=2 << 30, default_memory=1 << 30)
    env = _mps_env(_create(tmp_path, two_gpus, state, "all"))
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M,1=1024M"


# --- 6, better still: systemd restarts the daemon, and the state follows it ------------------------------------------

def _systemd_restarts(host: Host) -> None:
    """What gpuprov-mps.service's Restart= does after the daemon died: ExecStart again, in the unit's environment."""
    env = {"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(host.pipe),
           "CUDA_MPS_LOG_DIRECTORY": str(host.base / "log/mps")}
    subprocess.run([str(host.bin / "nvidia-cuda-mps-control"), "-d"], env=env, check=True, timeout=60)


def test_the_state_follows_a_restarted_daemon_with_its_limits(host):
    assert host.share("enable", "--max-memory", "8G", "--default-compute", "50").returncode == 0
    old = host.daemon()
    os.kill(old, signal.SIGKILL)
    _systemd_restarts(host)
    seen = len(host.calls())
    r = host.share("follow", "--state", str(host.state), "--json")  # the unit's ExecStartPost
    assert r.returncode == 0, r.stderr
    new = host.daemon()
    assert json.loads(r.stdout) == {"followed": True, "daemon_pid": new, "was": old} and new != old
    doc = json.loads(host.state.read_text())
    assert (doc["daemon_pid"], doc["daemon_start"]) == (new, proc_identity(new)[1])
    assert host.calls()[seen:] == [  # the new daemon has the ceiling on every GPU, then its server
        "nvidia-smi --query-gpu=index,uuid,compute_mode --format=csv,noheader",
        "control: set_default_device_pinned_mem_limit 0 8192M", "control: set_default_device_pinned_mem_limit 1 8192M",
        "control: set_default_active_thread_percentage 50", "control: start_server -uid 0"]


def test_a_follow_that_fails_keeps_refusing(host):
    assert host.share("enable", "--max-memory", "8G").returncode == 0
    old = host.daemon()
    os.kill(old, signal.SIGKILL)
    _systemd_restarts(host)
    host.fail("set_default_device_pinned_mem_limit 1")
    r = host.share("follow", "--state", str(host.state))
    assert r.returncode == STEP_FAILED and "set_default_device_pinned_mem_limit 1" in _one_line(r), r.stderr
    assert json.loads(host.state.read_text())["daemon_pid"] == old  # still the dead one: the runtime refuses


def test_follow_leaves_a_running_daemon_and_a_missing_state_alone(host):
    r = host.share("follow", "--state", str(host.state), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["followed"] is False  # enable's own start: no state yet
    assert host.share("enable").returncode == 0
    before = host.state.read_text()
    r = host.share("follow", "--state", str(host.state), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["followed"] is False and host.state.read_text() == before


def test_the_unit_restarts_the_daemon_and_runs_follow(tmp_path):
    from provision.share import mps
    from provision.share.state import MpsState

    st = MpsState(control="/usr/bin/nvidia-cuda-mps-control", pipe_dir="/run/gpuprov/mps", log_dir="/var/log/x")
    unit = mps.unit_text(st, "/run/gpuprov/share.json").splitlines()
    assert "Restart=always" in unit and "PIDFile=/run/gpuprov/mps/nvidia-cuda-mps-control.pid" in unit
    [post] = [ln for ln in unit if ln.startswith("ExecStartPost=")]
    assert post.endswith(" -m provision share follow --state /run/gpuprov/share.json"), post

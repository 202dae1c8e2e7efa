"""cGPU parity (issue 42): high-priority containers, the seed's scheduling policies, and `share status` as cgpu-smi.

Fixture tests of the MPS settings each container gets under each policy (the editor's real code on the fake driver
root; what the GPU does with them is tests/gpu/test_gpu_share_priority.py), the policy table against REFERENCE.md,
`share enable --policy` through the real CLI with the fake MPS tools (tests/fake_mps.py), and the status view
grouped per container. Each case fails on 112b38f: ALIYUN_COM_GPU_HIGH_PRIO was ignored silently, a container's own
CUDA_MPS_CLIENT_PRIORITY survived, `--policy` did not exist and status listed processes, not containers."""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import modify
from provision.share import mps, policy
from provision.share.limits import share_request
from provision.share.state import MpsState, ShareRequest
from tests import fake_mps

REPO = Path(__file__).resolve().parents[2]
STATE = MpsState(control="/usr/bin/nvidia-cuda-mps-control", pipe_dir="/run/gpuprov/mps",
                 log_dir="/var/log/gpuprov/mps", max_clients=4, uid=0, supervisor="background process", daemon_pid=1)
HIGH = {"ALIYUN_COM_GPU_HIGH_PRIO": "1"}


def _state(name: str, **kw) -> MpsState:
    return replace(STATE, policy=name, **kw)


# --- the table ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,name", [("preemptive", "preemptive"), ("1", "preemptive"), ("2", "weight-preemptive"),
                                       ("FIXED", "fixed"), (" 5 ", "native")])
def test_policies_by_name_or_the_seeds_number(text, name):
    assert policy.parse(text).name == name


@pytest.mark.parametrize("text,nearest", [("fair-share", "fixed"), ("0", "fixed"), ("soft", "preemptive"),
                                          ("4", "preemptive")])
def test_time_slice_policies_refused_naming_the_nearest(text, nearest):
    with pytest.raises(ValueError) as e:
        policy.parse(text)
    msg = str(e.value)
    assert "\n" not in msg and "MPS has no time slices" in msg and f"use --policy {nearest}" in msg


def test_unknown_policy_lists_them():
    with pytest.raises(ValueError, match=r"not a policy \(one of fair-share \(0\), preemptive \(1\)"):
        policy.parse("round-robin")


def test_reference_table_is_the_code_table():
    """docs/REFERENCE.md's policy table: one row per policy, in order, with the seed's number, cGPU's and gpuprov's
    words as share/policy.py has them, and the test that proves the row."""
    text = (REPO / "docs/REFERENCE.md").read_text()
    rows = [ln for ln in text.splitlines() if re.match(r"^\| `[a-z-]+` \(\d\) \|", ln)]
    assert len(rows) == len(policy.POLICIES)
    for row, p in zip(rows, policy.POLICIES):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:3] == [f"`{p.name}` ({p.number})", p.cgpu, p.mps], row
        assert "test_" in cells[3], row


# --- what each container gets ---------------------------------------------------------------------------------------

def test_weight_preemptive_weights_become_ceilings_and_priority_orders():
    st = _state("weight-preemptive")
    assert share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "2"}, 1, st) == ShareRequest(compute=50, priority=1)
    assert share_request({}, 1, st) == ShareRequest(priority=1)  # no weight, no ceiling, below normal
    high = share_request({**HIGH, "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"}, 1, st)
    assert high.priority == 0 and high.compute is None  # not held to the policy's shares
    assert high.notes == ("ALIYUN_COM_GPU_SCHD_WEIGHT=1 left unused: a high-priority container is not held to the "
                          "policy's shares",)


def test_the_projects_own_name_for_high_priority():
    st = _state("preemptive")
    assert share_request({"GPUPROV_GPU_PRIORITY": "high"}, 1, st).priority == 0
    assert share_request({"GPUPROV_GPU_PRIORITY": "normal"}, 1, st).priority == 1
    with pytest.raises(Refused, match="GPUPROV_GPU_PRIORITY='urgent': must be high or normal"):
        share_request({"GPUPROV_GPU_PRIORITY": "urgent"}, 1, st)
    with pytest.raises(Refused, match="ALIYUN_COM_GPU_HIGH_PRIO='2': must be 0"):
        share_request({"ALIYUN_COM_GPU_HIGH_PRIO": "2"}, 1, st)


def test_preemptive_has_no_ceilings_and_says_a_weight_is_unused():
    st = _state("preemptive")
    req = share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "3"}, 1, st)
    assert req.compute is None and req.priority == 1
    assert req.notes == ("ALIYUN_COM_GPU_SCHD_WEIGHT=3 left unused: this host's sharing policy preemptive has no "
                         "weights",)
    assert share_request(HIGH, 1, replace(st, prio_ratio=80)) == ShareRequest(compute=80, priority=0)


def test_fixed_gives_every_container_its_share_and_high_priority_the_rest():
    st = _state("fixed")  # max_inst 4; the shares go in each client's environment, not the daemon's default
    assert share_request({}, 1, st) == ShareRequest(compute=25, priority=1)
    assert share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "3"}, 1, st) == ShareRequest(compute=75, priority=1)
    assert share_request(HIGH, 1, st) == ShareRequest(compute=None, priority=0)
    assert share_request(HIGH, 1, replace(st, prio_ratio=60)) == ShareRequest(compute=60, priority=0)


def test_the_daemons_default_is_everyones_ceiling_so_high_priority_gets_no_more():
    """--default-compute is set in the daemon, and MPS holds every client to it (measured on an H100: 100% asked
    under a default of 25 gave 32 of 132 SMs): a high-priority container asks for nothing above it."""
    st = _state("weight-preemptive", default_compute=25)
    assert share_request({}, 1, st) == ShareRequest(compute=25, priority=1)
    assert share_request(HIGH, 1, st) == ShareRequest(compute=None, priority=0)


def test_native_is_memory_only_and_refuses_priority():
    st = _state("native")
    req = share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "2", "ALIYUN_COM_GPU_MEM_CONTAINER": "6"}, 1, st)
    assert req.memory == {0: 6 << 30} and req.compute is None and req.priority is None
    assert "policy native has no weights" in req.notes[0]
    with pytest.raises(Refused) as e:
        share_request(HIGH, 1, st)
    assert "\n" not in str(e.value) and "policy native has no priorities" in str(e.value)
    assert "--policy preemptive" in str(e.value)


@pytest.mark.parametrize("env", [HIGH, {"GPUPROV_GPU_PRIORITY": "high"}])
def test_high_priority_refused_when_sharing_is_off(env):
    with pytest.raises(Refused) as e:
        share_request(env, 1, None)
    assert "\n" not in str(e.value) and "sharing is off: run `gpuprov share enable` first" in str(e.value)


def test_normal_priority_and_high_prio_zero_ask_nothing():
    assert share_request({"ALIYUN_COM_GPU_HIGH_PRIO": "0", "GPUPROV_GPU_PRIORITY": "normal"}, 1, None) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
@pytest.mark.parametrize("asked,expect", [({}, "1"), (HIGH, "0")])
def test_a_container_never_sets_its_own_priority(tmp_path, asked, expect):
    """The editor on a container that sets CUDA_MPS_CLIENT_PRIORITY=0 itself: gpuprov's value replaces it."""
    from tests.inject_helpers import settings

    daemon = fake_mps.named_process(tmp_path)
    state = tmp_path / "share.json"
    state.write_text(replace(STATE, daemon_pid=daemon.pid, policy="preemptive").to_json())
    (tmp_path / "bundle/rootfs/etc").mkdir(parents=True)
    env = ["NVIDIA_VISIBLE_DEVICES=all", "CUDA_MPS_CLIENT_PRIORITY=0"] + [f"{k}={v}" for k, v in asked.items()]
    cfg = {"root": {"path": "rootfs"}, "process": {"env": env}}
    warned: list[str] = []
    try:
        modify.modify_config(cfg, str(tmp_path / "bundle"), settings(tmp_path, share_state=str(state)), warned.append)
    finally:
        daemon.kill()
    got = [e for e in cfg["process"]["env"] if e.startswith("CUDA_MPS_CLIENT_PRIORITY=")]
    assert got == [f"CUDA_MPS_CLIENT_PRIORITY={expect}"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
def test_an_unused_weight_is_one_line_in_the_runtimes_log(tmp_path):
    from tests.inject_helpers import settings

    daemon = fake_mps.named_process(tmp_path)
    state = tmp_path / "share.json"
    state.write_text(replace(STATE, daemon_pid=daemon.pid, policy="native").to_json())
    (tmp_path / "bundle/rootfs/etc").mkdir(parents=True)
    cfg = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all",
                                                           "ALIYUN_COM_GPU_SCHD_WEIGHT=2"]}}
    warned: list[str] = []
    try:
        modify.modify_config(cfg, str(tmp_path / "bundle"), settings(tmp_path, share_state=str(state)), warned.append)
    finally:
        daemon.kill()
    assert [w for w in warned if "SCHD_WEIGHT" in w] == [
        "ALIYUN_COM_GPU_SCHD_WEIGHT=2 left unused: this host's sharing policy native has no weights"]
    assert not any(e.startswith("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=") for e in cfg["process"]["env"])


# --- `share enable --policy` through the CLI ------------------------------------------------------------------------

@pytest.fixture
def host(tmp_path):
    from tests.faults.test_share_round2 import Host

    h = Host(tmp_path)
    yield h
    fake_mps.stop_daemons(h.pipe)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the host lock, the runtime's checks)")
def test_enable_fixed_records_the_policy_and_max_inst(host):
    r = host.share("enable", "--policy", "3", "--max-clients", "4", "--keep-compute-mode", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(host.state.read_text())
    assert doc["policy"] == "fixed" and doc["default_compute"] is None and doc["max_clients"] == 4
    # no daemon default: MPS would hold every client to it, weights above 1 and high priority included
    assert not any("set_default_active_thread_percentage" in c for c in host.calls())
    st = json.loads(host.share("status", "--json").stdout)
    assert st["daemon"]["policy"] == "fixed" and st["daemon"]["policy_number"] == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the host lock, the runtime's checks)")
@pytest.mark.parametrize("args,needle", [
    (["--policy", "fair-share"], "use --policy fixed (3), the nearest it can"),
    (["--policy", "soft"], "use --policy preemptive (1), the nearest it can"),
    (["--policy", "fixed"], "add --max-clients N"),
    (["--policy", "native", "--default-compute", "50"], "--policy native sets no compute limits"),
    (["--policy", "native", "--prio-ratio", "50"], "native has none"),
    (["--policy", "fixed", "--max-clients", "4", "--default-compute", "50"], "drop --default-compute"),
    (["--default-compute", "50", "--prio-ratio", "80"], "--prio-ratio cannot lift it"),
    (["--prio-ratio", "10"], "--prio-ratio 10: must be 20-99"),
    (["--max-clients", "30"], "max_inst is 1-25"),
])
def test_enable_refuses_what_mps_cannot_do_before_any_change(host, args, needle):
    r = host.share("enable", *args, "--keep-compute-mode")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not host.state.exists() and host.daemon() is None and host.calls() == []


# --- `share status` as cgpu-smi -------------------------------------------------------------------------------------

def test_status_groups_clients_per_container_with_share_and_priority(tmp_path, monkeypatch):
    from provision.metrics.containers import ContainerRef

    (tmp_path / "share.json").write_text(replace(STATE, policy="weight-preemptive").to_json())
    monkeypatch.setattr(MpsState, "daemon_running", lambda st: True)
    answers = {"get_server_list": "900", "get_client_list 900": "11\n12\n13\n14"}
    monkeypatch.setattr(mps, "control", lambda st, cmd, timeout=10: answers[cmd])
    online = ContainerRef("c" * 64, "docker", "online")
    batch = ContainerRef("b" * 64, "docker", "batch")
    procs = {11: (0, online, 1500 << 20), 12: (0, batch, 2000 << 20), 13: (0, batch, 1000 << 20),
             14: (0, None, 300 << 20)}
    envs = {11: {"CUDA_MPS_CLIENT_PRIORITY": "0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M"},
            12: {"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"},
            13: {"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}, 14: {}}
    monkeypatch.setattr("provision.metrics.nvml.snapshot", lambda: None)
    monkeypatch.setattr("provision.metrics.usage.by_pid", lambda snap: procs)
    monkeypatch.setattr(mps, "_env_of", lambda pid: envs[pid])
    st = mps.status(str(tmp_path / "share.json"))
    rows = {(r["container_name"] or "host"): r for r in st["containers"]}
    assert rows["online"] == {**rows["online"], "gpu": 0, "memory_used_mib": 1500, "memory_limit": "0=4096M",
                              "compute_percent": None, "priority": "high", "pids": [11]}
    assert rows["batch"] == {**rows["batch"], "memory_used_mib": 3000, "memory_limit": "0=8192M",
                             "compute_percent": "25", "priority": "normal", "pids": [12, 13]}
    assert rows["host"]["priority"] == "normal (not set)" and rows["host"]["pids"] == [14]
    assert len(st["clients"]) == 4 and st["daemon"]["policy"] == "weight-preemptive"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the host lock, the runtime's checks)")
def test_status_table_has_cgpu_smis_columns(host):
    assert host.share("enable", "--policy", "preemptive", "--keep-compute-mode").returncode == 0
    r = host.share("status")
    assert r.returncode == 0, r.stderr
    assert "policy" in r.stdout and "preemptive (1)" in r.stdout
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("GPU"))
    assert header.split() == ["GPU", "CONTAINER", "MEM", "USED", "(MiB)", "MEM", "CAP", "COMPUTE", "%", "PRIORITY",
                              "PIDS"]

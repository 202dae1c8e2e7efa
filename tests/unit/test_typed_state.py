"""The typed records that cross modules: MPS share state (`share enable` writes it, the runtime, `share status`,
`k8s labels` read it). One JSON form, round-tripped; an old file still reads; a broken one is one line with the
way out (exit 6 in the CLI, a refusal in the runtime), never a KeyError traceback."""
from __future__ import annotations

import json
import os
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from provision.errors import Refused
from provision.inject import modify
from provision.share import mps
from provision.share.limits import mps_env, share_request
from provision.share.state import MpsState, ShareRequest, ShareStateInvalid
from tests.conftest import run_cli

# The state file as `gpuprov share enable` has written it since sharing landed (ea51faf), before --max-memory.
OLD_STATE = {"control": "/usr/bin/nvidia-cuda-mps-control", "pipe_dir": "/run/gpuprov/mps",
             "log_dir": "/var/log/gpuprov/mps", "gpus": [0], "max_clients": 4, "default_memory": 2147483648,
             "default_compute": 50, "uid": 0, "supervisor": "systemd (gpuprov-mps.service)", "daemon_pid": 4242}
STATE = MpsState(control="/usr/bin/nvidia-cuda-mps-control", pipe_dir="/run/gpuprov/mps",
                 log_dir="/var/log/gpuprov/mps", gpus=(0, 1), max_clients=4, default_memory=2 << 30, default_compute=50,
                 max_memory=8 << 30, uid=0, supervisor="background process", daemon_pid=4242)


def test_state_round_trips_and_keeps_the_file_format():
    assert MpsState.from_json(STATE.to_json()) == STATE
    doc = json.loads(STATE.to_json())
    assert list(doc) == [f.name for f in fields(MpsState)]  # every field on disk, under its own name
    assert doc["gpus"] == [0, 1] and doc["max_memory"] == 8 << 30 and doc["daemon_pid"] == 4242
    with pytest.raises(FrozenInstanceError):
        STATE.daemon_pid = 1  # type: ignore[misc]


def test_old_state_file_still_reads():
    st = MpsState.from_json(json.dumps(OLD_STATE))
    assert st.max_memory is None and st.gpus == (0,) and st.systemd and st.default_memory == 2 << 30
    assert json.loads(st.to_json()) == {**OLD_STATE, "max_memory": None}


@pytest.mark.parametrize("text,needle", [
    ("{not json", "not JSON"), ("[]", "not a JSON object"),
    (json.dumps({k: v for k, v in OLD_STATE.items() if k != "pipe_dir"}), "'pipe_dir' is missing"),
    (json.dumps({k: v for k, v in OLD_STATE.items() if k != "daemon_pid"}), "'daemon_pid' is missing"),
    (json.dumps({**OLD_STATE, "daemon_pid": "4242"}), "'daemon_pid' must be an integer"),
    (json.dumps({**OLD_STATE, "daemon_pid": 0}), "must be a process id"),
    (json.dumps({**OLD_STATE, "default_memory": 1.5}), "'default_memory' must be an integer"),
    (json.dumps({**OLD_STATE, "gpus": ["0"]}), "'gpus' must be a list of GPU indices"),
])
def test_broken_state_named_precisely(text, needle):
    with pytest.raises(ShareStateInvalid, match=needle):
        MpsState.from_json(text)


def test_request_and_env_read_the_typed_state():
    req = share_request({"GPUPROV_GPU_COMPUTE": "20"}, 2, STATE)
    assert req == ShareRequest(memory={0: 2 << 30, 1: 2 << 30}, compute=20)  # the default memory, both GPUs
    assert mps_env(req, STATE) == {"CUDA_MPS_PIPE_DIRECTORY": "/run/gpuprov/mps",
                                   "CUDA_MPS_LOG_DIRECTORY": "/var/log/gpuprov/mps",
                                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M,1=2048M",
                                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20"}
    with pytest.raises(Refused, match="ceiling \\(8192 MiB"):
        share_request({"GPUPROV_GPU_MEMORY": "9G"}, 1, STATE)
    weight = share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "1"}, 1, replace(STATE, default_memory=None))
    assert weight == ShareRequest(memory=None, compute=25)  # 1 of max_clients 4


def _cli_env(tmp_path, state_text: str | None) -> dict:
    state = tmp_path / "share.json"
    if state_text is not None:
        state.write_text(state_text)
    (tmp_path / "runtime.json").write_text(json.dumps({"share_state": str(state)}))
    return {"GPUPROV_RUNTIME_CONFIG": str(tmp_path / "runtime.json"), "GPUPROV_LOCK_DIR": str(tmp_path)}


@pytest.mark.parametrize("text,needle", [("{garbled", "not JSON"),
                                         (json.dumps({k: v for k, v in OLD_STATE.items() if k != "log_dir"}),
                                          "'log_dir' is missing")])
def test_cli_broken_state_is_exit_6_and_disable_clears_it(tmp_path, text, needle):
    env = _cli_env(tmp_path, text)
    r = run_cli("share", "status", "--json", env=env)
    assert r.returncode == 6 and r.stdout == "", r.stderr
    [line] = r.stderr.strip().splitlines()
    assert needle in line and str(tmp_path / "share.json") in line and "gpuprov share disable" in line
    r = run_cli("share", "disable", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stopped"] is False and not (tmp_path / "share.json").exists()
    r = run_cli("share", "status", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout) == {"enabled": False, "daemon": None, "clients": []}


def test_status_json_schema_from_typed_state(tmp_path, monkeypatch):
    (tmp_path / "share.json").write_text(STATE.to_json())
    monkeypatch.setattr(mps, "daemon_pid", lambda st: st.daemon_pid)
    monkeypatch.setattr(mps, "control", lambda st, cmd, timeout=10: "")
    monkeypatch.setattr("provision.metrics.nvml.snapshot", lambda: None)
    monkeypatch.setattr("provision.metrics.usage.by_pid", lambda snap: {})
    st = mps.status(str(tmp_path / "share.json"))
    assert st == {"enabled": True, "daemon": {"pid": 4242, "supervisor": "background process", "gpus": [0, 1],
                                              "pipe_dir": "/run/gpuprov/mps", "default_memory": 2 << 30,
                                              "default_compute": 50}, "servers": [], "clients": []}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
def test_runtime_refuses_on_a_broken_state_and_runs_without_one(tmp_path):
    from tests.inject_helpers import settings

    (tmp_path / "bundle/rootfs/etc").mkdir(parents=True)
    state = tmp_path / "share.json"
    state.write_text(json.dumps({**OLD_STATE, "daemon_pid": os.getpid(), "pipe_dir": None}))
    s = {**settings(tmp_path), "share_state": str(state)}
    cfg = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}
    with pytest.raises(Refused, match=f"GPU sharing state {state} is not gpuprov's \\('pipe_dir' is missing\\)"):
        modify.modify_config(json.loads(json.dumps(cfg)), str(tmp_path / "bundle"), s)
    state.write_text(json.dumps({**OLD_STATE, "daemon_pid": os.getpid()}))
    done = json.loads(json.dumps(cfg))
    assert modify.modify_config(done, str(tmp_path / "bundle"), s)
    env = dict(e.split("=", 1) for e in done["process"]["env"])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    state.unlink()  # sharing never enabled: a plain GPU container
    plain = json.loads(json.dumps(cfg))
    assert modify.modify_config(plain, str(tmp_path / "bundle"), s)
    assert not any(e.startswith("CUDA_MPS_") for e in plain["process"]["env"])

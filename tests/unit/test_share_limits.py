"""Sharing requests: sizes, lists, the seed's aliases, defaults, and one-line refusals."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from provision.inject import modify
from provision.inject.edits import Refused
from provision.share.limits import GIB, mps_env, parse_memory, parse_size, share_request
from provision.share.state import MpsState, ShareRequest

STATE = MpsState(control="/usr/bin/nvidia-cuda-mps-control", pipe_dir="/run/gpuprov/mps",
                 log_dir="/var/log/gpuprov/mps", max_clients=4, uid=0, supervisor="background process", daemon_pid=1)


@pytest.mark.parametrize("text,expect", [("6G", 6 * GIB), ("6GiB", 6 * GIB), ("6", 6 * GIB), ("512M", 512 << 20),
                                         ("1.5G", 3 * GIB // 2), ("2048MiB", 2 * GIB), (" 1t ", 1 << 40)])
def test_sizes(text, expect):
    assert parse_size(text, "X") == expect


@pytest.mark.parametrize("bad", ["", "abc", "6X", "-1G", "0", "G"])
def test_bad_sizes_one_line(bad):
    with pytest.raises(Refused) as e:
        parse_size(bad, "GPUPROV_GPU_MEMORY")
    assert "\n" not in str(e.value) and "GPUPROV_GPU_MEMORY" in str(e.value)


def test_lists():
    assert parse_memory("3,4,5,6", "A", 4) == {0: 3 * GIB, 1: 4 * GIB, 2: 5 * GIB, 3: 6 * GIB}
    assert parse_memory("2G", "A", 2) == {0: 2 * GIB, 1: 2 * GIB}
    assert parse_memory("1=4G,0=2G", "A", 2) == {0: 2 * GIB, 1: 4 * GIB}
    with pytest.raises(Refused, match="3 sizes for 2 visible"):
        parse_memory("1,2,3", "A", 2)
    with pytest.raises(Refused, match="mix"):
        parse_memory("0=1G,2G", "A", 2)


def test_gpuprov_vars_and_mps_env():
    req = share_request({"GPUPROV_GPU_MEMORY": "6G", "GPUPROV_GPU_COMPUTE": "50"}, 1, STATE)
    assert req == ShareRequest(memory={0: 6 * GIB}, compute=50, priority=1)
    env = mps_env(req, STATE)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpuprov/mps"


def test_aliyun_aliases():
    req = share_request({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15",
                         "ALIYUN_COM_GPU_SCHD_WEIGHT": "2"}, 1, STATE)
    assert req == ShareRequest(memory={0: 6 * GIB}, compute=50, priority=1)  # weight 2 of max_inst 4
    assert share_request({"ALIYUN_COM_GPU_MEM_CONTAINER": "0"}, 1, None) is None  # 0 = cGPU not used
    with pytest.raises(Refused, match="more than the card"):
        share_request({"ALIYUN_COM_GPU_MEM_CONTAINER": "16", "ALIYUN_COM_GPU_MEM_DEV": "15"}, 1, STATE)
    with pytest.raises(Refused, match="between 1 and max_inst"):
        share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "9"}, 1, STATE)


def test_limits_refused_when_sharing_off():
    with pytest.raises(Refused, match="sharing is off: run `gpuprov share enable`"):
        share_request({"GPUPROV_GPU_MEMORY": "2G"}, 1, None)
    assert share_request({}, 1, None) is None


def test_defaults_apply_to_containers_that_ask_nothing():
    st = replace(STATE, default_memory=4 * GIB, default_compute=25)
    assert share_request({}, 2, st) == ShareRequest(memory={0: 4 * GIB, 1: 4 * GIB}, compute=25, priority=1)


def test_request_above_ceiling_refused():
    st = replace(STATE, max_memory=4 * GIB)
    assert share_request({"GPUPROV_GPU_MEMORY": "4G"}, 1, st).memory == {0: 4 * GIB}
    with pytest.raises(Refused, match="above this host's sharing ceiling \\(4096 MiB"):
        share_request({"GPUPROV_GPU_MEMORY": "6G"}, 1, st)


@pytest.mark.parametrize("bad,needle", [("GPUPROV_GPU_COMPUTE=0", "between 1 and 100"),
                                        ("GPUPROV_GPU_COMPUTE=half", "not an integer")])
def test_bad_compute(bad, needle):
    k, v = bad.split("=")
    with pytest.raises(Refused, match=needle):
        share_request({k: v}, 1, STATE)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
def test_runtime_injects_mps_and_strips_container_values(tmp_path):
    from tests.fake_mps import named_process
    from tests.inject_helpers import settings

    daemon = named_process(tmp_path)
    state = tmp_path / "share.json"
    state.write_text(replace(STATE, daemon_pid=daemon.pid).to_json())
    (tmp_path / "bundle/rootfs/etc").mkdir(parents=True)
    cfg = {"root": {"path": "rootfs"}, "mounts": [{"destination": "/dev/shm", "source": "shm", "type": "tmpfs"}],
           "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}]},
           "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all", "GPUPROV_GPU_MEMORY=2G",
                               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=100G", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100"]}}
    try:
        modify.modify_config(cfg, str(tmp_path / "bundle"), settings(tmp_path, share_state=str(state)))
    finally:
        daemon.kill()
    env = dict(e.split("=", 1) for e in cfg["process"]["env"])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"  # the container's 100G is gone
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpuprov/mps"
    shm = [m for m in cfg["mounts"] if m["destination"] == "/dev/shm"]
    assert shm == [{"destination": "/dev/shm", "source": "/dev/shm", "type": "bind",
                    "options": ["rbind", "nosuid", "nodev", "noexec"]}]
    assert {"type": "ipc"} not in cfg["linux"]["namespaces"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
def test_runtime_refuses_limits_without_sharing(tmp_path):
    from tests.inject_helpers import settings

    (tmp_path / "bundle/rootfs").mkdir(parents=True)
    cfg = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all", "GPUPROV_GPU_MEMORY=2G"]}}
    with pytest.raises(Refused, match="sharing is off"):
        modify.modify_config(cfg, str(tmp_path / "bundle"),
                             settings(tmp_path, share_state=str(tmp_path / "none.json")))

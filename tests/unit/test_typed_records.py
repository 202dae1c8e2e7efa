"""The typed records that cross modules, each with one JSON form:
- Discovery (inject/discover.py): the runtime's cache file and `gpuprov runtime discover --json`; read by modify,
  edits, cdi, k8s and the CLI. Its JSON is pinned field by field here (a reader or writer using a wrong field
  fails), a garbled or older cache is a miss that is rebuilt, and the warm editor's parsed copy is immutable.
- MpsState / ShareRequest (share/state.py): `share enable` writes the state, the runtime, `share status` and
  `k8s labels` read it. An old file still reads; a broken one is one line with the way out (exit 6 in the CLI, a
  refusal in the runtime), never a KeyError traceback."""
from __future__ import annotations

import json
import os
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from provision.errors import Refused
from provision.inject import discover, modify
from provision.inject.discover import ControlNodes, Discovery, Firmware, Gpu, Library, Manifest, Node
from provision.share import mps
from provision.share.limits import mps_env, share_request
from provision.share.state import MpsState, ShareRequest, ShareStateInvalid
from tests.conftest import H200, run_cli

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
    assert st.daemon_start == 0 and st.previous_compute_modes == ()  # not recorded then: the pid and name are checked
    assert json.loads(st.to_json()) == {**OLD_STATE, "max_memory": None, "daemon_start": 0,
                                        "previous_compute_modes": {}, "policy": "", "prio_ratio": None}


@pytest.mark.parametrize("text,needle", [
    ("{not json", "not JSON"), ("[]", "not a JSON object"),
    (json.dumps({k: v for k, v in OLD_STATE.items() if k != "pipe_dir"}), "'pipe_dir' is missing"),
    (json.dumps({k: v for k, v in OLD_STATE.items() if k != "daemon_pid"}), "'daemon_pid' is missing"),
    (json.dumps({**OLD_STATE, "daemon_pid": "4242"}), "'daemon_pid' must be an integer"),
    (json.dumps({**OLD_STATE, "daemon_pid": 0}), "must be a process id"),
    (json.dumps({**OLD_STATE, "default_memory": 1.5}), "'default_memory' must be an integer"),
    (json.dumps({**OLD_STATE, "gpus": ["0"]}), "'gpus' must be a list of GPU indices"),
    (json.dumps({**OLD_STATE, "daemon_start": "123"}), "'daemon_start' must be an integer"),
    (json.dumps({**OLD_STATE, "previous_compute_modes": ["Default"]}), "'previous_compute_modes' must map"),
    (json.dumps({**OLD_STATE, "policy": "fair-share"}), "'policy' must name a policy gpuprov can honour"),
    (json.dumps({**OLD_STATE, "policy": 3}), "'policy' must name a policy"),
    (json.dumps({**OLD_STATE, "prio_ratio": "50"}), "'prio_ratio' must be an integer"),
])
def test_broken_state_named_precisely(text, needle):
    with pytest.raises(ShareStateInvalid, match=needle):
        MpsState.from_json(text)


def test_request_and_env_read_the_typed_state():
    req = share_request({"GPUPROV_GPU_COMPUTE": "20"}, 2, STATE)
    # the default memory, both GPUs; below normal: a file from before policies means weight-preemptive
    assert req == ShareRequest(memory={0: 2 << 30, 1: 2 << 30}, compute=20, priority=1)
    assert mps_env(req, STATE) == {"CUDA_MPS_PIPE_DIRECTORY": "/run/gpuprov/mps",
                                   "CUDA_MPS_LOG_DIRECTORY": "/var/log/gpuprov/mps",
                                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M,1=2048M",
                                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20", "CUDA_MPS_CLIENT_PRIORITY": "1"}
    with pytest.raises(Refused, match="ceiling \\(8192 MiB"):
        share_request({"GPUPROV_GPU_MEMORY": "9G"}, 1, STATE)
    weight = share_request({"ALIYUN_COM_GPU_SCHD_WEIGHT": "1"}, 1, replace(STATE, default_memory=None))
    assert weight == ShareRequest(memory=None, compute=25, priority=1)  # 1 of max_clients 4


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
    assert r.returncode == 0 and json.loads(r.stdout) == {"enabled": False, "daemon": None, "clients": [],
                                                          "containers": []}


def test_status_json_schema_from_typed_state(tmp_path, monkeypatch):
    (tmp_path / "share.json").write_text(STATE.to_json())
    monkeypatch.setattr(MpsState, "daemon_running", lambda st: True)
    monkeypatch.setattr(mps, "control", lambda st, cmd, timeout=10: "")
    monkeypatch.setattr("provision.metrics.nvml.snapshot", lambda: None)
    monkeypatch.setattr("provision.metrics.usage.by_pid", lambda snap: {})
    st = mps.status(str(tmp_path / "share.json"))
    assert st == {"enabled": True, "daemon": {"pid": 4242, "supervisor": "background process", "gpus": [0, 1],
                                              "pipe_dir": "/run/gpuprov/mps", "policy": "weight-preemptive",
                                              "policy_number": 2, "max_clients": 4, "prio_ratio": None,
                                              "default_memory": 2 << 30, "default_compute": 50},
                  "compute_modes_before": {}, "servers": [], "clients": [], "containers": []}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
def test_runtime_refuses_on_a_broken_state_and_runs_without_one(tmp_path):
    from tests.inject_helpers import settings

    (tmp_path / "bundle/rootfs/etc").mkdir(parents=True)
    from tests.fake_mps import named_process

    daemon = named_process(tmp_path)  # the daemon the state names runs: killed at the end
    state = tmp_path / "share.json"
    state.write_text(json.dumps({**OLD_STATE, "daemon_pid": daemon.pid, "pipe_dir": None}))
    s = settings(tmp_path, share_state=str(state))
    cfg = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}
    with pytest.raises(Refused, match=f"GPU sharing state {state} is not gpuprov's \\('pipe_dir' is missing\\)"):
        modify.modify_config(json.loads(json.dumps(cfg)), str(tmp_path / "bundle"), s)
    state.write_text(json.dumps({**OLD_STATE, "daemon_pid": daemon.pid}))
    done = json.loads(json.dumps(cfg))
    try:
        assert modify.modify_config(done, str(tmp_path / "bundle"), s)
    finally:
        daemon.kill()
    env = dict(e.split("=", 1) for e in done["process"]["env"])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    state.unlink()  # sharing never enabled: a plain GPU container
    plain = json.loads(json.dumps(cfg))
    assert modify.modify_config(plain, str(tmp_path / "bundle"), s)
    assert not any(e.startswith("CUDA_MPS_") for e in plain["process"]["env"])


# --- Discovery ---

ROOT = str(H200 / "usr/local/nvidia")
UUID = "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98"


@pytest.fixture(scope="module")
def disc() -> Discovery:
    return discover.discover(ROOT, proc_root=str(H200), dev_root=str(H200))


def test_discovery_json_is_pinned_field_by_field(disc):
    """The cache's and `runtime discover --json`'s schema (3 since each GPU carries its arch, 4 since its brand, 5
    since the cache names the paths its key watches): every key spelled out."""
    doc = json.loads(disc.to_json())
    assert list(doc) == ["schema", "driver_root", "version", "libraries", "libraries32", "manifests",
                         "firmware_needed", "binaries", "nodes", "gpus", "ipc", "firmware"]
    assert doc["schema"] == 5 and doc["driver_root"] == ROOT and doc["version"] == "580.159.04"
    assert doc["libraries"]["compute"][0] == {"name": "libcuda", "path": f"{ROOT}/lib64/libcuda.so.580.159.04",
                                              "soname": "libcuda.so.1"}
    assert doc["libraries32"] == {} and doc["firmware_needed"] is False and doc["ipc"] == {}
    assert {"cap": "graphics", "path": f"{ROOT}/share/glvnd/egl_vendor.d/10_nvidia.json",
            "container_path": "/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "library": "libEGL_nvidia.so.0",
            "rewrite": None} in doc["manifests"]
    assert doc["binaries"]["utility"][0] == f"{ROOT}/bin/nvidia-smi"
    assert doc["nodes"] == {"ctl": {"path": "/dev/nvidiactl", "major": 195, "minor": 255},
                            "uvm": {"path": "/dev/nvidia-uvm", "major": 238, "minor": 0},
                            "uvm-tools": {"path": "/dev/nvidia-uvm-tools", "major": 238, "minor": 1}}
    assert doc["gpus"] == [{"bus_id": "0000:00:06.0", "uuid": UUID, "minor": 0, "model": "NVIDIA H200", "index": 0,
                            "node": {"path": "/dev/nvidia0", "major": 195, "minor": 0}, "drm": [], "arch": None,
                            "brand": None}]
    assert doc["firmware"][0] == {"path": f"{ROOT}/firmware/nvidia/580.159.04/gsp_ga10x.bin",
                                  "container_path": "/lib/firmware/nvidia/580.159.04/gsp_ga10x.bin"}


def test_discovery_round_trips_with_every_optional_part():
    full = Discovery(
        driver_root="/", version="580.159.04",
        libraries={"compute": (Library("libcuda", "/usr/lib/libcuda.so.580.159.04", "libcuda.so.1"),)},
        libraries32={"compute": (Library("libcuda", "/usr/lib32/libcuda.so.580.159.04", "libcuda.so.1"),)},
        manifests=(Manifest("graphics", "/usr/share/vulkan/icd.d/nvidia_icd.json", "/usr/share/vulkan/icd.d/x.json",
                            "/opt/libGLX_nvidia.so.0", "libGLX_nvidia.so.0", "/var/lib/gpuprov/m/x.json"),),
        firmware_needed=True, binaries={"utility": ("/usr/bin/nvidia-smi",)},
        nodes=ControlNodes(Node("/dev/nvidiactl", 195, 255), Node("/dev/nvidia-uvm", 238, 0),
                           Node("/dev/nvidia-uvm-tools", 238, 1), Node("/dev/nvidia-modeset", 195, 254)),
        gpus=(Gpu("0000:3b:00.0", UUID, 1, "NVIDIA H200", 0, Node("/dev/nvidia1", 195, 1),
                  (Node("/dev/dri/card1", 226, 1), Node("/dev/dri/renderD128", 226, 128)), "9.0"),),
        persistenced="/run/nvidia-persistenced/socket",
        firmware=(Firmware("/lib/firmware/nvidia/580.159.04/gsp_ga10x.bin", "/lib/firmware/x.bin"),), key="NVRM v",
        watch=("/usr/lib/x86_64-linux-gnu", "/dev/nvidia-modeset"))
    again = Discovery.from_json(full.to_json())
    assert again == full and again.to_json() == full.to_json()
    doc = full.to_dict()
    assert doc["ipc"] == {"persistenced": "/run/nvidia-persistenced/socket"} and doc["key"] == "NVRM v"
    assert list(doc["nodes"]) == ["ctl", "uvm", "uvm-tools", "modeset"]
    assert doc["manifests"][0]["generated"] == "/var/lib/gpuprov/m/x.json"
    assert [n.path for n in full.nodes.present()] == ["/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia-uvm",
                                                      "/dev/nvidia-uvm-tools"]  # the CDI spec's order
    with pytest.raises(FrozenInstanceError):
        full.version = "1"  # type: ignore[misc]
    with pytest.raises(TypeError):  # the parsed copy's maps are read-only too: the warm editor shares it
        again.libraries["compute"] = ()  # type: ignore[index]


def _garble(doc: dict, how: str) -> str:
    if how == "truncated":
        return json.dumps(doc)[:300]
    if how == "old schema":
        return json.dumps({**doc, "schema": 1})
    if how == "missing key":
        return json.dumps({k: v for k, v in doc.items() if k != "gpus"})
    if how == "wrong type":
        doc["nodes"]["ctl"]["major"] = "195"
        return json.dumps(doc)
    if how == "unknown field":
        doc["gpus"][0]["mig"] = []
        return json.dumps(doc)
    return "[]"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
@pytest.mark.parametrize("how", ["truncated", "old schema", "missing key", "wrong type", "unknown field", "not a map"])
def test_garbled_cache_is_a_miss_and_rebuilt(tmp_path, how):
    from tests.inject_helpers import settings

    s = settings(tmp_path)
    good = modify.load_discovery(s)  # writes the cache
    text = _garble(json.loads(open(s.cache).read()), how)
    with open(s.cache, "w") as fh:
        fh.write(text)
    assert discover.load_cached(s.cache, s.proc_root) is None
    assert modify.load_discovery(s) == good  # rebuilt from the driver root ...
    assert discover.load_cached(s.cache, s.proc_root) == good  # ... and the cache rewritten


def test_cache_of_another_driver_is_a_miss(tmp_path, disc):
    cache = tmp_path / "discovery.json"
    cache.write_text(replace(disc, key="NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.00").to_json())
    assert discover.load_cached(str(cache), str(H200)) is None
    cache.write_text(replace(disc, key=discover.host_key(str(H200))).to_json())
    assert discover.load_cached(str(cache), str(H200)) == replace(disc, key=discover.host_key(str(H200)))


def test_warm_editor_reuses_its_parse_until_the_cache_changes(tmp_path, disc):
    cache = tmp_path / "discovery.json"
    first = replace(disc, key=discover.host_key(str(H200)))
    cache.write_text(first.to_json())
    a = discover.load_cached(str(cache), str(H200))
    assert discover.load_cached(str(cache), str(H200)) is a  # same file: no second parse
    changed = replace(first, version="580.159.05")
    cache.write_text(changed.to_json())  # same size, new content
    b = discover.load_cached(str(cache), str(H200))
    assert b == changed and b is not a


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
def test_runtime_discover_json_is_the_record(tmp_path):
    from tests.inject_helpers import write_settings

    env = {"GPUPROV_RUNTIME_CONFIG": str(write_settings(tmp_path))}
    r = run_cli("runtime", "discover", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    expect = discover.discover(ROOT, proc_root=str(H200), dev_root=str(tmp_path / "devroot")).to_dict()
    assert doc == expect and "key" not in doc
    text = run_cli("runtime", "discover", env=env).stdout
    assert f"0:0000:00:06.0 {UUID} arch unknown" in text and "/dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools" in text
    # A driver whose nvidia-smi answers (the capture's, tests/fake_nvidia_smi.py): each GPU's compute capability.
    from tests.inject_helpers import driver_root_with_smi

    env = {"GPUPROV_RUNTIME_CONFIG": str(write_settings(tmp_path, driver_root=str(driver_root_with_smi(tmp_path))))}
    assert [g["arch"] for g in json.loads(run_cli("runtime", "discover", "--json", env=env).stdout)["gpus"]] == ["9.0"]
    assert f"0:0000:00:06.0 {UUID} arch 9.0" in run_cli("runtime", "discover", env=env).stdout

"""`gpuprov metrics`: NVML readings (a fake at pynvml's function boundary, answering from the real H200 capture)
through the real process->container mapping, rendered in Prometheus text format and read back with
prometheus-client's own parser. Real processes in real cgroups for the mapping (see also
tests/integration/test_metrics_containers.py, with Docker containers)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from provision.metrics import containers, nvml, prom, usage
from tests.fake_nvml import FakeMigNVML, FakeNVML, Proc

UUID = "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98"


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.fixture
def fake_proc(tmp_path):
    """A /proc tree with three GPU processes: a containerd CRI container (systemd cgroup driver, its bundle's
    config.json with containerd's CRI annotations, found through its shim), a Docker container (cgroupfs), and a
    host process (the MPS server)."""
    cid = "a" * 64
    did = "b" * 64
    proc = tmp_path / "proc"
    bundle = tmp_path / "run/containerd/io.containerd.runtime.v2.task/k8s.io"
    (bundle / "sandbox1").mkdir(parents=True)
    (bundle / cid).mkdir()
    (bundle / cid / "config.json").write_text(
        '{"ociVersion":"1.0.2","annotations":{"io.kubernetes.cri.container-type":"container",'
        '"io.kubernetes.cri.container-name":"trainer","io.kubernetes.cri.sandbox-name":"job-0",'
        '"io.kubernetes.cri.sandbox-namespace":"ml"}}')

    def mk(pid, cgroup, comm="python3", ppid=1, cwd=None, cmdline=""):
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "cgroup").write_text(cgroup)
        (d / "comm").write_text(comm + "\n")
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
        (d / "cmdline").write_text(cmdline)
        if cwd:
            os.symlink(cwd, d / "cwd")

    mk(100, "0::/system.slice/containerd.service\n", comm="containerd-shim", cwd=str(bundle / "sandbox1"),
       cmdline="/usr/bin/containerd-shim-runc-v2\0-namespace\0k8s.io\0-id\0sandbox1\0")
    mk(101, f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-{cid}.scope\n",
       ppid=100)
    mk(102, f"12:memory:/docker/{did}\n11:devices:/docker/{did}\n", ppid=1)
    mk(103, "0::/system.slice/gpuprov-mps.service\n", comm="nvidia-cuda-mps")
    return proc, cid, did


def fake_with(procs: dict[int, int], mps: dict[int, int] | None = None, util: dict[int, int] | None = None):
    nv = FakeNVML()
    nv.compute[0] = [Proc(p, m) for p, m in procs.items()]
    nv.mps[0] = [Proc(p, m) for p, m in (mps or {}).items()]
    nv.sm_util[0] = util or {}
    return nv


def test_gpu_readings_come_from_the_capture(tmp_path):
    snap = nvml.snapshot(FakeNVML(), kmsg=str(tmp_path / "none"))
    g = snap.gpus[0]
    assert (snap.driver_version, snap.cuda_version) == ("580.159.04", "13.0")
    assert (g.name, g.uuid, g.pci_bus_id, g.minor) == ("NVIDIA H200", UUID, "00000000:00:06.0", 0)
    assert g.memory_total == 143771 << 20 and g.temperature == 37 and g.power_watts == 126.32
    assert (g.ecc_corrected, g.ecc_uncorrected, g.energy_mj, g.mig_capable) == (0, 0, None, True)


def test_xid_from_the_kernel_log(tmp_path):
    kmsg = tmp_path / "kmsg"  # /dev/kmsg records, as the driver writes them
    kmsg.write_text("6,1234,5678,-;NVRM: Xid (PCI:0000:00:06): 31, pid=4242, name=python3, Ch 00000008\n"
                    "6,1235,5679,-;NVRM: Xid (PCI:0000:00:06): 79, pid='<unknown>', GPU has fallen off the bus.\n"
                    "6,1236,5680,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception\n")
    snap = nvml.snapshot(FakeNVML(), kmsg=str(kmsg))
    assert snap.gpus[0].last_xid == 79  # the last one for this GPU's bus, not another GPU's


def test_cgroup_paths_of_every_engine():
    h = "c" * 64
    cases = {
        f"12:pids:/docker/{h}\n": (h, "docker"),
        f"0::/system.slice/docker-{h}.scope\n": (h, "docker"),
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podx.slice/cri-containerd-{h}.scope\n":
            (h, "containerd"),
        f"3:cpu:/kubepods/besteffort/pod0a1b/{h}\n": (h, "containerd"),
        f"0::/kubepods.slice/kubepods-pody.slice/crio-{h}.scope\n": (h, "cri-o"),
        f"0::/machine.slice/libpod-{h}.scope\n": (h, "podman"),  # the podman adapter's prefix
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{h}.scope\n": (h, "podman"),  # rootless
        f"0::/libpod_parent/libpod-{h}\n": (h, "podman"),  # cgroupfs manager
        "0::/default/myctr\n": ("myctr", "containerd"),
        "0::/gpuprov-test-1\n": ("gpuprov-test-1", "runc"),
    }
    for text, want in cases.items():
        assert containers.container_id_from_cgroup(text) == want, text
    for host in ("0::/\n", "0::/system.slice/ssh.service\n", "0::/user.slice/user-0.slice/session-3.scope\n"):
        assert containers.container_id_from_cgroup(host) is None, host


def test_containers_named_from_cri_annotations_and_metrics_parse(fake_proc, tmp_path):
    proc, cid, did = fake_proc
    nv = fake_with({101: 3 << 30, 102: 1 << 30, 103: 64 << 20}, util={101: 40, 102: 7})
    snap = nvml.snapshot(nv, kmsg=str(tmp_path / "none"))
    use = usage.by_container(snap, str(proc))
    text = prom.render(snap, use, "node-a")
    fam = families(text)
    mem = {s.labels["id"]: s for s in fam["container_accelerator_memory_used_bytes"]}
    assert set(mem) == {cid, did}  # the MPS server (a host service) is no container
    crio = mem[cid].labels
    assert (crio["container"], crio["pod"], crio["namespace"]) == ("trainer", "job-0", "ml")
    assert (crio["make"], crio["model"], crio["acc_id"]) == ("nvidia", "NVIDIA H200", UUID)
    assert mem[cid].value == 3 << 30 and mem[did].value == 1 << 30
    duty = {s.labels["id"]: s.value for s in fam["container_accelerator_duty_cycle"]}
    assert duty == {cid: 40, did: 7}
    used = fam["DCGM_FI_DEV_FB_USED"][0]
    assert used.value == (3 << 10) + (1 << 10) + 64  # MiB, as dcgm-exporter reports it
    assert used.labels == {"gpu": "0", "UUID": UUID, "pci_bus_id": "00000000:00:06.0", "device": "nvidia0",
                           "modelName": "NVIDIA H200", "hostname": "node-a", "DCGM_FI_DRIVER_VERSION": "580.159.04"}
    assert fam["DCGM_FI_DEV_GPU_TEMP"][0].value == 37 and fam["DCGM_FI_DEV_POWER_USAGE"][0].value == 126.32
    assert fam["DCGM_FI_DEV_FB_TOTAL"][0].value == 143771
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" not in fam  # not supported: left out, never a made-up 0
    assert fam["DCGM_FI_DEV_XID_ERRORS"][0].value == 0


def test_mig_devices_reported_per_instance_with_their_container(fake_proc, tmp_path):
    """MIG on (the h100-mig fixture's NVML: 1g.10gb GI 9 and 10, 2g.20gb GI 3, 3g.40gb GI 2): memory per GPU instance
    (read through each MIG handle), each MIG device's UUID, index, GI/CI and parent, and the container on it. The
    parent's process list holds every instance's processes too: each counts once, on its MIG device (main reported
    whole GPUs only, with the processes on the GPU)."""
    proc, cid, did = fake_proc
    nv = FakeMigNVML()
    nv.compute[(0, 2)] = [Proc(101, 3 << 30)]  # the containerd container on MIG device 2 (GI 3, 2g.20gb)
    nv.compute[(0, 0)] = [Proc(102, 1 << 30), Proc(103, 64 << 20)]  # Docker's and a host process on device 0 (GI 9)
    snap = nvml.snapshot(nv, kmsg=str(tmp_path / "none"))
    g = snap.gpus[0]
    assert g.mig_enabled and g.processes == [] and [d.gi for d in g.mig_devices] == [9, 10, 3, 2]
    use = usage.by_container(snap, str(proc))
    assert [(u.ref.id, u.mig, u.memory_bytes) for u in use] == [(did, 0, 1 << 30), (cid, 2, 3 << 30)]
    fam = families(prom.render(snap, use, "node-a"))
    fb = {s.labels.get("GPU_I_ID"): s.value for s in fam["DCGM_FI_DEV_FB_USED"]}
    assert fb == {None: 4096 + 64, "9": 1024 + 64, "10": 0, "3": 3072, "2": 0}  # MiB; None: the whole GPU
    total = {s.labels.get("GPU_I_ID"): s.value for s in fam["DCGM_FI_DEV_FB_TOTAL"]}
    assert (total["9"], total["3"], total["2"]) == (9984, 20096, 40448)  # the H100's -lgip profiles
    info = {s.labels["mig_uuid"]: s.labels for s in fam["gpuprov_mig_device_info"]}
    d2 = info["MIG-50f1c4c9-1508-5e8d-bb06-d08145b22e01"]
    assert (d2["mig_index"], d2["GPU_I_ID"], d2["GPU_CI_ID"], d2["GPU_I_PROFILE"], d2["gpu"], d2["UUID"]) == \
        ("2", "3", "0", "2g.20gb", "0", "GPU-72078e36-3be8-e850-3cb6-446d44c26b39")
    mem = {s.labels["id"]: s for s in fam["container_accelerator_memory_used_bytes"]}
    trainer = mem[cid].labels
    assert (trainer["container"], trainer["acc_id"], trainer["GPU_I_ID"], trainer["GPU_CI_ID"]) == \
        ("trainer", "MIG-50f1c4c9-1508-5e8d-bb06-d08145b22e01", "3", "0")
    assert trainer["model"] == "NVIDIA H100 80GB HBM3 MIG 2g.20gb" and mem[cid].value == 3 << 30
    tot = {s.labels["id"]: s.value for s in fam["container_accelerator_memory_total_bytes"]}
    assert tot == {cid: 20096 << 20, did: 9984 << 20}  # the instance's memory, not the GPU's
    assert fam["container_accelerator_duty_cycle"] == []  # NVML has no per-process SM use on MIG: none, not 0


def test_exposition_is_prometheus_clients():
    """Issue 28 item 15: the text is prometheus_client's generate_latest over gpuprov's collector in a registry of
    its own; DCGM-exporter's counters keep their names (the library would append `_total` to a counter: they are
    untyped, the documented change), and every other TYPE is as before."""
    from prometheus_client import CollectorRegistry, generate_latest

    snap = nvml.snapshot(FakeNVML(), kmsg="/nonexistent")
    snap.gpus[0].energy_mj = 123456
    reg = CollectorRegistry(auto_describe=False)
    reg.register(prom.SnapshotCollector(snap, [], "h"))
    text = prom.render(snap, [], "h")
    assert text == generate_latest(reg).decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    for name in ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"):
        assert types[name] == "untyped" and f"{name}{{" in text and f"{name}_total" not in text
    assert types["DCGM_FI_DEV_FB_USED"] == types["container_accelerator_duty_cycle"] == "gauge"
    assert families(text)["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"][0].value == 123456


def test_mps_client_counted_once(fake_proc, tmp_path):
    """An MPS client is listed both as a compute process and as an MPS client: its memory counts once."""
    proc, cid, _ = fake_proc
    nv = fake_with({101: 2 << 30, 103: 300 << 20}, mps={101: 2 << 30})
    snap = nvml.snapshot(nv, kmsg=str(tmp_path / "none"))
    (u,) = usage.by_container(snap, str(proc))
    assert u.memory_bytes == 2 << 30 and u.pids == [101]
    assert [p.kind for p in snap.gpus[0].processes] == ["mps", "compute"]


def test_label_values_escaped(tmp_path):
    nv = FakeNVML()
    nv.gpus[0].find("product_name").text = 'NVIDIA "H200"\\x\nnext'
    snap = nvml.snapshot(nv, kmsg=str(tmp_path / "none"))
    fam = families(prom.render(snap, [], 'host"1'))
    assert fam["DCGM_FI_DEV_GPU_TEMP"][0].labels["modelName"] == 'NVIDIA "H200"\\x\nnext'
    assert fam["DCGM_FI_DEV_GPU_TEMP"][0].labels["hostname"] == 'host"1'


def test_real_process_in_a_real_cgroup(tmp_path):
    """A real process moved into a real cgroup named like a runc container: found by its PID in the real /proc."""
    base = Path("/sys/fs/cgroup")
    v2 = (base / "cgroup.controllers").exists()
    cg_dir = base / ("" if v2 else "pids") / "gpuprov-k8s-test-ctr"
    if not os.access(cg_dir.parent, os.W_OK):  # v1: /sys/fs/cgroup itself is a read-only tmpfs, pids/ is not
        pytest.skip("needs root and a writable cgroup hierarchy (CI has both)")
    cg_dir.mkdir(exist_ok=True)

    def move(pid: int) -> None:
        """Into the test's cgroup; on v1 also into every other hierarchy's root, so that the process's cgroups are
        the test's own even where pytest itself runs in a container (/docker/<id> in every hierarchy, as on the
        hosts of bench/host_orders.py), as a container's process is in its cgroup in every hierarchy."""
        (cg_dir / "cgroup.procs").write_text(str(pid))
        for other in [] if v2 else [d for d in base.iterdir() if d != cg_dir.parent and not d.is_symlink()]:
            try:
                (other / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass

    p = subprocess.Popen(["unshare", "--mount", "sleep", "30"])  # a container has its own mount namespace
    try:
        move(p.pid)
        for _ in range(50):  # until unshare(2) has run
            if os.readlink(f"/proc/{p.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
                break
            time.sleep(0.05)
        ref = containers.container_of(p.pid)
        assert ref is not None and ref.id == "gpuprov-k8s-test-ctr"
        host = subprocess.Popen(["sleep", "30"])  # same cgroup, host mount namespace: a host process, not a container
        try:
            move(host.pid)
            assert containers.container_of(host.pid) is None
        finally:
            host.kill()
            host.wait()
        assert containers.container_of(os.getpid()) is None or containers.container_of(os.getpid()).id != ref.id
    finally:
        p.kill()
        p.wait()
        for _ in range(50):
            try:
                cg_dir.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_textfile_is_atomic_and_listen_serves(tmp_path, monkeypatch):
    from provision.commands import metrics as cmd

    text = prom.render(nvml.snapshot(FakeNVML(), kmsg=str(tmp_path / "none")), [], "h")
    path = cmd.write_textfile(str(tmp_path), text)
    assert Path(path).read_text() == text and sorted(os.listdir(tmp_path)) == ["gpuprov.prom", "none"] or \
        sorted(os.listdir(tmp_path)) == ["gpuprov.prom"]
    from http.server import ThreadingHTTPServer  # noqa: F401 - the server module the command uses

    port_holder = {}

    def run():
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port_holder["port"] = s.getsockname()[1]
        s.close()
        cmd.serve("127.0.0.1", port_holder["port"], collect=lambda: text)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    for _ in range(50):
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port_holder.get('port', 1)}/metrics", timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    assert body.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "DCGM_FI_DEV_GPU_TEMP" in families(body.read().decode())


def test_metrics_import_is_lazy():
    """`gpuprov detect` must not pay for the NVML binding: nothing imports pynvml at start-up."""
    out = subprocess.run([sys.executable, "-c", "import sys, provision.cli; print('pynvml' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    # prometheus_client (66 ms) only where text is written: not for start-up, `metrics --json`, labels or the runtime
    code = ("import sys, provision.cli, provision.commands.metrics, provision.commands.k8s, provision.inject.modify; "
            "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', 'provision.metrics.prom'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_share_status_and_metrics_agree(fake_proc, tmp_path, monkeypatch):
    """`gpuprov share status` and `gpuprov metrics` report the same memory for the same container (one mapping)."""
    from provision.metrics import containers as C
    from provision.share import mps
    from provision.share.state import MpsState

    proc, cid, did = fake_proc
    nv = fake_with({101: 3 << 30, 102: 1 << 30}, mps={101: 3 << 30, 102: 1 << 30})
    monkeypatch.setattr(nvml, "load", lambda: nv)
    monkeypatch.setattr(nvml, "last_xids", lambda kmsg="": {})
    real = C.container_of
    monkeypatch.setattr(C, "container_of", lambda pid, p="/proc", cache=None: real(pid, str(proc), cache))
    monkeypatch.setattr("provision.metrics.usage.container_of", C.container_of)
    state = tmp_path / "share.json"
    state.write_text(MpsState(control="/nonexistent/mps-control", pipe_dir="/nonexistent", log_dir="/nonexistent",
                              supervisor="background process", daemon_pid=1).to_json())
    monkeypatch.setattr(MpsState, "daemon_running", lambda st: True)
    monkeypatch.setattr(mps, "control", lambda st, cmd, timeout=10: {"get_server_list": "103"}.get(cmd, "101\n102"))
    st = mps.status(str(state))
    by_share = {c["container"]: c["memory_used_mib"] for c in st["clients"]}
    snap = nvml.snapshot()
    fam = families(prom.render(snap, usage.by_container(snap), "h"))
    by_metrics = {s.labels["id"]: int(s.value) >> 20 for s in fam["container_accelerator_memory_used_bytes"]}
    assert by_share == by_metrics == {cid: 3 << 10, did: 1 << 10}
    assert {c["container_name"] for c in st["clients"]} == {"trainer", "b" * 12}

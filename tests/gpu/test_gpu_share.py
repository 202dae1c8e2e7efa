"""On a real GPU (marked `gpu`): MPS through `gpuprov share`, two containers with 2 GiB and 4 GiB caps through
gpuprov-runtime, allocations below the cap succeed and above it fail, status shows both, disable leaves nothing.

A lent GPU's settings are never changed: every `share enable` here passes --keep-compute-mode, so the GPU's compute
mode stays as found (EXCLUSIVE_PROCESS, what `share enable` sets by default, is proven against a fake nvidia-smi in
tests/faults/test_share_round2.py). Issue 19's runtime checks are cheap here and run too: a state naming a daemon
that is gone refuses containers (item 6); with two GPUs or more, an unshared GPU gets no MPS and a container spanning
shared and unshared GPUs is refused (item 7), and a ceiling without --gpus holds on GPU 1 too (item 8)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.gpu.test_gpu_runtime import _record, build_cuda, rootfs, runtime  # noqa: F401 - fixtures
from tests.oci import finish, lifecycle, make_config, start, write_bundle

pytestmark = pytest.mark.gpu
ALLOC = r"""
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
int main(int argc, char **argv) {
  size_t mib = atol(argv[1]); int hold = argc > 2 ? atoi(argv[2]) : 0;
  void *p = nullptr;
  cudaError_t e = cudaMalloc(&p, mib << 20);
  if (e != cudaSuccess) { printf("ALLOC FAIL %zu MiB: %s\n", mib, cudaGetErrorString(e)); return 2; }
  cudaMemset(p, 1, mib << 20); cudaDeviceSynchronize();
  printf("ALLOC OK %zu MiB\n", mib); fflush(stdout);
  sleep(hold); cudaFree(p); return 0;
}
"""


@pytest.fixture(scope="module")
def shared(runtime, rootfs, tmp_path_factory):  # noqa: F811
    build_cuda(rootfs, ALLOC, "alloc", tmp_path_factory.mktemp("alloc"))
    r = run_cli("share", "enable", "--gpus", "0", "--max-clients", "4", "--keep-compute-mode", "--json")
    assert r.returncode == 0, r.stderr
    _record("share_enable", json.loads(r.stdout))
    yield runtime
    r = run_cli("share", "disable", "--json")
    _record("share_disable", r.stdout + r.stderr)


def _n_gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


two_gpus = pytest.mark.skipif(_n_gpus() < 2, reason="needs a host with two GPUs or more")


def _state_file() -> Path:
    return Path(json.loads(Path(os.environ["GPUPROV_RUNTIME_CONFIG"]).read_text()).get("share_state")
                or "/run/gpuprov/share.json")


def test_a_server_runs_from_enable(shared):
    """`share enable` starts the MPS server itself (start_server), so it holds the GPU's context before any client."""
    st = json.loads(run_cli("share", "status", "--json").stdout)
    _record("share_server_at_enable", st)
    assert st["enabled"] and st["servers"], st


def test_state_naming_a_gone_daemon_refuses(shared, rootfs, tmp_path):  # noqa: F811
    """Item 6, without touching the real daemon: the state is made to name a process that has exited (as after a
    crash, or a restart under a new pid); a container on the shared GPU is refused, then the state is put back."""
    path = _state_file()
    kept = path.read_text()
    gone = subprocess.Popen(["true"])
    gone.wait()
    path.write_text(json.dumps({**json.loads(kept), "daemon_pid": gone.pid}))
    try:
        rc, out = lifecycle(shared, write_bundle(tmp_path / "a", _cfg(rootfs, ["/alloc", "64"], "2G")))
    finally:
        path.write_text(kept)
    _record("share_gone_daemon", [rc, out])
    assert rc == 10 and "no longer running" in out, (rc, out)


@two_gpus
def test_unshared_gpu_runs_without_mps_and_mixed_is_refused(shared, rootfs, tmp_path):  # noqa: F811
    """Item 7 (sharing is on for GPU 0 only): GPU 1 gets no MPS settings and allocates past GPU 0's caps; 0,1 is
    refused."""
    cfg = make_config(str(rootfs), ["sh", "-c", "env | grep -c ^CUDA_MPS_; /alloc 3072"], ["NVIDIA_VISIBLE_DEVICES=1"])
    rc1, out1 = lifecycle(shared, write_bundle(tmp_path / "one", cfg))
    cfg = make_config(str(rootfs), ["/alloc", "64"], ["NVIDIA_VISIBLE_DEVICES=0,1"])
    rc2, out2 = lifecycle(shared, write_bundle(tmp_path / "mixed", cfg))
    _record("share_unshared_gpu", {"gpu1": out1, "mixed": [rc2, out2]})
    assert rc1 == 0 and out1.splitlines()[0].strip() == "0" and "ALLOC OK 3072 MiB" in out1, out1
    assert rc2 == 10 and "unshared GPU 1" in out2, (rc2, out2)


def _cfg(rootfs, args, limit, extra=()):  # noqa: F811
    return make_config(str(rootfs), args, ["NVIDIA_VISIBLE_DEVICES=0", f"GPUPROV_GPU_MEMORY={limit}", *extra])


def test_two_containers_with_caps_and_status(shared, rootfs, tmp_path):  # noqa: F811
    # The MPS cap counts the CUDA context too (about 0.5 GiB measured on an H200): 1 GiB fits under 2 GiB,
    # 3 GiB under 4 GiB.
    a = start(shared, write_bundle(tmp_path / "a", _cfg(rootfs, ["/alloc", "1024", "10"], "2G")), tmp_path / "a.out")
    b = start(shared, write_bundle(tmp_path / "b", _cfg(rootfs, ["/alloc", "3072", "10"], "4G")), tmp_path / "b.out")
    assert a[1] and b[1], (a[2], b[2])
    time.sleep(6)
    st = run_cli("share", "status", "--json")
    human = run_cli("share", "status")
    _record("share_status_json", json.loads(st.stdout))
    _record("share_status", human.stdout)
    outs = [finish(shared, a[0], a[1], tmp_path / "a.out"), finish(shared, b[0], b[1], tmp_path / "b.out")]
    _record("share_below_limit", outs)
    assert "ALLOC OK 1024 MiB" in outs[0] and "ALLOC OK 3072 MiB" in outs[1], outs
    limits = sorted(c["memory_limit"] for c in json.loads(st.stdout)["clients"])
    assert limits == ["0=2048M", "0=4096M"], st.stdout


def test_above_cap_fails(shared, rootfs, tmp_path):  # noqa: F811
    ra, oa = lifecycle(shared, write_bundle(tmp_path / "a", _cfg(rootfs, ["/alloc", "3072"], "2G")))
    rb, ob = lifecycle(shared, write_bundle(tmp_path / "b", _cfg(rootfs, ["/alloc", "5120"], "4G")))
    _record("share_above_limit", [oa, ob])
    assert "ALLOC FAIL 3072 MiB" in oa and "ALLOC FAIL 5120 MiB" in ob, (oa, ob)


def test_container_cannot_raise_its_limit(shared, rootfs, tmp_path):  # noqa: F811
    cfg = _cfg(rootfs, ["/alloc", "3072"], "2G", ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=100G"])
    rc, out = lifecycle(shared, write_bundle(tmp_path / "a", cfg))
    _record("share_raise_via_config_env", out)
    assert "ALLOC FAIL 3072 MiB" in out, out
    # Informational: a process inside that sets the variable itself before CUDA starts (recorded, not asserted).
    cfg = _cfg(rootfs, ["sh", "-c", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G /alloc 3072"], "2G")
    _record("share_raise_in_process", lifecycle(shared, write_bundle(tmp_path / "b", cfg))[1])


def test_daemon_ceiling_holds_against_the_container_itself(shared, rootfs, tmp_path):  # noqa: F811
    """--max-memory is enforced by the MPS daemon: a process inside that sets or unsets its own
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT still cannot allocate past it."""
    run_cli("share", "disable")
    r = run_cli("share", "enable", "--gpus", "0", "--max-clients", "4", "--max-memory", "2G",
                "--default-memory", "2G", "--keep-compute-mode", "--json")
    assert r.returncode == 0, r.stderr
    res = {}
    for name, script in (("default_only", "/alloc 3072"),
                         ("override_8G", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G /alloc 3072"),
                         ("unset", "unset CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; /alloc 3072")):
        cfg = make_config(str(rootfs), ["sh", "-c", script], ["NVIDIA_VISIBLE_DEVICES=0"])
        res[name] = lifecycle(shared, write_bundle(tmp_path / name, cfg))[1]
    _record("share_daemon_ceiling", res)
    assert all("ALLOC FAIL 3072 MiB" in v for v in res.values()), res


@two_gpus
def test_zy_ceiling_on_every_gpu_without_gpus(shared, rootfs, tmp_path):  # noqa: F811
    """Item 8: --max-memory without --gpus is the daemon's ceiling on every GPU it serves. Each client allocates on
    its CUDA device 0 (which card that is under MPS is recorded, not asserted, with the `nvidia-smi -L` it sees):
    1 GiB fits, 3 GiB does not, for a container on GPU 0 and one on GPU 1 alike."""
    run_cli("share", "disable")
    r = run_cli("share", "enable", "--max-memory", "2G", "--keep-compute-mode", "--json")
    assert r.returncode == 0, r.stderr
    res = {}
    for gpu in ("0", "1"):
        cfg = make_config(str(rootfs), ["sh", "-c", "unset CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; nvidia-smi -L; "
                                        "/alloc 1024; /alloc 3072"], [f"NVIDIA_VISIBLE_DEVICES={gpu}"])
        res[gpu] = lifecycle(shared, write_bundle(tmp_path / f"g{gpu}", cfg))[1]
    _record("share_ceiling_every_gpu", res)
    assert all("ALLOC OK 1024 MiB" in v and "ALLOC FAIL 3072 MiB" in v for v in res.values()), res


def test_zz_disable_leaves_no_daemon(shared):
    r = run_cli("share", "disable", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    _record("share_disable_result", res)
    assert res["stopped"] and res["left_running"] == []
    assert json.loads(run_cli("share", "status", "--json").stdout)["enabled"] is False

"""On a real GPU (marked `gpu`), issue 42: cGPU's high priority and policies on MPS, through gpuprov-runtime and runc.

- The driver has the knob: `CUDA_MPS_CLIENT_PRIORITY` is named in the lent host's libcuda (recorded with the driver
  and CUDA versions).
- Priority: a high-priority container runs short kernels (the probe) while another container saturates the GPU with
  a busy kernel loop (the load). The probe's launch-to-finish latency (p50/p99) is measured alone, beside a load at
  the same MPS priority (the load also asks for high priority: both at normal) and beside a normal container's load
  (below normal, what gpuprov gives every container that does not ask for high). High priority must be measurably
  ahead: the p50 beside a below-normal load is under the p50 beside an equal-priority load.
- Policies: each mapping once, with the SM count and memory CUDA reports inside the container.

A lent GPU's settings are never changed: every `share enable` passes --keep-compute-mode."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import run_cli
from tests.gpu.test_gpu_runtime import _record, build_cuda, rootfs, runtime  # noqa: F401 - fixtures
from tests.oci import finish, lifecycle, make_config, start, write_bundle

pytestmark = pytest.mark.gpu
PRIO = r"""
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char **argv) {
  cudaDeviceProp p; if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) { printf("NO DEVICE\n"); return 2; }
  int khz = 0; cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  long long per_us = khz / 1000;
  if (!strcmp(argv[1], "props")) {
    size_t f = 0, t = 0; cudaMemGetInfo(&f, &t);
    printf("SMS %d TOTAL_MIB %zu FREE_MIB %zu\n", p.multiProcessorCount, t >> 20, f >> 20); return 0;
  }
  if (!strcmp(argv[1], "load")) {  // many 200 us blocks, 8 per SM: the scheduler always has load blocks waiting
    double secs = atof(argv[2]), t0 = now(); int n = 0, blocks = p.multiProcessorCount * 8 * 50;
    printf("LOAD START sms=%d\n", p.multiProcessorCount); fflush(stdout);
    while (now() - t0 < secs) {
      for (int i = 0; i < 4; i++) spin<<<blocks, 256>>>(200 * per_us);
      cudaDeviceSynchronize(); n += 4;
    }
    printf("LOAD DONE kernels=%d err=%s\n", n, cudaGetErrorString(cudaGetLastError())); return 0;
  }
  int n = atoi(argv[2]); std::vector<double> lat;  // probe: one 20 us block per SM, timed launch to finish
  for (int i = 0; i < n + 20; i++) {
    double t0 = now(); spin<<<p.multiProcessorCount, 128>>>(20 * per_us); cudaDeviceSynchronize();
    if (i >= 20) lat.push_back((now() - t0) * 1e6);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::sort(lat.begin(), lat.end());
  printf("PROBE n=%d p50_us=%.1f p90_us=%.1f p99_us=%.1f max_us=%.1f err=%s\n", n, lat[n / 2], lat[n * 9 / 10],
         lat[n * 99 / 100], lat[n - 1], cudaGetErrorString(cudaGetLastError()));
  return 0;
}
"""
N_PROBE = 400
FULL: dict = {}  # the whole GPU's SM count as CUDA reports it, from the first policy case


@pytest.fixture(scope="module")
def prio(runtime, rootfs, tmp_path_factory):  # noqa: F811
    build_cuda(rootfs, PRIO, "prio", tmp_path_factory.mktemp("prio"))
    run_cli("share", "disable")
    yield runtime
    run_cli("share", "disable")


def _enable(*args: str) -> dict:
    run_cli("share", "disable")
    r = run_cli("share", "enable", "--gpus", "0", "--keep-compute-mode", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _probe(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("PROBE"))
    head = line.split(" err=")[0]  # CUDA's error string has spaces ("no error")
    return {k: float(v) for k, v in (w.split("=") for w in head.split()[1:])}


def _cfg(rootfs, args, *env):  # noqa: F811
    return make_config(str(rootfs), args, ["NVIDIA_VISIBLE_DEVICES=0", *env])


def test_the_driver_names_the_client_priority():
    """The knob exists in this driver's libcuda; the versions are recorded to name the first one that has it."""
    lib = subprocess.run(["sh", "-c", "ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}'"],
                         capture_output=True, text=True).stdout.strip()
    found = subprocess.run(["sh", "-c", f"strings -a {lib} | grep -c CUDA_MPS_CLIENT_PRIORITY"],
                           capture_output=True, text=True).stdout.strip()
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    versions = next((ln for ln in smi.splitlines() if "Driver Version" in ln), "")
    _record("priority_knob", {"libcuda": lib, "mentions": found, "versions": versions.strip(" |")})
    assert lib and int(found or 0) >= 1, (lib, found)


def _beside(prio, rootfs, tmp_path, load_env: tuple[str, ...] | None, name: str) -> dict:  # noqa: F811
    """The high-priority probe, alone (load_env None) or beside a load container started with `load_env`."""
    load = None
    if load_env is not None:
        load = start(prio, write_bundle(tmp_path / f"{name}-load", _cfg(rootfs, ["/prio", "load", "12"], *load_env)),
                     tmp_path / f"{name}-load.out")
        assert load[1], load[2]
        for _ in range(100):  # until its kernels run
            if "LOAD START" in (tmp_path / f"{name}-load.out").read_text(errors="replace"):
                break
            time.sleep(0.1)
        time.sleep(1)
    rc, out = lifecycle(prio, write_bundle(tmp_path / f"{name}-probe",
                                           _cfg(rootfs, ["/prio", "probe", str(N_PROBE)], "ALIYUN_COM_GPU_HIGH_PRIO=1")))
    load_out = finish(prio, load[0], load[1], tmp_path / f"{name}-load.out") if load else ""
    assert rc == 0 and "PROBE" in out, out
    return {**_probe(out), "load": load_out.strip()}


def test_high_priority_goes_ahead_of_a_normal_containers_load(prio, rootfs, tmp_path):  # noqa: F811
    _enable("--policy", "preemptive")
    res = {"alone": _beside(prio, rootfs, tmp_path, None, "alone"),
           "beside_equal": _beside(prio, rootfs, tmp_path, ("ALIYUN_COM_GPU_HIGH_PRIO=1",), "equal"),
           "beside_below_normal": _beside(prio, rootfs, tmp_path, (), "below")}
    res["ratio_p50_equal_over_below"] = res["beside_equal"]["p50_us"] / res["beside_below_normal"]["p50_us"]
    res["ratio_p99_equal_over_below"] = res["beside_equal"]["p99_us"] / res["beside_below_normal"]["p99_us"]
    res["ratio_p50_below_over_alone"] = res["beside_below_normal"]["p50_us"] / res["alone"]["p50_us"]
    _record("share_priority_latency", res)
    assert res["beside_below_normal"]["p50_us"] < res["beside_equal"]["p50_us"], res


@pytest.mark.parametrize("args,env,expect_sms_fraction", [
    (("--policy", "native"), (), 1.0),
    (("--policy", "preemptive"), (), 1.0),
    (("--policy", "weight-preemptive", "--max-clients", "4"), ("ALIYUN_COM_GPU_SCHD_WEIGHT=2",), 0.5),
    (("--policy", "fixed", "--max-clients", "4"), (), 0.25),
    (("--policy", "fixed", "--max-clients", "4"), ("ALIYUN_COM_GPU_HIGH_PRIO=1",), 1.0),
    (("--policy", "fixed", "--max-clients", "4"), ("ALIYUN_COM_GPU_SCHD_WEIGHT=3",), 0.75),
    (("--default-compute", "25",), ("ALIYUN_COM_GPU_HIGH_PRIO=1",), 0.25),  # the daemon's default: everyone's ceiling
])
def test_each_policy_as_cuda_sees_it(prio, rootfs, tmp_path, args, env, expect_sms_fraction):  # noqa: F811
    """The SM count and memory CUDA reports in a container under each policy's mapping (and a 4 GiB cap)."""
    _enable(*args)
    # under a daemon default no client sees the whole GPU: the count from the cases before (the same module run)
    full = _full_props(prio, rootfs, tmp_path) if "--default-compute" not in args else FULL
    FULL.update(full)
    rc, out = lifecycle(prio, write_bundle(tmp_path / "c", _cfg(rootfs, ["sh", "-c", "env | grep ^CUDA_MPS_ | sort;"
                                                                         " /prio props"],
                                                                *env, "GPUPROV_GPU_MEMORY=4G")))
    _record(f"share_policy_{'_'.join(args)}_{'_'.join(env) or 'none'}", {"full": full, "out": out})
    sms = int(out.split("SMS ")[1].split()[0])
    assert rc == 0 and abs(sms - full["sms_without_mps"] * expect_sms_fraction) <= 2, (full, out)


def _full_props(prio, rootfs, tmp_path) -> dict:  # noqa: F811
    """The GPU's whole SM count as CUDA reports it (nvidia-smi does not show it): a client with
    GPUPROV_GPU_COMPUTE=100 under the same daemon."""
    cfg = _cfg(rootfs, ["/prio", "props"], "GPUPROV_GPU_COMPUTE=100")
    rc, out = lifecycle(prio, write_bundle(tmp_path / "full", cfg))
    assert rc == 0 and "SMS" in out, out
    return {"sms_without_mps": int(out.split("SMS ")[1].split()[0]), "out": out.strip()}

"""On a real NVIDIA host, through a real dockerd (marked `gpu`; skipped elsewhere): what an operator types.

gpuprov-runtime is docker's default runtime (`gpuprov engine configure docker --default --cdi`) and the CDI spec is
in /etc/cdi and /var/run/cdi (`gpuprov cdi refresh`). tests/gpu/device_caps.sh sets that up on a bare GPU host
(dockerd 26 from Debian trixie: bookworm's 20.10 has no CDI) and imports the images named below.
Results also go to $GPUPROV_GPU_OUT (JSON) for the issue notes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
TINY = os.environ.get("CAPS_IMAGE_TINY", "caps-tiny")  # busybox + glibc (Debian 12)
GFX = os.environ.get("CAPS_IMAGE_GFX", "caps-gfx")  # + Debian's EGL/GLES/Vulkan loaders, the probes, the sample
CUDA = os.environ.get("CAPS_IMAGE_CUDA", "caps-cuda")  # + an nvcc-built CUDA program


def _docker_ok() -> bool:
    if not (os.path.exists("/proc/driver/nvidia/version") and shutil.which("docker")):
        return False
    return subprocess.run(["docker", "image", "inspect", TINY], capture_output=True).returncode == 0


if not _docker_ok():
    pytest.skip("no NVIDIA GPU host with dockerd and the test images here (tests/gpu/device_caps.sh sets them up)",
                allow_module_level=True)

RESULTS: dict = {}


def _record(key, value):
    RESULTS[key] = value
    out = os.environ.get("GPUPROV_GPU_OUT")
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=2))


def docker_run(*args: str, image: str = TINY, cmd: tuple[str, ...] = ("nvidia-smi", "-L")) -> tuple[int, str]:
    r = subprocess.run(["docker", "run", "--rm", "--network", "none", *args, image, *cmd], capture_output=True,
                       text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def host_gpus() -> list[tuple[str, str]]:
    r = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                       text=True, check=True)
    gpus = [tuple(x.strip() for x in line.split(",")) for line in r.stdout.strip().splitlines()]
    _record("host_gpus", gpus)
    return gpus


def _uuids(text: str) -> list[str]:
    return [w.rstrip(")") for w in text.split() if w.startswith("GPU-")]


def test_gpus_all(host_gpus):
    rc, out = docker_run("--gpus", "all")
    _record("gpus_all", out)
    assert rc == 0 and _uuids(out) == [u for _, u in host_gpus], out


def test_gpus_device_index_and_uuid(host_gpus):
    idx, uuid = host_gpus[-1]  # the last GPU: on a two-GPU host, not the one a default would pick
    rc, out = docker_run("--gpus", f"device={idx}")
    rc2, out2 = docker_run("--gpus", f"device={uuid}")
    _record("gpus_device", {"index": out, "uuid": out2})
    assert rc == 0 and _uuids(out) == [uuid], out
    assert rc2 == 0 and _uuids(out2) == [uuid], out2


def test_visible_devices_env_default_runtime(host_gpus):
    idx, uuid = host_gpus[-1]
    rc, out = docker_run("-e", f"NVIDIA_VISIBLE_DEVICES={idx}")
    rc_all, out_all = docker_run("-e", "NVIDIA_VISIBLE_DEVICES=all")
    rc_void, out_void = docker_run(cmd=("sh", "-c", "ls /dev; cat /proc/mounts"))
    _record("env_visible_devices", {"one": out, "all": out_all})
    assert rc == 0 and _uuids(out) == [uuid], out
    assert rc_all == 0 and len(_uuids(out_all)) == len(host_gpus)
    assert rc_void == 0 and "nvidia" not in out_void  # no request, nothing injected


def test_cuda_program(host_gpus):
    rc, out = docker_run("--gpus", f"device={host_gpus[-1][0]}", image=CUDA, cmd=("/vadd",))
    _record("cuda_vadd", out)
    assert rc == 0 and "VADD OK n=1048576 c[n-1]=3145725" in out, out


def test_unmet_cuda_requirement_refused():
    rc, out = docker_run("--gpus", "all", "-e", "NVIDIA_REQUIRE_CUDA=cuda>=99.0")
    _record("require_refused", {"rc": rc, "out": out})
    assert rc != 0 and "NVIDIA_REQUIRE_CUDA" in out, out


def test_cdi_device_names(host_gpus):
    idx, uuid = host_gpus[-1]
    rc, out = docker_run("--device", f"nvidia.com/gpu={idx}", "--runtime", "runc")
    rc_all, out_all = docker_run("--device", "nvidia.com/gpu=all", "--runtime", "runc")
    _record("cdi_docker", {"one": out, "all": out_all})
    assert rc == 0 and _uuids(out) == [uuid], out
    assert rc_all == 0 and _uuids(out_all) == [u for _, u in host_gpus], out_all


def test_compute_only_mounts_nothing_else():
    rc, out = docker_run("--gpus", "all", cmd=("cat", "/proc/mounts"))
    assert rc == 0 and "libcuda.so.1" in out
    for unasked in ("libEGL_nvidia", "libGLX_nvidia", "nvidia_icd.json", "10_nvidia.json", "libnvcuvid",
                    "libnvidia-encode", "gsp_"):
        assert unasked not in out, unasked


def test_egl_and_vulkan_headless_with_graphics():
    rc, out = docker_run("--gpus", "all", "-e", "NVIDIA_DRIVER_CAPABILITIES=graphics", image=GFX,
                         cmd=("/probes/gfx_probe", "egl"))
    rc_vk, out_vk = docker_run("--gpus", "all", "-e", "NVIDIA_DRIVER_CAPABILITIES=graphics", image=GFX,
                               cmd=("/probes/gfx_probe", "vulkan"))
    if rc_vk != 0:  # say why: the loader's own account of which manifests and libraries it tried
        out_vk += docker_run("--gpus", "all", "-e", "NVIDIA_DRIVER_CAPABILITIES=graphics", "-e",
                             "VK_LOADER_DEBUG=error,warn,driver", image=GFX, cmd=("/probes/gfx_probe", "vulkan"))[1]
    _record("egl_graphics", out)
    _record("vulkan_graphics", out_vk)
    assert rc == 0 and "EGL_VENDOR=NVIDIA" in out and "GL_RENDERER=NVIDIA" in out, out
    assert rc_vk == 0 and "vendor 0x10de" in out_vk, out_vk


def test_egl_fails_cleanly_without_graphics():
    rc, out = docker_run("--gpus", "all", image=GFX, cmd=("/probes/gfx_probe", "egl"))
    rc_vk, out_vk = docker_run("--gpus", "all", image=GFX, cmd=("/probes/gfx_probe", "vulkan"))
    _record("egl_without_graphics", {"rc": rc, "out": out, "vulkan_rc": rc_vk, "vulkan": out_vk})
    assert rc == 3 and "no EGL device" in out, out
    assert rc_vk == 3, out_vk


def test_egl_through_cdi():
    rc, out = docker_run("--device", "nvidia.com/gpu=0", "--runtime", "runc", image=GFX,
                         cmd=("/probes/gfx_probe", "egl"))
    _record("egl_cdi", out)
    assert rc == 0 and "GL_RENDERER=NVIDIA" in out, out


def test_nvdec_decode_with_video():
    rc, out = docker_run("--gpus", "all", "-e", "NVIDIA_DRIVER_CAPABILITIES=video", image=GFX,
                         cmd=("/probes/nvdec_probe", "/probes/gray320x240.h264"))
    _record("nvdec_video", out)
    assert rc == 0 and "decoded 10 frames 320x240" in out, out
    mean = float(out.split("mean luma ")[1].split(",")[0])
    assert abs(mean - 128) <= 3, out  # the sample is a flat grey (Y=128, as ffmpeg decodes it on the CPU)


def test_nvdec_refused_cleanly_without_video():
    rc, out = docker_run("--gpus", "all", image=GFX, cmd=("/probes/nvdec_probe", "/probes/gray320x240.h264"))
    _record("nvdec_without_video", {"rc": rc, "out": out})
    assert rc == 3 and "libnvcuvid.so.1 not found" in out, out


def test_gpuprov_verify():
    from tests.conftest import run_cli

    r = run_cli("verify")
    _record("verify", {"rc": r.returncode, "out": r.stdout + r.stderr})
    assert r.returncode == 0, r.stdout + r.stderr


def test_cdi_spec_vs_nvidia_ctk():
    """Every device node and container path in NVIDIA's spec is in ours, or the difference has a reason."""
    import yaml

    from tests.cdi_check import validate
    from tests.gpu.cdi_compare import compare

    ours = yaml.safe_load(Path("/var/run/cdi/nvidia.yaml").read_text())
    validate(ours)
    ctk_path = os.environ.get("CAPS_NVIDIA_CTK_SPEC")
    if not ctk_path or not Path(ctk_path).exists():
        pytest.fail("nvidia-ctk's spec was not generated (CAPS_NVIDIA_CTK_SPEC)")
    theirs = yaml.safe_load(Path(ctk_path).read_text())
    report = compare(theirs, ours)
    _record("cdi_compare", report)
    assert report["unexplained"] == [], report["unexplained"]
    assert report["device_names_missing"] == [], report["device_names_missing"]

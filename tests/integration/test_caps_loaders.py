"""Graphics and video capabilities in real containers (runc) with Debian's real EGL (glvnd) and Vulkan loaders,
against the fake driver root built from the H200 capture: the loaders inside the container find NVIDIA's manifests
where gpuprov mounted them and try NVIDIA's libraries at their SONAME; without the capability they find nothing.
(The libraries are tiny fakes here, so nothing renders: tests/gpu/test_gpu_docker.py renders on a real GPU.)"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from provision.inject.modify import modify_bundle
from tests.conftest import needs
from tests.inject_helpers import settings
from tests.oci import lifecycle, make_config, write_bundle

pytestmark = [pytest.mark.integration, needs("runc", "gcc", docker=True)]
IMAGE = "gpuprov-test/caps-loaders:1"  # minbase + libegl1 libvulkan1 (Debian 12's loaders; libegl1 brings Mesa's EGL)
PROBE = Path(__file__).resolve().parents[1] / "gpu/probes/gfx_probe.c"


@pytest.fixture(scope="module")
def base_rootfs(tmp_path_factory) -> Path:
    from tests.integration.hosts import committed_image, ensure_image, export_rootfs

    committed_image(IMAGE, ensure_image(), "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                    "libegl1 libvulkan1 >/dev/null")
    root = tmp_path_factory.mktemp("loaders") / "rootfs"
    root.mkdir()
    export_rootfs(IMAGE, root)
    subprocess.run(["gcc", "-O2", "-o", str(root / "gfx_probe"), str(PROBE), "-ldl"], check=True)
    return root


@pytest.fixture
def rootfs(base_rootfs, tmp_path) -> Path:
    """A fresh copy per test: runc leaves empty mountpoint files (an empty nvidia_icd.json…) in a rootfs."""
    root = tmp_path / "rootfs"
    subprocess.run(["cp", "-a", str(base_rootfs), str(root)], check=True)
    return root


def _run(tmp_path: Path, rootfs: Path, caps: str | None, what: str) -> str:
    env = ["NVIDIA_VISIBLE_DEVICES=0", "LD_DEBUG=files", "VK_LOADER_DEBUG=driver"]
    if caps:
        env.append(f"NVIDIA_DRIVER_CAPABILITIES={caps}")
    args = ["cat", "/proc/mounts"] if what == "mounts" else ["/gfx_probe", what]
    bundle = write_bundle(tmp_path / f"b-{what}-{caps}", make_config(str(rootfs), args, env))
    assert modify_bundle(str(bundle), settings(tmp_path))
    rc, out = lifecycle("runc", bundle)
    assert rc == 0, out
    return out


def test_egl_loader_finds_nvidia_vendor_with_graphics(tmp_path, rootfs):
    out = _run(tmp_path, rootfs, "graphics", "egl")
    # glvnd read 10_nvidia.json from /usr/share/glvnd/egl_vendor.d and dlopen'ed the library it names
    assert "file=libEGL_nvidia.so.0 [0];  dynamically loaded by" in out, out[-3000:]
    mounts = _run(tmp_path, rootfs, "graphics", "mounts")
    for path in ("/usr/lib/x86_64-linux-gnu/libEGL_nvidia.so.0", "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
                 "/usr/lib/x86_64-linux-gnu/libnvidia-eglcore.so.580.159.04"):
        assert f" {path} " in mounts, path


def test_vulkan_loader_finds_nvidia_icd_with_graphics(tmp_path, rootfs):
    out = _run(tmp_path, rootfs, "graphics", "vulkan")
    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" in out, out[-3000:]
    assert "libGLX_nvidia.so.0" in out


@pytest.mark.parametrize("caps", [None, "utility,compute", "video"])
def test_loaders_find_nothing_without_graphics(tmp_path, rootfs, caps):
    egl = _run(tmp_path, rootfs, caps, "egl")
    vk = _run(tmp_path, rootfs, caps, "vulkan")
    assert "libEGL_nvidia" not in egl and "EGL_VENDOR=NVIDIA" not in egl, egl[-2000:]  # (Mesa's may answer)
    assert "nvidia_icd.json" not in vk and "vkCreateInstance failed" in vk, vk[-2000:]
    mounts = _run(tmp_path, rootfs, caps, "mounts")
    assert "libEGL_nvidia" not in mounts and "/usr/share/vulkan" not in mounts and "/usr/share/glvnd" not in mounts
    assert ("libnvcuvid.so.1" in mounts) is (caps == "video")  # video: NVDEC/NVENC and CUDA, nothing of graphics

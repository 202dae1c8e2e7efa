"""The host's driver libraries win over an image's own copies (issue 26 item 5; nvidia-container-toolkit#176/#289),
in a real container through runc: the image (Debian minbase, exported from the test image) carries its own
libcuda.so.1 in /opt/vendor/lib, registered in its /etc/ld.so.cache by its own ldconfig; both that copy and the
host's libcuda are real ELF libraries built here with gcc, each saying whose it is. A probe in the container
dlopen()s libcuda.so.1 as CUDA programs do: glibc takes the file its cache names, so without gpuprov's override
the image's copy is loaded (main before this change), with it the host's."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from provision.inject import ldcache
from provision.inject.modify import modify_bundle
from tests.conftest import H200, needs
from tests.inject_helpers import settings
from tests.oci import lifecycle, make_config, write_bundle

pytestmark = [pytest.mark.integration, needs("runc", "gcc", docker=True)]
LIB = 'const char *gpuprov_whose(void) { return "%s"; }\n'
PROBE = r"""#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    const char *(*whose)(void) = (const char *(*)(void))dlsym(h, "gpuprov_whose");
    printf("libcuda.so.1 is the %s's\n", whose ? whose() : "unknown");
    return 0;
}
"""


def _so(tmp: Path, whose: str) -> Path:
    src = tmp / f"{whose}.c"
    src.write_text(LIB % whose)
    out = tmp / f"libcuda-{whose}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """The image's rootfs: its own libcuda.so.1 in /opt/vendor/lib, in its ld.so.cache (its own ldconfig)."""
    from tests.integration.hosts import ensure_image, export_rootfs

    tmp = tmp_path_factory.mktemp("ldcache")
    root = tmp / "rootfs"
    root.mkdir()
    export_rootfs(ensure_image(), root)
    (root / "opt/vendor/lib").mkdir(parents=True)
    shutil.copy(_so(tmp, "image"), root / "opt/vendor/lib/libcuda.so.1")
    (root / "etc/ld.so.conf.d/00-vendor.conf").write_text("/opt/vendor/lib\n")
    subprocess.run(["chroot", str(root), "ldconfig"], check=True)
    (tmp / "probe.c").write_text(PROBE)
    subprocess.run(["gcc", "-O2", "-o", str(root / "ldprobe"), str(tmp / "probe.c"), "-ldl"], check=True)
    return root


@pytest.fixture(scope="module")
def driver_root(tmp_path_factory) -> Path:
    """The H200 capture's driver root, with a real ELF libcuda of the loaded version (saying it is the host's)."""
    tmp = tmp_path_factory.mktemp("drv")
    root = tmp / "nvidia"
    shutil.copytree(H200 / "usr/local/nvidia", root, symlinks=True)
    shutil.copy(_so(tmp, "host"), root / "lib64/libcuda.so.580.159.04")
    return root


def _run(tmp_path: Path, rootfs: Path, driver_root: Path, gpuprov: bool) -> tuple[str, dict]:
    import json

    bundle = write_bundle(tmp_path / f"b-{gpuprov}", make_config(str(rootfs), ["/ldprobe"], [
        "NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]))
    if gpuprov:
        assert modify_bundle(str(bundle), settings(tmp_path, driver_root=str(driver_root)))
    rc, out = lifecycle("runc", bundle)
    assert rc == 0, out
    return out, json.loads((bundle / "config.json").read_text())


def test_image_cache_names_its_own_libcuda(image):
    """The control: the image's loader would take /opt/vendor/lib/libcuda.so.1 (its cache says so)."""
    got = ldcache.driver_entries(str(image))
    assert got == [("libcuda.so.1", "/opt/vendor/lib/libcuda.so.1")]


def test_host_libcuda_wins_over_the_images_copy(tmp_path, image, driver_root):
    out, _ = _run(tmp_path, image, driver_root, gpuprov=False)
    assert "libcuda.so.1 is the image's" in out, out  # what a runtime that only mounts at the SONAME gets
    out, cfg = _run(tmp_path, image, driver_root, gpuprov=True)
    assert "libcuda.so.1 is the host's" in out, out
    over = [m for m in cfg["mounts"] if m["destination"] == "/opt/vendor/lib/libcuda.so.1"]
    assert over and over[0]["source"] == str(driver_root / "lib64/libcuda.so.580.159.04") and "ro" in over[0]["options"]


def test_cache_entry_through_a_link_stays_inside_the_image(tmp_path, image, driver_root):
    """An image whose cached path goes through a link to a host path: the mount lands inside the rootfs, resolved
    there (scoped_resolve), never at the host path."""
    root = tmp_path / "rootfs"
    subprocess.run(["cp", "-a", str(image), str(root)], check=True)
    (root / "opt/vendor/lib/libcuda.so.1").unlink()
    (root / "opt/vendor/lib/libcuda.so.1").symlink_to("/etc/hostname-of-host")  # absolute: read inside the image
    (root / "etc/hostname-of-host").write_bytes((image / "opt/vendor/lib/libcuda.so.1").read_bytes())
    out, cfg = _run(tmp_path, root, driver_root, gpuprov=True)
    assert "libcuda.so.1 is the host's" in out, out
    assert any(m["destination"] == "/etc/hostname-of-host" for m in cfg["mounts"])

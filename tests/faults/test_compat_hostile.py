"""Issue 38 items 1 and 2, through real runc: the image (and its volumes) is hostile.

1. runc resolves a mount's *source* again when it mounts it, in the container's mount namespace, after the engine's
   /proc and volumes are in place. gpuprov once handed runc the image's compat libcuda by its path inside the rootfs,
   so a link there (planted in a volume, or through the image's own /usr/local/cuda/compat -> /proc/self/root/…)
   made runc mount a root-only host file as the container's libcuda.so.1. Now runc gets gpuprov's own copy (named
   by its sha256, in a root-only directory beside the discovery cache), read inside the rootfs (inroot.py).
2. A mount destination under a volume made runc create the mount point in the volume's host directory (the image's
   ld.so.cache naming /data/libcuda.so.1 with a volume at /data): such a target is skipped, with a warning.

On main before this change (488315c's modify.py and compat.py), the volume, /proc/self/root and swapped-link cases
read the host's secret and the volume under /data got runc's empty file; the `..` case was already clamped (kept as
a control), and the first test shows an honest compat library is still used. The driver is the fake
H200 root built from the real capture (580.159.04, one data-centre GPU); runc keeps its state under tmp."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess

import pytest

from provision.inject import compat
from provision.inject.modify import modify_bundle
from tests import oci
from tests.conftest import needs
from tests.inject_helpers import runc_image, settings

pytestmark = [needs("runc", "gcc", "ldconfig"),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, mknod)")]
VERSION = "590.44.01"  # newer than the fake host's 580: compat applies
SECRET = "HOST SECRET: root-only bytes of the host"


@pytest.fixture
def rig(tmp_path):
    s = settings(tmp_path)
    rootfs, runc = runc_image(tmp_path)
    host = tmp_path / "hostdir"  # a host directory the container must never read
    host.mkdir(mode=0o700)
    (host / f"libcuda.so.{VERSION}").write_text(SECRET + "\n")
    os.chmod(host / f"libcuda.so.{VERSION}", 0o600)
    return tmp_path, s, rootfs, runc, host


def decoy(path) -> None:
    """A real ELF shared object (the compat rules read its notes) whose bytes say what it is."""
    from tests.unit.test_compat import build_lib

    path.parent.mkdir(parents=True, exist_ok=True)
    build_lib(path)


def libdir(rootfs) -> str:
    return "/usr/lib/x86_64-linux-gnu" if (rootfs / "etc/debian_version").exists() else "/usr/lib64"


def run(rig, name: str, mounts: list[dict] = (), between=None) -> tuple[str, dict, list[str]]:
    """modify (what gpuprov-runtime does before runc), then `between` (what changes before runc runs), then the
    container's `cat` of its libcuda.so.1 through real runc: (its output, the edited config, the warnings)."""
    base, s, rootfs, runc, _ = rig
    cfg = oci.make_config(str(rootfs), ["cat", f"{libdir(rootfs)}/libcuda.so.1"], ["NVIDIA_VISIBLE_DEVICES=0"])
    cfg["mounts"] += list(mounts)
    bundle = oci.write_bundle(base / f"bundle-{name}", cfg)
    warnings: list[str] = []
    modify_bundle(str(bundle), s, warnings.append)
    if between:
        between()
    rc, out = oci.lifecycle(str(runc), bundle)
    assert rc == 0, out
    return out, json.loads((bundle / "config.json").read_text()), warnings


def source_of(cfg: dict, dest: str) -> str:
    return next(m["source"] for m in cfg["mounts"] if m["destination"] == dest)


def test_honest_compat_library_is_used_from_gpuprovs_copy(rig):
    base, s, rootfs, _, _ = rig
    decoy(rootfs / f"usr/local/cuda/compat/libcuda.so.{VERSION}")
    out, cfg, warnings = run(rig, "honest")
    assert "compat libcuda" in out and SECRET not in out, out
    src = source_of(cfg, f"{libdir(rootfs)}/libcuda.so.1")
    store = compat.store_dir(s.cache)
    assert src.startswith(store + "/") and not src.startswith(str(rootfs)), src  # never a path in the image
    assert open(src, "rb").read() == (rootfs / f"usr/local/cuda/compat/libcuda.so.{VERSION}").read_bytes()
    assert oct(os.stat(store).st_mode & 0o777) == "0o700" and not warnings
    out2, cfg2, _ = run(rig, "honest-again")  # a second container of the image shares the copy
    assert source_of(cfg2, f"{libdir(rootfs)}/libcuda.so.1") == src and len(os.listdir(store)) == 1


def test_volume_holding_a_link_never_reaches_a_host_file(rig):
    """A volume (an emptyDir that outlived a restart) at /usr/local/cuda/compat holding a link to a host file; the
    image's own compat directory has an honest-looking library so the rules say yes."""
    base, _, rootfs, _, host = rig
    decoy(rootfs / f"usr/local/cuda/compat/libcuda.so.{VERSION}")
    vol = base / "volume"
    vol.mkdir()
    os.symlink(str(host / f"libcuda.so.{VERSION}"), vol / f"libcuda.so.{VERSION}")
    out, _, _ = run(rig, "volume", [{"destination": "/usr/local/cuda/compat", "source": str(vol), "type": "bind",
                                     "options": ["rbind", "rw"]}])
    assert SECRET not in out, out
    assert "compat libcuda" in out, out  # the image's own file, as read when the container was created


def test_compat_dir_through_proc_self_root_stays_in_the_image(rig):
    """The image alone: /usr/local/cuda/compat -> /proc/self/root/<host dir>, and a decoy at that path in the
    layer (so a check inside the rootfs passes). runc mounts /proc first; the source then led to the host's file."""
    _, _, rootfs, _, host = rig
    os.makedirs(rootfs / "usr/local/cuda")
    os.symlink(f"/proc/self/root{host}", rootfs / "usr/local/cuda/compat")
    decoy(rootfs / "proc/self/root" / str(host).lstrip("/") / f"libcuda.so.{VERSION}")
    out, _, _ = run(rig, "proc-self-root")
    assert SECRET not in out, out


def test_dotdot_in_the_compat_dir_is_clamped_to_the_image(rig):
    _, _, rootfs, _, host = rig
    os.makedirs(rootfs / "usr/local/cuda")
    os.symlink("../../../../../../../../" + str(host).lstrip("/"), rootfs / "usr/local/cuda/compat")
    decoy(rootfs / str(host).lstrip("/") / f"libcuda.so.{VERSION}")  # where `..` stops: the image's root
    out, _, _ = run(rig, "dotdot")
    assert SECRET not in out and "compat libcuda" in out, out


def test_link_swapped_after_the_check_is_never_followed(rig):
    """Checked as a regular file, then swapped for a link to the host's file before runc runs: runc mounts the copy
    made at the check."""
    _, _, rootfs, _, host = rig
    lib = rootfs / f"usr/local/cuda/compat/libcuda.so.{VERSION}"
    decoy(lib)

    def swap():
        lib.unlink()
        os.symlink(str(host / f"libcuda.so.{VERSION}"), lib)

    out, _, _ = run(rig, "swapped", between=swap)
    assert SECRET not in out and "compat libcuda" in out, out


def test_unusable_store_gives_the_hosts_libraries_with_a_warning(rig):
    """Where no private copy can be kept (its directory writable by others), the container still starts, with the
    host driver's libcuda and one warning: an image can never make a start fail this way."""
    base, s, rootfs, _, _ = rig
    decoy(rootfs / f"usr/local/cuda/compat/libcuda.so.{VERSION}")
    store = compat.store_dir(s.cache)
    os.makedirs(store)
    os.chmod(store, 0o777)
    out, cfg, warnings = run(rig, "no-store")
    assert "fake libcuda.so.580.159.04" in out and "compat libcuda" not in out, out
    assert len(warnings) == 1 and "compat libraries are not used" in warnings[0], warnings
    assert os.listdir(store) == []


def test_ldcache_target_under_a_volume_is_not_created_in_it(rig):
    """Item 2: the image's ld.so.cache names /data/libcuda.so.1 (its own copy), and a volume is mounted at /data.
    The override would ask runc to mount there; runc created a root-owned empty libcuda.so.1 in the host's volume
    directory. It is skipped, with a warning; the library directory still gets the host's libcuda."""
    base, _, rootfs, _, _ = rig
    decoy(rootfs / "data/libcuda.so.1")
    (rootfs / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (rootfs / "etc/ld.so.conf").write_text("/data\n")
    subprocess.run(["ldconfig", "-r", str(rootfs), "-C", "/etc/ld.so.cache", "-f", "/etc/ld.so.conf"], check=True,
                   capture_output=True)
    vol = base / "data-volume"
    vol.mkdir()
    out, cfg, warnings = run(rig, "ldcache-volume", [{"destination": "/data", "source": str(vol), "type": "bind",
                                                      "options": ["rbind", "rw"]}])
    assert os.listdir(vol) == [], os.listdir(vol)
    assert not any(m["destination"] == "/data/libcuda.so.1" for m in cfg["mounts"])
    assert any("/data/libcuda.so.1 is not mounted" in w for w in warnings), warnings
    assert "fake libcuda.so.580.159.04" in out, out


def opens_of(path) -> int:
    """An inotify watch for opens of `path` (a device node's inode too); read it with opened()."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, str(path).encode(), 0x20) >= 0  # IN_OPEN
    return fd


def opened(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_device_nodes_the_image_plants_are_never_opened(rig):
    """Opening some devices acts (a watchdog arms on open). An image's character device at /etc/ld.so.cache or at
    its compat libcuda's name is never opened: only a regular file is (inroot checks the kind on an O_PATH fd
    first). On main, the ld.so.cache reader opened it (O_NONBLOCK, then fstat). /dev/null's numbers stand in."""
    base, s, rootfs, _, _ = rig
    cache, lib = rootfs / "etc/ld.so.cache", rootfs / f"usr/local/cuda/compat/libcuda.so.{VERSION}"
    lib.parent.mkdir(parents=True)
    for node in (cache, lib):
        if node.exists():
            node.unlink()
        os.mknod(node, 0o644 | 0o020000, os.makedev(1, 3))
    watches = [opens_of(cache), opens_of(lib)]
    seen = []
    out, _, _ = run(rig, "device-nodes", between=lambda: seen.extend(opened(w) for w in watches))  # before the
    assert seen == [False, False]  # container runs: its own loader opens /etc/ld.so.cache
    assert "fake libcuda.so.580.159.04" in out, out

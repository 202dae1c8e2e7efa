"""Issue 26's field failures on the runtime's start path, on copies of the H200 host capture (real /proc text, real
mknod nodes, a real modprobe program run as the kernel names it): hosts that are not warm (nvidia-uvm never loaded,
its node never made), a discovery cache from another boot, a userspace that does not match the loaded module, and
the smaller items (NVIDIA_DISABLE_REQUIRE as Go parses it, the driver's brand, images that search neither
/usr/lib64 nor Debian's directory). Each test failed on main before this change (see the commit)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import cdi, discover, edits, modify, nodes
from tests.conftest import H200
from tests.inject_helpers import driver_root_with_smi, gpu_bundle, settings

COMPUTE = ["NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


def host_copy(base: Path, uvm: bool = True) -> Path:
    """The capture's /proc and /sys, copied so that a test can change what is loaded (uvm=False: Debian's boot, where
    only nvidia is loaded and nvidia-uvm waits for nvidia-modprobe)."""
    root = base / "host"
    if not root.exists():
        shutil.copytree(H200 / "proc", root / "proc", symlinks=True)
        shutil.copytree(H200 / "sys", root / "sys", symlinks=True)
    if not uvm:
        _drop_uvm(root)
    return root


def _drop_uvm(root: Path) -> None:
    for name, needle in (("devices", "nvidia-uvm"), ("modules", "nvidia_uvm")):
        p = root / "proc" / name
        p.write_text("".join(line for line in p.read_text().splitlines(True) if needle not in line))


def fake_modprobe(base: Path, root: Path, body: str | None = None) -> Path:
    """A modprobe program named by the copy's proc/sys/kernel/modprobe (as the kernel names its own): by default
    it does what the kernel does on `modprobe nvidia-uvm`, listing the module and its major in the copy's /proc."""
    exe = base / "modprobe"
    body = body or (f'[ "$1" = nvidia-uvm ] || exit 1\n'
                    f'echo "nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)" >> {root}/proc/modules\n'
                    f'sed -i "s/^195 nvidiactl$/195 nvidiactl\\n238 nvidia-uvm/" {root}/proc/devices\n')
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    (root / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/modprobe").write_text(f"{exe}\n")
    return exe


def dev_with(base: Path, names: dict[str, tuple[int, int]]) -> Path:
    dev = base / "dev-partial"
    (dev / "dev").mkdir(parents=True, exist_ok=True)
    for name, (ma, mi) in names.items():
        os.mknod(dev / "dev" / name, 0o666 | stat.S_IFCHR, os.makedev(ma, mi))
    return dev


def start(tmp_path: Path, env: list[str], **over) -> dict:
    """One container create through the modifiers; returns the edited config."""
    b = gpu_bundle(tmp_path, f"b{len(list(tmp_path.glob('b*')))}", env)
    assert modify.modify_bundle(str(b), settings(tmp_path, **over))
    return json.loads((b / "config.json").read_text())


def devices(cfg: dict) -> set[str]:
    return {d["path"] for d in cfg["linux"]["devices"]}


# --- item 2: modules and nodes, as nvidia-modprobe makes them ---

def test_missing_uvm_node_is_made_on_start_when_module_loaded(tmp_path):
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0)})  # nvidia-uvm loaded, node never made
    cfg = start(tmp_path, COMPUTE, dev_root=str(dev), proc_root=str(host_copy(tmp_path)))
    assert {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= devices(cfg)
    st = os.lstat(dev / "dev/nvidia-uvm")
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (238, 0)
    assert stat.S_IMODE(st.st_mode) == 0o666 and (st.st_uid, st.st_gid) == (0, 0)  # nvidia-modprobe's for uvm
    assert os.minor(os.lstat(dev / "dev/nvidia-uvm-tools").st_rdev) == 1


def test_compute_start_loads_uvm_first(tmp_path):
    root = host_copy(tmp_path, uvm=False)
    fake_modprobe(tmp_path, root)
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0)})
    cache = tmp_path / "discovery.json"
    cfg = start(tmp_path, COMPUTE, dev_root=str(dev), proc_root=str(root), cache=str(cache))
    assert "/dev/nvidia-uvm" in devices(cfg)
    assert "238 nvidia-uvm" in (root / "proc/devices").read_text()  # modprobe ran
    assert "nvidia-uvm" in cache.read_text()  # the cache was rebuilt after the load, not kept


def test_compute_start_without_uvm_is_refused_naming_the_module(tmp_path):
    root = host_copy(tmp_path, uvm=False)  # no modprobe the kernel names: nothing can load it
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0)})
    with pytest.raises(Refused, match="nvidia-uvm kernel module is not loaded") as exc:
        start(tmp_path, COMPUTE, dev_root=str(dev), proc_root=str(root))
    assert "\n" not in str(exc.value)
    assert not (dev / "dev/nvidia-uvm").exists()  # never a node for a module that is not loaded


def test_utility_only_start_needs_no_uvm(tmp_path):
    root = host_copy(tmp_path, uvm=False)
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0)})
    cfg = start(tmp_path, ["NVIDIA_DRIVER_CAPABILITIES=utility"], dev_root=str(dev), proc_root=str(root))
    assert "/dev/nvidia0" in devices(cfg) and "/dev/nvidia-uvm" not in devices(cfg)


@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
def test_hanging_modprobe_never_hangs_a_start(tmp_path, monkeypatch):
    root = host_copy(tmp_path, uvm=False)
    fake_modprobe(tmp_path, root, "exec sleep 60\n")
    monkeypatch.setattr(nodes, "START_MODPROBE_TIMEOUT_S", 1.0)
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0)})
    t0 = time.monotonic()
    with pytest.raises(Refused, match="did not finish within 1 s"):
        start(tmp_path, COMPUTE, dev_root=str(dev), proc_root=str(root))
    assert time.monotonic() - t0 < 10


def test_nodes_follow_the_modules_parameters_and_replace_nothing(tmp_path):
    root = host_copy(tmp_path)
    params = root / "proc/driver/nvidia/params"
    params.write_text(params.read_text().replace("DeviceFileGID: 0", "DeviceFileGID: 44")
                      .replace("DeviceFileMode: 438", "DeviceFileMode: 432"))  # 0660, group video
    dev = tmp_path / "dev-empty"
    (dev / "dev").mkdir(parents=True)
    (dev / "dev/nvidia-uvm-tools").write_text("planted")  # a path that exists is never replaced
    made = nodes.make_nodes(str(dev), str(root))
    assert made == ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]
    st = os.lstat(dev / "dev/nvidia0")
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 44 and st.st_rdev == os.makedev(195, 0)
    assert stat.S_IMODE(os.lstat(dev / "dev/nvidia-uvm").st_mode) == 0o666  # uvm: nvidia-modprobe's defaults
    assert (dev / "dev/nvidia-uvm-tools").read_text() == "planted"
    params.write_text(params.read_text().replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0"))
    shutil.rmtree(dev / "dev")
    (dev / "dev").mkdir()
    assert nodes.make_nodes(str(dev), str(root)) == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]  # not nvidia's


def test_no_nodes_and_no_modprobe_without_the_driver(tmp_path):
    root = host_copy(tmp_path, uvm=False)
    (root / "proc/driver/nvidia/version").unlink()
    fake_modprobe(tmp_path, root, f"touch {tmp_path}/ran\n")
    dev = tmp_path / "d"
    (dev / "dev").mkdir(parents=True)
    assert nodes.prepare_host(str(root), str(dev)) == []
    assert not (tmp_path / "ran").exists() and not list((dev / "dev").iterdir())


def test_cdi_spec_always_lists_uvm_for_gpus(tmp_path):
    root = host_copy(tmp_path, uvm=False)
    disc = discover.discover(str(H200 / "usr/local/nvidia"), proc_root=str(root), dev_root=str(tmp_path))
    paths = [n["path"] for n in cdi.generate_spec(disc)["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia-uvm" in paths and "/dev/nvidia-uvm-tools" in paths


def test_cdi_refresh_loads_uvm_and_makes_its_nodes_first(tmp_path):
    root = host_copy(tmp_path, uvm=False)
    fake_modprobe(tmp_path, root)
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0)})
    out = tmp_path / "cdi"
    cdi.refresh_specs(str(H200 / "usr/local/nvidia"), dirs=(str(out),), proc_root=str(root), dev_root=str(dev),
                      gen_dir=str(tmp_path / "gen"))
    spec = json.loads(json.dumps(__import__("yaml").safe_load((out / cdi.SPEC_NAME).read_text())))
    uvm = [n for n in spec["containerEdits"]["deviceNodes"] if n["path"] == "/dev/nvidia-uvm"]
    assert uvm and uvm[0]["major"] == 238
    assert os.lstat(dev / "dev/nvidia-uvm").st_rdev == os.makedev(238, 0)


# --- item 3: the discovery cache follows the host ---

@pytest.mark.parametrize("change", ["uvm loads", "major moves", "reboot"])
def test_cache_from_other_host_conditions_is_rebuilt(tmp_path, change):
    root = host_copy(tmp_path, uvm=change != "uvm loads")
    (root / "proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/random/boot_id").write_text("0f6c1d2e-0000-4000-8000-000000000001\n")
    cache = tmp_path / "cache.json"
    disc = discover.refresh(str(H200 / "usr/local/nvidia"), str(cache), str(root), str(tmp_path))
    assert discover.load_cached(str(cache), str(root)) == disc
    devices_file = root / "proc/devices"
    if change == "uvm loads":
        assert disc.nodes.uvm is None
        devices_file.write_text(devices_file.read_text().replace("195 nvidiactl\n", "195 nvidiactl\n238 nvidia-uvm\n"))
        (root / "proc/modules").write_text("nvidia_uvm 1 - - Live 0x0 (O)\n" + (root / "proc/modules").read_text())
    elif change == "major moves":
        devices_file.write_text(devices_file.read_text().replace("238 nvidia-uvm", "237 nvidia-uvm"))
    else:
        (root / "proc/sys/kernel/random/boot_id").write_text("0f6c1d2e-0000-4000-8000-000000000002\n")
    assert discover.load_cached(str(cache), str(root)) is None  # never trusted
    fresh = modify.load_discovery(settings(tmp_path, proc_root=str(root), cache=str(cache)))
    if change != "reboot":
        assert fresh.nodes.uvm.major == (237 if change == "major moves" else 238)


# --- item 4: mismatches are named ---

def test_userspace_not_matching_the_module_is_refused_in_one_line(tmp_path):
    root = host_copy(tmp_path)
    v = root / "proc/driver/nvidia/version"
    v.write_text(v.read_text().replace("580.159.04", "580.172.08"))  # the module of an upgrade, before the reboot
    with pytest.raises(Refused) as exc:
        start(tmp_path, COMPUTE, proc_root=str(root))
    msg = str(exc.value)
    assert "580.172.08" in msg and "580.159.04" in msg and "reboot" in msg and "\n" not in msg
    from provision.verify.checks import coherent_result

    assert coherent_result(True, "580.172.08", "580.159.04").detail == msg  # verify says the same


def test_compute_never_starts_without_libcuda(tmp_path):
    drv = tmp_path / "drv"
    shutil.copytree(H200 / "usr/local/nvidia", drv, symlinks=True)
    for p in drv.glob("lib64/libcuda.so*"):
        p.unlink()
    with pytest.raises(Refused, match="no libcuda.so.580.159.04"):
        start(tmp_path, COMPUTE, driver_root=str(drv))


# --- item 7: the smaller field items ---

@pytest.mark.parametrize("value,skips", [("1", True), ("t", True), ("T", True), ("TRUE", True), ("true", True),
                                         ("True", True), ("0", False), ("f", False), ("false", False),
                                         ("yes", False), ("tRuE", False), (" true", False)])
def test_disable_require_is_go_parsebool(value, skips):
    disc = discover.discover(str(H200 / "usr/local/nvidia"), proc_root=str(H200), dev_root=str(H200))
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0", "NVIDIA_DISABLE_REQUIRE": value}
    if skips:
        assert edits.compute_edits(disc, env) is not None
    else:
        with pytest.raises(Refused, match="not satisfied"):
            edits.compute_edits(disc, env)


def test_brand_comes_from_the_driver_not_the_model(tmp_path):
    disc = discover.discover(str(driver_root_with_smi(tmp_path)), proc_root=str(H200), dev_root=str(H200), arch=True)
    assert [g.brand for g in disc.gpus] == ["nvidia"]  # nvidia-smi (NVML) says NVIDIA for the H200
    tesla_named = discover.replace(disc, gpus=tuple(discover.replace(g, model="Tesla H200") for g in disc.gpus))
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_BRAND": "brand=tesla"}
    with pytest.raises(Refused, match="brand nvidia"):
        edits.compute_edits(tesla_named, env)
    two = ('<gpu id="00000000:3B:00.0">\n<product_name>Quadro RTX 8000</product_name>\n'
           '<product_brand>Quadro RTX</product_brand>\n</gpu>\n<gpu id="00000000:5E:00.0">\n'
           '<product_brand>NVIDIA Virtual PC</product_brand>\n</gpu>\n<gpu id="00000000:86:00.0">\n'
           '<product_brand>N/A</product_brand>\n</gpu>\n')
    assert discover.parse_brands(two) == {"0000:3b:00.0": "quadrortx", "0000:5e:00.0": "nvidiavpc"}


@pytest.mark.parametrize("layout,want", [
    ({"etc/alpine-release": "3.20.0\n", "lib/ld-musl-x86_64.so.1": ""}, "/usr/lib"),  # musl: /lib:/usr/local/lib:/usr/lib
    ({"usr/lib/libc.so.6": ""}, "/usr/lib"),  # a glibc image with one library directory
    ({"usr/lib64/libc.so.6": ""}, "/usr/lib64"),  # the RHEL family
    ({"etc/debian_version": "12.0\n"}, "/usr/lib/x86_64-linux-gnu"),
])
def test_images_get_libraries_where_their_loader_looks(tmp_path, layout, want):
    b = gpu_bundle(tmp_path, "img")
    (b / "rootfs/etc/debian_version").unlink()
    for rel, text in layout.items():
        (b / "rootfs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (b / "rootfs" / rel).write_text(text)
    assert modify.modify_bundle(str(b), settings(tmp_path))
    dests = {m["destination"] for m in json.loads((b / "config.json").read_text())["mounts"]}
    assert f"{want}/libcuda.so.1" in dests


# --- item 5's reader against what an image could plant at /etc/ld.so.cache ---

@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
def test_hostile_image_caches_are_skipped_not_trusted(tmp_path):
    from provision.inject import ldcache

    head = ldcache.MAGIC + (1000).to_bytes(4, "little") + bytes(24)  # claims 1000 entries, has none
    assert ldcache.entries(head) == [] and ldcache.entries(b"garbage") == []
    entry = (0x0303).to_bytes(4, "little") + (1 << 30).to_bytes(4, "little") * 2 + bytes(12)  # offsets past the end
    assert ldcache.entries(ldcache.MAGIC + (1).to_bytes(4, "little") + bytes(24) + entry) == []
    fifo = tmp_path / "img/etc/ld.so.cache"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)  # never opened (inroot opens regular files only), never read
    t0 = time.monotonic()
    assert ldcache.driver_entries(str(tmp_path / "img")) == [] and time.monotonic() - t0 < 2
    b = gpu_bundle(tmp_path, "fifo-cache")
    os.mkfifo(b / "rootfs/etc/ld.so.cache")
    assert modify.modify_bundle(str(b), settings(tmp_path))


def test_every_driver_library_has_a_cache_marker():
    """ldcache.driver_entries skips a cache without these substrings: no driver SONAME may lack all of them."""
    from provision.inject import ldcache
    from provision.inject.capabilities import LIBRARIES

    assert all(any(m.decode() in lib for m in ldcache.MARKERS) for libs in LIBRARIES.values() for lib in libs)


def test_display_start_loads_modeset_and_makes_its_node(tmp_path):
    root = host_copy(tmp_path)
    fake_modprobe(tmp_path, root, f'[ "$1" = nvidia-modeset ] || exit 1\n'
                                  f'echo "nvidia_modeset 1 - - Live 0x0 (O)" >> {root}/proc/modules\n')
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0),
                              "nvidia-uvm-tools": (238, 1)})
    cfg = start(tmp_path, ["NVIDIA_DRIVER_CAPABILITIES=display"], dev_root=str(dev), proc_root=str(root))
    assert "/dev/nvidia-modeset" in devices(cfg)
    assert os.lstat(dev / "dev/nvidia-modeset").st_rdev == os.makedev(195, 254)


def test_a_modeset_that_cannot_load_is_not_retried_by_every_display_start(tmp_path, monkeypatch):
    """Where nvidia-modeset cannot load (a container host without its module), each display start says so, but only
    the first in MODESET_RETRY_S runs modprobe (a process per start: issue 41's `all` capabilities)."""
    root = host_copy(tmp_path)
    ran = tmp_path / "modprobe-ran"
    fake_modprobe(tmp_path, root, f'echo "$1" >> {ran}\nexit 1\n')
    dev = dev_with(tmp_path, {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0),
                              "nvidia-uvm-tools": (238, 1)})
    warned: list[str] = []

    def display_start() -> dict:
        b = gpu_bundle(tmp_path, f"b{len(list(tmp_path.glob('b*')))}", ["NVIDIA_DRIVER_CAPABILITIES=display"])
        assert modify.modify_bundle(str(b), settings(tmp_path, dev_root=str(dev), proc_root=str(root)), warned.append)
        return json.loads((b / "config.json").read_text())

    assert all("/dev/nvidia-modeset" not in devices(display_start()) for _ in range(3))
    assert ran.read_text().split() == ["nvidia-modeset"]
    assert len(warned) == 3 and len(set(warned)) == 1 and "nvidia-modeset not loaded (`modprobe" in warned[0]
    monkeypatch.setattr(modify, "MODESET_RETRY_S", 0.0)  # past the window: tried again
    display_start()
    assert ran.read_text().split() == ["nvidia-modeset"] * 2


def test_every_node_made_gets_its_dev_char_link(tmp_path):
    """The call point into devchar's helper (nodes.link_dev_char): a node gpuprov makes is linked at once, so the next
    `systemctl daemon-reload` cannot take it from a running container."""
    dev = tmp_path / "d"
    (dev / "dev").mkdir(parents=True)
    made = nodes.make_nodes(str(dev), str(host_copy(tmp_path)))
    assert made == ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    for path in made:
        st = os.lstat(dev / path.lstrip("/"))
        link = dev / "dev/char" / f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        assert os.readlink(link) == "../" + path.removeprefix("/dev/")


def test_debian_driver_layout_is_found(tmp_path):
    """Debian's packaged driver (libcuda1, libnvidia-ml1 … as `dpkg -c` lists them) keeps its versioned libraries in
    usr/lib/x86_64-linux-gnu/nvidia/current/, others (libnvidia-ptxjitcompiler1) beside the system's: a compute
    container on such a host gets libcuda and NVML from there (before: refused, no libcuda found)."""
    drv = tmp_path / "debian-root"
    cur = drv / "usr/lib/x86_64-linux-gnu/nvidia/current"
    cur.mkdir(parents=True)
    src = H200 / "usr/local/nvidia/lib64"
    for name, where in (("libcuda", cur), ("libnvidia-ml", cur), ("libnvidia-ptxjitcompiler", cur.parent.parent)):
        shutil.copy(src / f"{name}.so.580.159.04", where / f"{name}.so.580.159.04")
        os.symlink(f"{name}.so.580.159.04", where / f"{name}.so.1")
    from provision.facts.driver_facts import userspace_version

    assert userspace_version(drv) == "580.159.04"
    cfg = start(tmp_path, COMPUTE, driver_root=str(drv))
    mounted = {m["source"] for m in cfg["mounts"]}
    assert str(cur / "libcuda.so.580.159.04") in mounted and str(cur / "libnvidia-ml.so.580.159.04") in mounted
    assert str(cur.parent.parent / "libnvidia-ptxjitcompiler.so.580.159.04") in mounted

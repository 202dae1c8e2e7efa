"""Real containers through real runc: on a MIG host (tests/fixtures/hosts/h100-mig, caps nodes made with mknod), the
runtime's edits (modify_bundle, what gpuprov-runtime runs before handing the bundle to runc) give `0:9:0` exactly the
parent GPU's node, nvidiactl, the uvm nodes and its instance's two nvidia-caps nodes, and runc creates exactly those
in the container; an image with CUDA forward-compatibility libraries gets its compat libcuda exactly when newer.
Both fail on main (the MIG selector was refused; the host's libcuda always mounted). runc keeps its state under tmp
(--root); nothing on this machine is touched."""
from __future__ import annotations

import json

import pytest

from provision.errors import Refused
from provision.inject.modify import modify_bundle
from tests import oci
from tests.conftest import needs
from tests.inject_helpers import fake_dev, mig_caps_nodes, mig_proc, runc_image, settings

pytestmark = [needs("runc", "ldd")]


@pytest.fixture
def rig(tmp_path):
    dev = fake_dev(tmp_path)
    mig_caps_nodes(dev)
    (tmp_path / "proc-root").mkdir()
    s = settings(tmp_path, proc_root=mig_proc(tmp_path / "proc-root"))
    rootfs, runc = runc_image(tmp_path)
    return tmp_path, s, rootfs, runc


def run(rig, visible: str) -> tuple[dict, str]:
    base, s, rootfs, runc = rig
    cfg = oci.make_config(str(rootfs), ["sh", "-c", "echo devs: $(ls /dev); echo caps: $(ls /dev/nvidia-caps); "
                                        "echo NVD=$NVIDIA_VISIBLE_DEVICES"], [f"NVIDIA_VISIBLE_DEVICES={visible}"])
    bundle = oci.write_bundle(base / f"bundle-{visible.replace(':', '-')}", cfg)
    modify_bundle(str(bundle), s)
    rc, out = oci.lifecycle(str(runc), bundle)
    assert rc == 0, out
    return json.loads((bundle / "config.json").read_text()), out


@pytest.mark.parametrize("visible,caps", [("0:9:0", ["nvidia-cap84", "nvidia-cap85"]),
                                          ("0:2:0,0:3:0", ["nvidia-cap21", "nvidia-cap22", "nvidia-cap30",
                                                           "nvidia-cap31"])])
def test_runc_container_gets_exactly_its_instances_nodes(rig, visible, caps):
    cfg, out = run(rig, visible)
    gpu_nodes = [d["path"] for d in cfg["linux"]["devices"]]
    assert gpu_nodes == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0",
                         *(f"/dev/nvidia-caps/{c}" for c in caps)]
    seen = {ln.split(":", 1)[0]: ln.split(":", 1)[1].split() for ln in out.splitlines() if ": " in ln}
    assert seen["caps"] == caps, out  # runc made exactly these in the container
    assert {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} <= set(seen["devs"]), out
    assert f"NVD={visible}" in out


def test_runc_masks_the_other_instances_proc_entries(rig):
    """The maskedPaths gpuprov writes for `0:9:0`, applied by real runc. This machine has no /proc/driver/nvidia
    (runc skips a masked path that does not exist), so the container gets the fixture's MIG /proc tree at /procfix
    and the same paths under it: gi9's access files stay readable, every other instance's directory and mig/config,
    mig/monitor read empty (main: all readable)."""
    base, s, rootfs, runc = rig
    cfg = oci.make_config(str(rootfs), ["true"], ["NVIDIA_VISIBLE_DEVICES=0:9:0"])
    bundle = oci.write_bundle(base / "bundle-mask", cfg)
    modify_bundle(str(bundle), s)
    cfg = json.loads((bundle / "config.json").read_text())
    ours = [p for p in cfg["linux"]["maskedPaths"] if p.startswith("/proc/driver/nvidia/")]
    assert len(ours) == 5 and "/proc/kcore" in cfg["linux"]["maskedPaths"]  # added to runc's own, none lost
    caps = "/procfix/driver/nvidia/capabilities"
    cfg["linux"]["maskedPaths"] += [p.replace("/proc/", "/procfix/", 1) for p in ours]
    cfg["mounts"].append({"destination": "/procfix", "source": str(base / "proc-root/proc"), "type": "bind",
                          "options": ["rbind", "ro"]})
    (rootfs / "procfix").mkdir()
    cfg["process"]["args"] = ["sh", "-c", f"for d in 2 3 9 10; do echo gi$d: $(ls {caps}/gpu0/mig/gi$d); done; "
                              f"cat {caps}/gpu0/mig/gi9/ci0/access; echo config: $(cat {caps}/mig/config)."]
    (bundle / "config.json").write_text(json.dumps(cfg))
    rc, out = oci.lifecycle(str(runc), bundle)
    assert rc == 0, out
    seen = {ln.split(":", 1)[0]: ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("gi")}
    assert seen == {"gi2": [], "gi3": [], "gi9": ["access", "ci0"], "gi10": []}, out
    assert "DeviceFileMinor: 85" in out and "config: ." in out, out


def test_missing_instance_never_reaches_runc(rig):
    base, s, rootfs, _ = rig
    cfg = oci.make_config(str(rootfs), ["true"], ["NVIDIA_VISIBLE_DEVICES=0:4:0"])
    bundle = oci.write_bundle(base / "bundle-missing", cfg)
    with pytest.raises(Refused, match=r"MIG device '0:4:0', which does not exist; this host has: 0:2:0; 0:3:0"):
        modify_bundle(str(bundle), s)


@needs("gcc")
@pytest.mark.parametrize("version,compat", [("590.44.01", True), ("575.57.08", False)])
def test_runc_container_gets_the_compat_libcuda_exactly_when_newer(rig, version, compat):
    """Issue 30 item 4 through real runc: an image with a stand-in compat libcuda (a real ELF built here) newer than
    the host's 580 gets it at libcuda.so.1, an older one gets the host's; no hook, no ldconfig in the container."""
    from tests.unit.test_compat import build_lib

    base, s, rootfs, runc = rig
    d = rootfs / "usr/local/cuda/compat"
    d.mkdir(parents=True)
    build_lib(d / f"libcuda.so.{version}")
    libdir = "/usr/lib/x86_64-linux-gnu" if (rootfs / "etc/debian_version").exists() else "/usr/lib64"
    cfg = oci.make_config(str(rootfs), ["cat", f"{libdir}/libcuda.so.1"], ["NVIDIA_VISIBLE_DEVICES=0"])
    bundle = oci.write_bundle(base / f"bundle-compat-{version}", cfg)
    modify_bundle(str(bundle), s)
    rc, out = oci.lifecycle(str(runc), bundle)
    assert rc == 0, out
    assert ("compat libcuda" in out) == compat and ("fake libcuda.so.580.159.04" in out) != compat, out
    assert not any(h.get("path") for h in json.loads((bundle / "config.json").read_text()).get("hooks", {}).get(
        "prestart", []))

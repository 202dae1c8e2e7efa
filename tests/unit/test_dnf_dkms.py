"""NVIDIA's DKMS packages on dnf: the driver step has DKMS build for every kernel it chose and proves it per kernel
(`dkms status -k K`), as apt's DriverInstall does. The kmod-nvidia-*-dkms scriptlet builds for the running kernel
only, and kernel-devel installed after its kernel triggers no build: before, the step installed each kernel's
kernel-devel and ran no build, so the kernel that boots next kept no module and every re-run said done.
With real dnf, rpm and a stand-in dkms: tests/integration/test_el_cuda.py (stage 6, the kernel update).
"""
from __future__ import annotations

from pathlib import Path

from provision.package_managers.dnf import Dnf
from provision.plan.build import Options, build_plan
from provision.report import detect_host
from tests.conftest import make_host

H100 = "10de:2330"
RUNNING, NEWER = "5.14.0-503.14.1.el9_5.x86_64", "5.14.0-503.40.1.el9_5.x86_64"
LOCKS = "etc/dnf/plugins/versionlock.list"  # under the host root


def _step(steps, sid: str):
    return next(s for s in steps if s.id == sid)


def test_nvidias_dkms_driver_is_built_and_checked_for_every_kernel(tmp_path):
    root = make_host(tmp_path, "rocky-9", "none", kernel=RUNNING)
    (root / f"lib/modules/{NEWER}/kernel").mkdir(parents=True)
    (root / f"boot/vmlinuz-{NEWER}").write_text("")
    opt = Options(for_gpus=(H100,), driver_source="nvidia", engine="none")
    step = _step(build_plan(detect_host(root, engines=False, for_gpus=(H100,), source="nvidia"), opt), "driver.packages")
    lines = step.lines()
    install = max(i for i, ln in enumerate(lines) if ln.startswith("$ dnf module install -y"))
    assert lines[install + 1:install + 5] == [f"$ dkms autoinstall -k {RUNNING}", f"$ dkms autoinstall -k {NEWER}",
                                              f"$ dkms status -k {RUNNING}", f"$ dkms status -k {NEWER}"], lines
    assert "an nvidia module is installed for" in step.check.describe()
    # ELRepo's kmods are prebuilt (kABI-tracking): no DKMS there
    elrepo = _step(build_plan(detect_host(root, engines=False, for_gpus=(H100,)),
                              Options(for_gpus=(H100,), engine="none")), "driver.packages")
    assert not any("dkms" in ln for ln in elrepo.lines()), elrepo.lines()


def _loaded(tmp_path: Path, locked: bool, boot_module: bool) -> Path:
    """A Rocky 9 H100 node running RUNNING with NVIDIA's 570 open module loaded; a kernel update installed NEWER,
    which boots next (the newest /boot/vmlinuz), with or without its nvidia module; gpuprov's versionlock on the
    driver (its hold step's) or none (an operator's driver)."""
    root = make_host(tmp_path, "rocky-9", "datacenter", kernel=RUNNING, modules="nvidia 1 0 - Live 0x0\n",
                     nvrm="NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build\n")
    lib = root / "usr/lib64"
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "libnvidia-ml.so.570.133.20").write_text("")
    (root / f"lib/modules/{NEWER}/kernel").mkdir(parents=True)
    (root / f"boot/vmlinuz-{NEWER}").write_text("")
    for k in (RUNNING, NEWER) if boot_module else (RUNNING,):
        (root / f"lib/modules/{k}/extra").mkdir(parents=True)
        (root / f"lib/modules/{k}/extra/nvidia.ko.xz").write_text("")
    if locked:
        (root / LOCKS).parent.mkdir(parents=True, exist_ok=True)
        (root / LOCKS).write_text("nvidia-driver-3:570.133.20-1.el9.*\nkmod-nvidia-open-dkms-3:570.133.20-1.el9.*\n")
    return root


def test_a_locked_driver_follows_a_kernel_that_boots_without_its_module(tmp_path, monkeypatch):
    """A running node's loaded driver is left alone while the kernel that boots next has its module; after a kernel
    update without one, bootstrap has DKMS build for it, but only for the driver gpuprov locked (an operator's
    driver stays alone: `gpuprov verify` names the kernel). Before, dnf hosts always said 'left alone'."""
    # rpm's database answers the installed version (the versionlock list itself is read from the root)
    monkeypatch.setattr(Dnf, "rpm_versions", lambda self, root, names: {n: "570.133.20" for n in names})
    opt = Options(engine="none", driver_source="nvidia")

    def first_driver_step(root: Path):
        return next(s for s in build_plan(detect_host(root, engines=False, source="nvidia"), opt) if s.id.startswith("driver."))

    assert first_driver_step(_loaded(tmp_path / "a", True, True)).id == "driver.present"
    assert first_driver_step(_loaded(tmp_path / "b", False, False)).id == "driver.present"
    steps = build_plan(detect_host(_loaded(tmp_path / "c", True, False), engines=False, source="nvidia"), opt)
    assert f"$ dkms autoinstall -k {NEWER}" in _step(steps, "driver.packages").lines()


def test_dkms_status_installed_with_its_warning_is_installed():
    """DKMS 2.x/3.x print "installed (WARNING! Diff between built and installed module!)" where the installed file
    differs from its build (signed after it): before, that read as a failed build (dnf: a false exit 16; apt: the
    working driver rolled back)."""
    from provision.plan.dkms import dkms_installed

    warned = f"nvidia/570.133.20, {RUNNING}, x86_64: installed (WARNING! Diff between built and installed module!)"
    assert dkms_installed(warned, RUNNING) and dkms_installed(f"nvidia, 570.133.20, {RUNNING}, x86_64: installed",
                                                              RUNNING)
    assert not dkms_installed(f"nvidia/570.133.20, {RUNNING}, x86_64: built", RUNNING)
    assert not dkms_installed("nvidia/570.133.20: added", RUNNING)
    assert not dkms_installed(f"nvidia/570.133.20, {NEWER}, x86_64: installed", RUNNING)


def test_elrepo_installs_the_build_for_the_boot_kernels_minor_release(tmp_path, monkeypatch):
    """ELRepo builds a kmod per minor release's kernels (570.172.08-1.el9_6.elrepo requires 9.6's kernel). Before,
    dnf took the newest build whatever the kernel: a newer kernel in the driver's transaction, or a failed install
    (best=True) where none was offered. Now the build of the boot kernel's minor release, asked for by a version glob,
    offered first (exit 4 before any change), its module proven after. The kmod gpuprov locked moves to the boot
    kernel's build when that kernel has no module, past the lock for that one transaction (the lock list untouched:
    a failed or killed run leaves it as it was)."""
    from provision.plan.kmods import elrepo_build, minor_release

    assert minor_release("5.14.0-570.12.1.el9_6.x86_64") == "el9_6" and minor_release("3.10.0-1160.el7.x86_64") == "el7"
    assert minor_release("6.1.119-129.201.amzn2023.x86_64") is None
    assert elrepo_build("kmod-nvidia-open", NEWER) == "kmod-nvidia-open-[0-9]*-*.el9_5*.elrepo.*"
    assert elrepo_build("nvidia-x11-drv", NEWER) == "nvidia-x11-drv"
    root = make_host(tmp_path, "rocky-9", "none", kernel=RUNNING)
    step = _step(build_plan(detect_host(root, engines=False, for_gpus=(H100,)),
                            Options(for_gpus=(H100,), engine="none")), "driver.packages")
    lines = [ln for ln in step.lines() if ln.startswith("$ ")]
    spec = "'kmod-nvidia-open-[0-9]*-*.el9_5*.elrepo.*'"
    assert lines == [f"$ dnf --disableplugin=versionlock -q list --showduplicates {spec}",
                     f"$ dnf install --assumeno {spec}", f"$ dnf install -y {spec}"], lines
    # gpuprov's lock, a 9.6 kernel booting next without a module: the kmod moves, past the lock
    monkeypatch.setattr(Dnf, "rpm_versions", lambda self, root, names: {n: "570.144" for n in names})
    k96 = "5.14.0-570.12.1.el9_6.x86_64"
    (root / f"lib/modules/{k96}/kernel").mkdir(parents=True)
    (root / f"boot/vmlinuz-{k96}").write_text("")
    (root / LOCKS).parent.mkdir(parents=True, exist_ok=True)
    (root / LOCKS).write_text("kmod-nvidia-open-0:570.144-1.el9_5.elrepo.*\nnvidia-x11-drv-0:570.144-1.el9_5.elrepo.*\n")
    step = _step(build_plan(detect_host(root, engines=False, for_gpus=(H100,)),
                            Options(for_gpus=(H100,), engine="none")), "driver.packages")
    spec = "'kmod-nvidia-open-[0-9]*-*.el9_6*.elrepo.*'"
    assert step.title.startswith(f"Move ELRepo's kmod to its build for kernel {k96}"), step.title
    assert [ln for ln in step.lines() if ln.startswith("$ ")][1:] == [
        f"$ dnf --disableplugin=versionlock upgrade --assumeno {spec}",
        f"$ dnf --disableplugin=versionlock upgrade -y {spec}"], step.lines()
    assert not any("versionlock delete" in ln for ln in step.lines())

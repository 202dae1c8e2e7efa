"""The module follows the kernel (issue 18 items 4 and 5), decided and planned from fixture trees:
- which kernel boots next (GRUB's default through grubenv, /vmlinuz, the newest) and whether it has an NVIDIA module;
- `gpuprov verify`'s next-boot check: names the kernel and the fix;
- the headers metapackage of each installed kernel metapackage (Debian's and Ubuntu's names);
- Ubuntu's precompiled signed modules where the lists offer them for every kernel (Ubuntu's archive cannot be
  reached here: the lists are fixture data in the archive's format);
- a change of driver branch: the old held series unheld and removed in the install's transaction, every installed
  kernel built, the new series held.
The real apt/DKMS side of all of it: tests/integration/test_driver_install.py."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from provision import effects
from provision.decide.kernel import (
    branch_replacement,
    headers_metapackages,
    kernel_metapackages,
    ubuntu_precompiled,
)
from provision.facts.boot import next_boot_kernel, nvidia_module, parse_grub_menu, read_next_boot, resolve_entry
from provision.facts.packages import InstalledPackage, archive_depends, closure, dpkg_installed, offered_module_packages
from provision.package_managers import apt as apt_pm
from provision.plan import dkms
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.plan.steps import packages_installed
from provision.report import detect_host
from provision.verify.checks import NodeHost, next_boot_module
from tests.conftest import dpkg_status, make_host

BOOT = Path(__file__).resolve().parents[1] / "fixtures/boot"
U = "6d2c1a9e-5b1e-4b8e-9d1a-3f5d2e7c8a10"
OLD, NEW = "6.1.0-27-amd64", "6.1.0-28-amd64"


def _kernels(root: Path, *rels: str, link: str | None = None) -> Path:
    for k in rels:
        (root / f"lib/modules/{k}/kernel").mkdir(parents=True, exist_ok=True)
        (root / "boot").mkdir(exist_ok=True)
        (root / f"boot/vmlinuz-{k}").write_text("")
    if link:
        os.symlink(f"boot/vmlinuz-{link}", root / "vmlinuz")
    return root


def _grub(root: Path, cfg: str, env: str = "") -> None:
    (root / "boot/grub").mkdir(parents=True, exist_ok=True)
    shutil.copy(BOOT / cfg, root / "boot/grub/grub.cfg")
    (root / "boot/grub/grubenv").write_text("# GRUB Environment Block\n" + env + "#" * 900)


def _module(root: Path, k: str, rel: str = "updates/dkms/nvidia-current-open.ko", dep: bool = True) -> None:
    (root / f"lib/modules/{k}" / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / f"lib/modules/{k}" / rel).write_bytes(b"\x7fELF")
    if dep:
        with open(root / f"lib/modules/{k}/modules.dep", "a") as f:
            f.write(f"kernel/drivers/net/e1000/e1000.ko:\n{rel}: kernel/drivers/video/fbdev/core/fb.ko\n")


# ---------------------------------------------------------------- the kernel that boots next


def test_grub_menu_of_a_real_grub_cfg():
    menu = parse_grub_menu((BOOT / "ubuntu-grub.cfg").read_text())
    assert [e.title for e in menu] == ["Ubuntu", "Advanced options for Ubuntu", "System setup"]
    assert menu[0].kernel == "4.8.0-36-generic" and menu[1].submenu and menu[2].kernel is None
    assert [e.kernel for e in menu[1].children] == ["4.8.0-36-generic"] * 2
    assert resolve_entry(menu, "0").kernel == "4.8.0-36-generic"


@pytest.mark.parametrize("env, kernel, source", [
    ("", NEW, "saved_entry"),  # nothing saved: entry 0, the simple entry on the newest kernel
    (f"saved_entry=gnulinux-advanced-{U}>gnulinux-{OLD}-advanced-{U}\n", OLD, "saved_entry"),  # ids, into a submenu
    ("saved_entry=1>2\n", OLD, "saved_entry"),  # indices
    (f"saved_entry=Advanced options for Debian GNU/Linux>Debian GNU/Linux, with Linux {OLD}\n", OLD, "saved_entry"),
    (f"saved_entry=1>2\nnext_entry=gnulinux-simple-{U}\n", NEW, "next_entry"),  # a one-time boot wins
])
def test_grub_default_through_grubenv(tmp_path, env, kernel, source):
    root = _kernels(tmp_path, OLD, NEW, link=NEW)
    _grub(root, "debian-grub.cfg", env)
    k, how = next_boot_kernel(root)
    assert (k, source in how) == (kernel, True), how


def test_grub_wins_over_vmlinuz_and_vmlinuz_over_newest(tmp_path):
    root = _kernels(tmp_path, OLD, NEW, link=OLD)
    assert next_boot_kernel(root) == (OLD, "/vmlinuz")
    _grub(root, "debian-grub.cfg", "saved_entry=0\n")
    assert next_boot_kernel(root)[0] == NEW
    os.unlink(root / "vmlinuz")
    (root / "boot/grub/grub.cfg").unlink()
    assert next_boot_kernel(root) == (NEW, "the newest installed kernel")
    _grub(root, "debian-grub.cfg", "saved_entry=gone-entry\n")  # a default GRUB cannot resolve: the fallback
    assert next_boot_kernel(root) == (NEW, "the newest installed kernel")


def test_module_by_modules_dep_and_its_file(tmp_path):
    root = _kernels(tmp_path, OLD)
    (root / f"lib/modules/{OLD}/modules.dep").write_text("kernel/drivers/net/e1000/e1000.ko:\n")
    assert nvidia_module(root, OLD) is None
    _module(root, OLD, "updates/dkms/nvidia-current-uvm.ko")  # a helper module alone is no driver
    assert nvidia_module(root, OLD) is None
    # nor are the kernel's own modules that share the prefix: every Debian kernel has these (a real 6.1.0-56 with
    # no NVIDIA driver built was called served by nvidia-wmi-ec-backlight.ko)
    bare = _kernels(tmp_path / "bare", OLD)  # the same without modules.dep (the directory walk)
    for own in ("kernel/drivers/platform/x86/nvidia-wmi-ec-backlight.ko",
                "kernel/drivers/video/fbdev/nvidia/nvidiafb.ko", "kernel/nvidia-wmi/nvidia-wmi-ec-backlight.ko"):
        _module(root, OLD, own)
        _module(bare, OLD, own, dep=False)
    assert nvidia_module(root, OLD) is None and nvidia_module(bare, OLD) is None
    _module(root, OLD)
    assert nvidia_module(root, OLD) == f"/lib/modules/{OLD}/updates/dkms/nvidia-current-open.ko"
    (root / f"lib/modules/{OLD}/updates/dkms/nvidia-current-open.ko").unlink()  # removed by hand, depmod not run
    assert nvidia_module(root, OLD) is None


@pytest.mark.parametrize("rel", ["kernel/nvidia-535srv/nvidia.ko", "kernel/drivers/video/nvidia.ko",
                                 "updates/dkms/nvidia-tesla-470.ko"])
def test_module_without_modules_dep(tmp_path, rel):
    """Ubuntu's precompiled package, the .run installer, a DKMS build: found where they install to."""
    root = _kernels(tmp_path, OLD)
    _module(root, OLD, rel, dep=False)
    assert nvidia_module(root, OLD) == f"/lib/modules/{OLD}/{rel}"


def test_detect_reports_the_next_boot(tmp_path):
    root = _kernels(make_host(tmp_path, "debian-12", "datacenter", kernel=OLD), NEW, link=NEW)
    nb = read_next_boot(root)
    assert (nb.kernel, nb.source, nb.module) == (NEW, "/vmlinuz", None)
    d = detect_host(root, engines=False).to_dict()["driver"]
    assert (d["next_boot_kernel"], d["next_boot_from"], d["next_boot_module"]) == (NEW, "/vmlinuz", None)


# ---------------------------------------------------------------- verify's check


class FactsHost(NodeHost):
    def __init__(self, facts):
        self._facts = facts

    @property
    def facts(self):
        return self._facts

    def run(self, argv):  # nothing recorded on this host (the DKMS hook guard's record is read with cat)
        return 1, "", "No such file or directory"


def test_verify_next_boot_check():
    base = {"gpus": [], "driver": {"userspace_version": "535.261.03", "next_boot_kernel": NEW,
                                   "next_boot_from": "/vmlinuz", "next_boot_module": None}}
    r = next_boot_module(FactsHost(base))
    assert r.status == "fail" and f"kernel {NEW} boots next (/vmlinuz)" in r.detail
    assert "gpuprov bootstrap" in r.detail and f"dkms autoinstall -k {NEW}" in r.detail
    ok = {**base, "driver": {**base["driver"], "next_boot_module": f"/lib/modules/{NEW}/updates/dkms/nvidia.ko"}}
    assert next_boot_module(FactsHost(ok)).status == "pass"
    assert next_boot_module(FactsHost({"gpus": [], "driver": {"next_boot_kernel": NEW}})).status == "skip"
    gpu_no_kernel = {"gpus": [{"pci_id": "10de:2330"}], "driver": {"next_boot_kernel": None}}
    assert next_boot_module(FactsHost(gpu_no_kernel)).status == "skip"


# ---------------------------------------------------------------- the headers metapackage


def test_kernel_metapackages_and_their_headers():
    installed = ["linux-image-amd64", "linux-image-6.1.0-27-amd64", "linux-image-cloud-amd64", "linux-image-rt-amd64",
                 "linux-image-amd64-dbg", "linux-image-6.1.0-27-amd64-unsigned", "linux-image-686-pae",
                 "linux-image-generic-hwe-22.04", "linux-image-unsigned-6.8.0-49-generic", "linux-image-aws",
                 "linux-image-extra-virtual", "linux-headers-amd64", "linux-base"]
    metas = kernel_metapackages(installed)
    assert metas == ("linux-image-686-pae", "linux-image-amd64", "linux-image-aws", "linux-image-cloud-amd64",
                     "linux-image-generic-hwe-22.04", "linux-image-rt-amd64")
    assert headers_metapackages(metas) == ("linux-headers-686-pae", "linux-headers-amd64", "linux-headers-aws",
                                           "linux-headers-cloud-amd64", "linux-headers-generic-hwe-22.04",
                                           "linux-headers-rt-amd64")


def _pkgs_step(root: Path, opt: Options | None = None):
    steps = build_plan(detect_host(root, engines=False, pin=(opt.driver if opt and opt.driver.isdigit() else None),
                                   for_gpus=opt.for_gpus if opt else ()), opt or Options())
    return next(s for s in steps if s.id == "driver.packages")


@pytest.mark.parametrize("meta, headers", [("linux-image-cloud-amd64", "linux-headers-cloud-amd64"),
                                           ("linux-image-rt-amd64", "linux-headers-rt-amd64")])
def test_debian_plan_installs_the_flavours_headers_metapackage(tmp_path, meta, headers):
    root = make_host(tmp_path, "debian-12", "datacenter")
    _kernels(root, OLD, link=OLD)
    dpkg_status(root, {f"linux-image-{OLD}": "linux-signed-amd64", meta: "linux-signed-amd64"})
    step = _pkgs_step(root)
    install = next(ln for ln in step.lines() if "apt-get install" in ln).split()
    assert [a for a in install[install.index("--no-install-recommends") + 1:] if a != "--no-remove"][:2] == \
        [f"linux-headers-{OLD}", headers]
    assert any(f"{headers} follows {meta}" in n for n in step.notes), step.notes
    assert headers not in " ".join(next(s for s in build_plan(detect_host(root, engines=False), Options())
                                        if s.id == "driver.hold").lines())


def test_no_kernel_metapackage_no_headers_metapackage_and_said(tmp_path):
    root = make_host(tmp_path, "debian-12", "datacenter")
    _kernels(root, OLD, link=OLD)
    step = _pkgs_step(root)
    assert "linux-headers-amd64" not in " ".join(step.lines())
    assert any("no kernel metapackage" in n for n in step.notes), step.notes


def test_bundle_plan_has_no_headers_metapackage(tmp_path):
    """An offline bundle carries one kernel's headers (bundle/create.py); apt sees the bundle alone."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=OLD)
    step = _pkgs_step(root, Options(bundle=str(tmp_path / "bundle")))
    assert "linux-headers-amd64" not in " ".join(step.lines())


# ---------------------------------------------------------------- Ubuntu's precompiled modules


UBU_K = "6.8.0-49-generic"
SERIES = "580-server-open"


def _lists(root: Path, names: list[str]) -> None:
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True, exist_ok=True)
    (lists / "mirror.invalid_ubuntu_dists_jammy-updates_restricted_binary-amd64_Packages").write_text("".join(
        f"Package: {n}\nArchitecture: amd64\nVersion: 1\nSource: linux-restricted-modules\n\n" for n in names))
    (lists / "mirror.invalid_ubuntu_dists_jammy_main_binary-amd64_Packages").write_text(
        "Package: linux-modules-nvidia-999-not-restricted-generic\n\n")


def test_ubuntu_precompiled_decision():
    drv_pkgs = ("nvidia-headless-580-server-open", "nvidia-utils-580-server")
    meta, abi = f"linux-modules-nvidia-{SERIES}-generic-hwe-22.04", f"linux-modules-nvidia-{SERIES}-{UBU_K}"
    metas = ("linux-image-generic-hwe-22.04",)
    assert ubuntu_precompiled(drv_pkgs, metas, (UBU_K,), frozenset({meta, abi})).package == meta
    assert ubuntu_precompiled(drv_pkgs, metas, (UBU_K,), frozenset({meta, abi})).driver == (
        "nvidia-headless-no-dkms-580-server-open", "nvidia-utils-580-server")
    assert ubuntu_precompiled(drv_pkgs, metas, (UBU_K,), frozenset({meta, abi})).abi == (abi,)
    no_abi = ubuntu_precompiled(drv_pkgs, metas, (UBU_K,), frozenset({meta}))
    assert no_abi.package is None and UBU_K in no_abi.why
    assert ubuntu_precompiled(drv_pkgs, metas, (UBU_K,), frozenset({abi})).package is None
    assert "no kernel metapackage" in ubuntu_precompiled(drv_pkgs, (), (UBU_K,), frozenset({meta, abi})).why
    two = ubuntu_precompiled(drv_pkgs, (*metas, "linux-image-aws"), (UBU_K,), frozenset({meta, abi}))
    assert two.package is None and "several" in two.why
    assert ubuntu_precompiled(("nvidia-driver",), metas, (UBU_K,), frozenset({meta, abi})).package is None


def test_ubuntu_plan_takes_the_precompiled_modules_where_offered(tmp_path):
    root = make_host(tmp_path, "ubuntu-22.04", "datacenter", kernel=UBU_K)  # dpkg: linux-image-generic
    _lists(root, [f"linux-modules-nvidia-{SERIES}-generic", f"linux-modules-nvidia-{SERIES}-{UBU_K}"])
    assert offered_module_packages(root) == {f"linux-modules-nvidia-{SERIES}-generic",
                                             f"linux-modules-nvidia-{SERIES}-{UBU_K}"}
    step = _pkgs_step(root)
    text = "\n".join(step.lines())
    install = next(ln for ln in step.lines() if "apt-get install" in ln)
    # the headless metapackage's no-DKMS twin: nvidia-headless-580-server-open depends on nvidia-dkms-580-server-open
    # and each kernel's own modules package (the metapackage brings only its newest kernel's), marked automatic
    assert (f"linux-modules-nvidia-{SERIES}-generic linux-modules-nvidia-{SERIES}-{UBU_K} "
            "nvidia-headless-no-dkms-580-server-open") in install
    assert f"$ apt-mark auto linux-modules-nvidia-{SERIES}-{UBU_K}" in step.lines()
    assert "linux-headers" not in text and "dkms " not in text and "nvidia-dkms" not in text, text  # no DKMS build
    assert any("precompiled, signed" in n for n in step.notes), step.notes
    assert step.check.dkms and step.check.kernels == (UBU_K,)  # skipped only once the module is there


def test_ubuntu_plan_builds_with_dkms_where_not_offered(tmp_path):
    root = make_host(tmp_path, "ubuntu-22.04", "datacenter", kernel=UBU_K)
    _lists(root, [f"linux-modules-nvidia-{SERIES}-generic"])  # the metapackage, but not this kernel's ABI
    step = _pkgs_step(root)
    install = next(ln for ln in step.lines() if "apt-get install" in ln)
    assert "linux-modules-nvidia" not in install and "linux-headers-generic" in install
    assert f"$ dkms autoinstall -k {UBU_K}" in step.lines()
    assert any(f"no linux-modules-nvidia-{SERIES}-{UBU_K}" in n for n in step.notes), step.notes


# ---------------------------------------------------------------- a change of branch


def _inst(name, source, held=False, version="535.261.03-1"):
    return InstalledPackage(name, version, source=source, held=held)


OLD_535 = {p.name: p for p in (
    _inst("nvidia-driver", "nvidia-graphics-drivers", True), _inst("libcuda1", "nvidia-graphics-drivers", True),
    _inst("nvidia-smi", "nvidia-graphics-drivers", True), _inst("nvidia-driver-libs", "nvidia-graphics-drivers"),
    _inst("nvidia-open-kernel-dkms", "nvidia-open-gpu-kernel-modules", True),
    _inst("nvidia-open-kernel-support", "nvidia-open-gpu-kernel-modules"),
    _inst("nvidia-egl-common", "nvidia-graphics-drivers", True),
    _inst("nvidia-support", "nvidia-support"), _inst("firmware-misc-nonfree", "firmware-nonfree"),
    _inst("cuda-toolkit-12-2", "cuda-toolkit-12-2", True))}
TESLA_470 = ("nvidia-tesla-470-kernel-dkms", "nvidia-tesla-470-driver", "nvidia-tesla-470-smi",
             "libnvidia-tesla-470-cuda1")


def test_ubuntu_branch_change_takes_the_old_precompiled_modules_along():
    """The old branch's linux-modules-nvidia-* need its nvidia-kernel-common: left out of the transaction, apt removes
    them on its own and the dry run stops the change with exit 14 (seen in tests/integration/test_ubuntu_apt.py)."""
    v = "570.195.03-0ubuntu0.22.04.1"
    old = {p.name: p for p in (
        _inst("nvidia-headless-no-dkms-570-server-open", "nvidia-graphics-drivers-570-server", True, v),
        _inst("nvidia-kernel-common-570-server", "nvidia-graphics-drivers-570-server", True, v),
        _inst("linux-modules-nvidia-570-server-open-generic", "linux-meta", False, "5.15.0.92.89"),
        _inst(f"linux-modules-nvidia-570-server-open-{UBU_K}", "linux-restricted-modules", False, "5.15.0-92.102"),
        _inst("linux-image-generic", "linux-meta", False, "5.15.0.92.89"))}
    new = ("linux-modules-nvidia-580-server-open-generic", "nvidia-headless-no-dkms-580-server-open")
    rep = branch_replacement(old, new, frozenset(new))
    assert rep.remove == (f"linux-modules-nvidia-570-server-open-{UBU_K}", "linux-modules-nvidia-570-server-open-generic",
                          "nvidia-headless-no-dkms-570-server-open", "nvidia-kernel-common-570-server"), rep.remove
    assert rep.old == "nvidia-headless-no-dkms-570-server-open 570.195.03"


def test_branch_replacement_decision():
    rep = branch_replacement(OLD_535, TESLA_470, frozenset({*TESLA_470, "nvidia-egl-common", "libc6"}))
    assert rep.unhold == ("libcuda1", "nvidia-driver", "nvidia-egl-common", "nvidia-open-kernel-dkms", "nvidia-smi")
    # what the new series depends on stays (unheld); the operator's held CUDA toolkit is not the driver's
    assert rep.remove == ("libcuda1", "nvidia-driver", "nvidia-driver-libs", "nvidia-open-kernel-dkms",
                          "nvidia-open-kernel-support", "nvidia-smi")
    assert rep.old == "nvidia-driver 535.261.03"
    # the same series: nothing to replace; a series nobody held (not gpuprov's): not replaced
    assert branch_replacement(OLD_535, ("nvidia-open-kernel-dkms", "nvidia-driver", "nvidia-smi")) is None
    unheld = {n: InstalledPackage(p.name, p.version, source=p.source) for n, p in OLD_535.items()}
    assert branch_replacement(unheld, TESLA_470) is None
    # open -> proprietary within 535: only the open module's source goes
    flavour = branch_replacement(OLD_535, ("nvidia-kernel-dkms", "nvidia-driver", "nvidia-smi", "libcuda1",
                                           "nvidia-egl-common"))
    assert flavour.remove == ("nvidia-open-kernel-dkms", "nvidia-open-kernel-support") and \
        flavour.unhold == ("nvidia-open-kernel-dkms",)


def _held_535_host(tmp_path) -> Path:
    root = make_host(tmp_path, "debian-12", "none", kernel=OLD)
    _kernels(root, NEW, link=NEW)
    dpkg_status(root, {p.name: p.source for p in OLD_535.values()},
                held=tuple(p.name for p in OLD_535.values() if p.held))
    return root


def test_branch_change_plan(tmp_path):
    root = _held_535_host(tmp_path)
    assert dpkg_installed(root)["nvidia-driver"].held and dpkg_installed(root)["nvidia-driver"].source == \
        "nvidia-graphics-drivers"
    step = _pkgs_step(root, Options(driver="470", for_gpus=("10de:1eb8",)))
    lines = step.lines()
    assert lines[0] == "$ apt-mark unhold libcuda1 nvidia-driver nvidia-egl-common nvidia-open-kernel-dkms nvidia-smi"
    install = next(ln for ln in lines if "apt-get install" in ln).split()
    assert set(TESLA_470) <= set(install) and "nvidia-driver-" in install and "nvidia-open-kernel-dkms-" in install
    assert "cuda-toolkit-12-2-" not in install and "nvidia-support-" not in install
    # every installed kernel gets the new module, and the reboot's reason says what was replaced
    assert [ln for ln in lines if "dkms autoinstall" in ln] == [f"$ dkms autoinstall -k {OLD}",
                                                                 f"$ dkms autoinstall -k {NEW}"]
    assert step.title.startswith("Replace the driver nvidia-driver 1.0 with nvidia-tesla-470-kernel-dkms")
    assert step.reboot_reason.startswith("driver nvidia-driver 1.0 replaced")
    assert step.to_dict(diffs=False)["notes"][0] == f"reboot: {step.reboot_reason}"
    assert "back to nvidia-driver 1.0" in step.actions[0].ways_out


def test_branch_change_only_when_asked_for(tmp_path):
    """Without --driver <branch> the installed series is never replaced; a host that is not baking gets every
    installed kernel only when the branch changes."""
    root = _held_535_host(tmp_path)
    auto = _pkgs_step(root, Options(for_gpus=("10de:1eb8",)))
    assert "apt-mark unhold" not in "\n".join(auto.lines())
    pinned = build_plan(detect_host(root, engines=False, pin="470", for_gpus=("10de:1eb8",)),
                        Options(driver="470", for_gpus=("10de:1eb8",)))
    assert "every installed kernel" in next(s for s in pinned if s.id == "driver.packages").title


def test_held_packages_count_as_installed(tmp_path):
    """dpkg says `hold ok installed` for the driver after its hold step: still installed (the old check read them as
    missing and would have re-run the driver's install on every bootstrap after the hold)."""
    root = make_host(tmp_path, "debian-12", "none", kernel=OLD)
    dpkg_status(root, {"nvidia-driver": "nvidia-graphics-drivers"}, held=("nvidia-driver",))
    assert packages_installed("apt", ("nvidia-driver", f"linux-image-{OLD}"), root)
    assert not packages_installed("apt", ("nvidia-driver", "nvidia-smi"), root)


# ---------------------------------------------------------------- DKMS for every kernel, run as printed


def test_driver_install_builds_for_every_kernel_as_printed(monkeypatch):
    """After the install, `dkms autoinstall -k K` for each kernel (the package's own build covers the running and
    the newest only), then `dkms status`: the commands run are the commands printed, in order."""
    ran: list[tuple[str, ...]] = []

    def run(argv, check=True, **kw):
        if kw.get("probe"):  # the package database read before and after the install (its result in words)
            return effects.CommandResult(list(argv), 0, "", "")
        ran.append(tuple(argv))
        out = (f"nvidia-tesla-470/470.256.02, {argv[-1]}, x86_64: installed\n" if argv[:2] == ["dkms", "status"]
               else "Package: x\n")
        return effects.CommandResult(list(argv), 0, out, "")

    monkeypatch.setattr(effects, "run", run)
    act = dkms.DriverInstall((f"linux-headers-{OLD}", f"linux-headers-{NEW}", "linux-headers-amd64", *TESLA_470),
                            (OLD, NEW), "nvidia-tesla-470-kernel-dkms", (f"linux-headers-{OLD}", f"linux-headers-{NEW}"),
                            "x", unhold=("nvidia-driver",), remove=("nvidia-driver", "libcuda1"))
    act.execute()
    printed = [ln.split("$ ", 1)[1] for ln in act.lines() if ln.startswith("$ ")]
    assert [" ".join(a) for a in ran] == [p.split("NEEDRESTART_MODE=a ")[-1] for p in printed]
    assert ran[0] == ("apt-mark", "unhold", "nvidia-driver")
    assert ran[4][:3] == ("apt-get", "-s", "install")  # the dry run: nothing but the old series may go
    assert ran[4][-2:] == ran[5][-2:] == ("nvidia-driver-", "libcuda1-")
    assert "--no-remove" not in ran[5]  # it would abort on the removals asked for: the dry run guards instead
    assert ran[6:8] == [("dkms", "autoinstall", "-k", OLD), ("dkms", "autoinstall", "-k", NEW)]


# bookworm's non-free list, these four packages' stanzas as the archive has them (apt-cache show, 2026-11-25; the
# fields the closure reads, the long lines split only here)
NON_FREE = (
    "Package: nvidia-tesla-470-driver\nVersion: 470.256.02-1~deb12u1\n"
    "Depends: nvidia-tesla-470-driver-libs (= 470.256.02-1~deb12u1), nvidia-tesla-470-driver-bin (= 470.256.02-1~deb12u1), "
    "xserver-xorg-video-nvidia-tesla-470 (= 470.256.02-1~deb12u1), nvidia-tesla-470-vdpau-driver (= 470.256.02-1~deb12u1), "
    "nvidia-tesla-470-alternative (= 470.256.02-1~deb12u1), nvidia-tesla-470-kernel-dkms (= 470.256.02-1~deb12u1) | "
    "nvidia-tesla-470-kernel-470.256.02, nvidia-support\nPre-Depends: nvidia-installer-cleanup\n\n"
    "Package: nvidia-tesla-470-driver-libs\nVersion: 470.256.02-1~deb12u1\n"
    "Depends: libgl1-nvidia-tesla-470-glvnd-glx (= 470.256.02-1~deb12u1), nvidia-tesla-470-egl-icd (= 470.256.02-1~deb12u1)"
    "\n\n"
    "Package: nvidia-tesla-470-egl-icd\nVersion: 470.256.02-1~deb12u1\n"
    "Depends: nvidia-egl-common, libegl1 (>= 0.2.999) | libegl1-glvnd-nvidia, libegl-nvidia-tesla-470-0 "
    "(= 470.256.02-1~deb12u1)\n\n"
    "Package: nvidia-driver\nVersion: 535.309.01-0+deb12u1\n"
    "Depends: nvidia-driver-libs (= 535.309.01-0+deb12u1), nvidia-driver-bin (= 535.309.01-0+deb12u1), "
    "xserver-xorg-video-nvidia (= 535.309.01-0+deb12u1), nvidia-vdpau-driver (= 535.309.01-0+deb12u1), "
    "nvidia-alternative (= 535.309.01-0+deb12u1), nvidia-kernel-dkms (= 535.309.01-0+deb12u1) | nvidia-kernel-535.309.01 | "
    "nvidia-open-kernel-535.309.01, nvidia-support\nPre-Depends: nvidia-installer-cleanup, nvidia-legacy-check (>= 495)\n\n"
)


def test_archive_depends_and_the_new_series_closure(tmp_path):
    """What the new series needs, from the non-free list as apt keeps it (fields as Debian's archive writes them):
    alternatives and Pre-Depends count, versions and architecture qualifiers are dropped."""
    lists = tmp_path / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    (lists / "deb.debian.org_debian_dists_bookworm_non-free_binary-amd64_Packages").write_text(NON_FREE)
    deps = archive_depends(tmp_path)
    assert deps["nvidia-tesla-470-egl-icd"] == {"nvidia-egl-common", "libegl1", "libegl1-glvnd-nvidia",
                                                "libegl-nvidia-tesla-470-0"}
    need = closure(["nvidia-tesla-470-driver"], deps)
    # 535's shared nvidia-egl-common is needed by 470 (kept); its nvidia-legacy-check only by 535 (removed with it)
    assert {"nvidia-egl-common", "nvidia-installer-cleanup", "nvidia-tesla-470-kernel-470.256.02"} <= need
    assert not {"nvidia-driver-libs", "nvidia-legacy-check"} & need


def test_debian_driver_with_its_module_on_the_old_kernel_only_is_red(tmp_path):
    """As on the real bookworm host: Debian keeps libnvidia-ml.so.<version> under nvidia/current/ (where the userspace
    probe looks too) and no GPU is there; the driver is still known to be installed by its module on the
    kernel it was built for. The kernel that boots next without one is a failure, not a skip."""
    root = _kernels(make_host(tmp_path, "debian-12", "none", kernel=OLD), NEW, link=NEW)
    lib = root / "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.535.261.03"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    _module(root, OLD)
    facts = detect_host(root, engines=False).to_dict()
    assert facts["driver"]["userspace_version"] == "535.261.03" and facts["driver"]["module_kernels"] == [OLD]
    r = next_boot_module(FactsHost(facts))
    assert r.status == "fail" and f"kernel {NEW} boots next (/vmlinuz)" in r.detail, r
    _module(root, NEW)
    assert next_boot_module(FactsHost(detect_host(root, engines=False).to_dict())).status == "pass"


def test_branch_change_that_would_remove_more_stops_and_holds_again(monkeypatch):
    """The change of branch removes the old series by name, so apt's --no-remove cannot guard it: its dry run does.
    A dry run that would remove anything else stops with exit 14 before the install, and the old series is held
    again (nothing changed): pinned to its branch."""
    from provision.errors import RemovalRefused

    ran: list[tuple[str, ...]] = []

    def run(argv, check=True, **kw):
        ran.append(tuple(argv))
        out = "Remv nvidia-driver [535]\nRemv libcuda1 [535]\nRemv docker.io [20.10]\n" if "-s" in argv else \
            "Package: x\n"
        return effects.CommandResult(list(argv), 0, out, "")

    monkeypatch.setattr(effects, "run", run)
    act = dkms.DriverInstall((f"linux-headers-{OLD}", *TESLA_470), (OLD,), "nvidia-tesla-470-kernel-dkms",
                            (f"linux-headers-{OLD}",), "x", unhold=("nvidia-driver",), remove=("nvidia-driver", "libcuda1"))
    with pytest.raises(RemovalRefused, match="docker.io"):
        act.execute()
    assert not any(a[:2] == ("apt-get", "install") for a in ran)
    assert ran[-1] == ("sh", "-c", apt_pm.PIN_SERIES, "pin-series", "nvidia-driver")  # pinned again

"""Parsing and decisions held against real package managers' output and real-world metadata that differ from the
project's own stand-ins (tests/fixtures/el-variants/README.md: where each input came from)."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision.errors import GpuprovError

UBUNTU = Path(__file__).resolve().parents[1] / "fixtures" / "ubuntu-variants"


def test_el_dkms_for_two_kernels_asks_dnf_for_one_kernel_headers(tmp_path):
    """Rocky 9 with an errata kernel installed beside the running one (EL keeps three: installonly_limit), the
    driver from NVIDIA's repository (DKMS): kernel-devel per kernel, kernel-headers once. kernel-headers is not an
    installonly package: real dnf 4.14 answers `install kernel-headers-K1 kernel-headers-K2` with "cannot install
    both ... conflicting requests" (nothing installed), and `install kernel-headers-<older>` beside a newer one
    downgrades the operator's (both seen with Debian's real dnf, README). main asked for both."""
    from tests.unit.test_driver_plans import plan

    running, newer = "5.14.0-427.el9.x86_64", "5.14.0-503.40.1.el9_5.x86_64"
    steps = plan(tmp_path, "rocky-9", "datacenter", for_gpus=("10de:2330",), driver_source="nvidia",
                 files={f"/lib/modules/{newer}/kernel/.keep": "", f"/boot/vmlinuz-{newer}": ""})
    words = next(a for a in steps["driver.packages"]["actions"] if a.startswith("$ dnf install -y ")).split()
    assert {f"kernel-devel-{running}", f"kernel-devel-{newer}"} <= set(words), words
    assert [w for w in words if w.startswith("kernel-headers")] == ["kernel-headers"], words


@pytest.mark.parametrize("target", ["rocky-10", "almalinux-10", "rhel-10", "ol-10"])
def test_nvidia_repository_on_el10_installs_its_meta_package_not_a_module_stream(target):
    """EL 10 has no modularity, and NVIDIA's rhel10 repository no `nvidia-driver` module: its driver installation
    guide ("Kernel Modules") installs `nvidia-open` (open modules) or `cuda-drivers` (proprietary) there, module
    streams on EL 8/9 and Amazon Linux 2023 only. main planned `dnf module install nvidia-driver:open-dkms`, which
    dnf cannot install from that repository. A branch other than the newest has nothing to keep it there (the
    meta-packages require their components at >= their version): refused with the way out, before any change."""
    from provision.decide.driver import decide_gpu
    from provision.decide.gputable import PciId
    from provision.decide.targets import TARGETS

    h100, v100 = PciId(0x10DE, 0x2330), PciId(0x10DE, 0x1DB4)  # open modules, current; Volta: proprietary, 580
    t = TARGETS[target]
    assert decide_gpu(h100, t, source="nvidia").packages == ("nvidia-open",)
    assert decide_gpu(h100, t, source="nvidia", kernel_modules="proprietary").packages == ("cuda-drivers",)
    for d in (decide_gpu(h100, t, source="nvidia", pin="580"), decide_gpu(v100, t, source="nvidia")):
        assert d.packages == () and "--driver-source elrepo" in d.warnings[-1], d
    # EL 9 and Amazon Linux 2023 keep the module streams NVIDIA's guide names there
    assert decide_gpu(h100, TARGETS["rocky-9"], source="nvidia", pin="580").packages == ("nvidia-driver:580-open",)
    assert decide_gpu(h100, TARGETS["amzn-2023"], source="nvidia").packages == ("nvidia-driver:open-dkms",)


def test_ubuntu_metapackage_whose_newest_kernel_has_no_modules_yet_means_dkms(tmp_path):
    """Ubuntu 22.04 running 5.15.0-91-generic; the lists offer linux-modules-nvidia-570-server-open-generic at -91
    (with its ABI package) and, in -updates, at -92 without the -92 ABI package. apt installs the metapackage's
    newest version, whose dependency is not installable: main chose the precompiled modules (apt then stops on the
    unmet dependency); the metapackage is not offered, so DKMS builds the module."""
    from provision.facts.packages import offered_module_packages
    from provision.plan.options import Options
    from tests.conftest import make_host
    from tests.unit.test_kernel_follow import _pkgs_step

    k = "5.15.0-91-generic"
    root = make_host(tmp_path, "ubuntu-22.04", "datacenter", kernel=k)
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True, exist_ok=True)
    for suite in ("jammy", "jammy-updates"):
        (lists / f"mirror.invalid_ubuntu_dists_{suite}_restricted_binary-amd64_Packages").write_text(
            (UBUNTU / f"{suite}_restricted_Packages").read_text())
    abi = f"linux-modules-nvidia-570-server-open-{k}"
    assert offered_module_packages(root) == {abi}
    step = _pkgs_step(root, Options(engine="none", driver="570"))
    install = next(ln for ln in step.lines() if "apt-get install" in ln)
    assert "nvidia-headless-570-server-open" in install, install
    assert "linux-modules-nvidia" not in install and "linux-headers-generic" in install, install
    # the -92 ABI package published: the metapackage is offered again
    (lists / "mirror.invalid_ubuntu_dists_jammy-updates_restricted_binary-amd64_Packages").write_text(
        (UBUNTU / "jammy-updates_restricted_Packages").read_text()
        + (UBUNTU / "jammy_restricted_Packages").read_text().split("\n\n")[0].replace("91", "92") + "\n\n")
    assert "linux-modules-nvidia-570-server-open-generic" in offered_module_packages(root)


UEK = "5.15.0-208.159.3.el9uek.x86_64"  # Oracle Linux 9's default kernel: the Unbreakable Enterprise Kernel 7


def test_el_kernel_devel_package_follows_the_kernel_variant():
    """NVIDIA's driver installation guide (Oracle Linux; RHEL): UEK's headers are kernel-uek-devel-$(uname -r), the
    aarch64 64k kernel's kernel-64k-devel; main named kernel-devel-<release> for every EL kernel."""
    from provision.plan.driver import el_devel_package

    assert el_devel_package("5.14.0-503.14.1.el9_5.x86_64") == "kernel-devel-5.14.0-503.14.1.el9_5.x86_64"
    assert el_devel_package(UEK) == f"kernel-uek-devel-{UEK}"
    assert el_devel_package("6.12.0-100.28.2.2.el9uek.x86_64") == "kernel-uek-devel-6.12.0-100.28.2.2.el9uek.x86_64"
    assert el_devel_package("5.14.0-503.14.1.el9_5.aarch64+64k") == "kernel-64k-devel-5.14.0-503.14.1.el9_5.aarch64"
    assert el_devel_package("5.14.0-427.13.1.el9_4.x86_64+rt") == "kernel-rt-devel-5.14.0-427.13.1.el9_4.x86_64"


def test_oracle_linux_on_uek_dkms_names_kernel_uek_devel_and_elrepo_is_refused(tmp_path):
    """Oracle Linux 9 running UEK: NVIDIA's repository (DKMS) installs kernel-uek-devel-<release> (main:
    kernel-devel-<uek release>, which no repository has: dnf's "No match for argument"); ELRepo, the default source,
    is refused up front (exit 4) with the ways out: its kmods are built for Red Hat's kernel and load into no UEK
    (main installed kmod-nvidia-open and reported the driver installed for a kernel it cannot serve)."""
    from tests.unit.test_driver_plans import plan

    steps = plan(tmp_path / "a", "ol-9", "datacenter", files={"/proc/sys/kernel/osrelease": UEK + "\n",
                                                               f"/lib/modules/{UEK}/kernel/.keep": "",
                                                               f"/boot/vmlinuz-{UEK}": ""},
                 driver_source="nvidia")
    words = next(a for a in steps["driver.packages"]["actions"] if a.startswith("$ dnf install -y ")).split()
    assert f"kernel-uek-devel-{UEK}" in words and f"kernel-devel-{UEK}" not in words, words
    with pytest.raises(GpuprovError) as e:
        plan(tmp_path / "b", "ol-9", "datacenter", files={"/proc/sys/kernel/osrelease": UEK + "\n",
                                                          f"/lib/modules/{UEK}/kernel/.keep": "",
                                                          f"/boot/vmlinuz-{UEK}": ""})
    assert e.value.exit_code == 4 and "UEK" in str(e.value) and "--driver-source nvidia" in str(e.value)


ALINUX = "5.10.134-15.1.al8.x86_64"  # Alibaba Cloud Linux 3's kernel (tailscale/tailscale#9010): its own 5.10 line


def test_alibaba_cloud_linux_3_defaults_to_nvidias_dkms_and_elrepo_is_refused(tmp_path):
    """Alibaba Cloud Linux 3 (platform:al8) boots its own 5.10 kernel, not RHEL 8's 4.18: ELRepo's el8 kmods
    (kABI-tracking, built for Red Hat's kernel) load into none of its kernels. main defaulted to them (ELRepo's
    elrepo-release and kmod-nvidia-open, no kernel-devel). Now the default is NVIDIA's rhel8 repository with DKMS
    against Alinux's kernel-devel, dkms from EPEL 8 through Alinux's own epel-aliyuncs-release (EPEL's epel-release
    conflicts with it); `--driver-source elrepo` is refused up front (exit 4) naming the way out."""
    from tests.unit.test_driver_plans import plan

    files = {"/proc/sys/kernel/osrelease": ALINUX + "\n", f"/lib/modules/{ALINUX}/kernel/.keep": "",
             f"/boot/vmlinuz-{ALINUX}": ""}
    steps = plan(tmp_path / "a", "alinux-3", "datacenter", files=files)
    repo = steps["driver.repo"]["actions"]
    assert "$ dnf install -y epel-aliyuncs-release" in repo, repo
    assert not any("elrepo" in a or "epel-release-latest" in a for a in repo), repo
    assert any("cuda/repos/rhel8/x86_64/cuda-rhel8.repo" in a for a in repo), repo
    words = next(a for a in steps["driver.packages"]["actions"] if a.startswith("$ dnf install -y ")).split()
    assert {f"kernel-devel-{ALINUX}", "kernel-headers", "dkms"} <= set(words), words
    assert "$ dnf module install -y nvidia-driver:open-dkms" in steps["driver.packages"]["actions"], steps
    with pytest.raises(GpuprovError) as e:
        plan(tmp_path / "b", "alinux-3", "datacenter", files=files, driver_source="elrepo")
    assert e.value.exit_code == 4 and ALINUX in str(e.value) and "--driver-source nvidia" in str(e.value)

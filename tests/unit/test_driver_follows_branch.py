"""The driver series follows the kernel within its branch (issue 18, the kernel-upgrade finding).

Debian 12's security suite ships the driver (nvidia-driver, nvidia-kernel-dkms 535.309.01) together with the kernel
that needs it (6.1.0-56: the point release's 535.261.03 fails there, `pci_resize_resource` takes another argument),
while the open module (contrib, built from another source package) stays at 535.261.03. Two decisions follow:
- where the archive's open module does not follow its driver, a GPU that runs either flavour gets the proprietary
  one (apt cannot even install the open one beside the newest driver: "held broken packages", seen with real apt);
- a held series whose kernel has no module is brought to what the archive offers within its branch by the next
  bootstrap (unhold, install, the other flavour's module packages removed in the same transaction, DKMS for every
  kernel, hold again), which `gpuprov verify` names as the fix.
The same with real packages and DKMS: tests/integration/test_driver_install.py (the kernel-upgrade stage).
"""
from __future__ import annotations

from pathlib import Path

from provision.decide.debian import SUITES
from provision.decide.driver import decide_gpu, open_module_lags
from provision.decide.gputable import parse_pci_id
from provision.decide.kernel import series_update
from provision.decide.targets import target_for
from provision.facts.packages import InstalledPackage, archive_versions
from provision.plan.build import Options, build_plan
from provision.report import detect_host
from tests.conftest import dpkg_status, make_host

H100 = "10de:2330"
OLD, NEW = "6.1.0-50-amd64", "6.1.0-56-amd64"
BOOKWORM = SUITES["bookworm"].main
# what bookworm + bookworm-security offered on 2026-11-26 (apt-cache madison)
SECURITY = {"nvidia-driver": frozenset({"535.261.03", "535.309.01"}),
            "nvidia-kernel-dkms": frozenset({"535.261.03", "535.309.01"}),
            "nvidia-open-kernel-dkms": frozenset({"535.261.03"})}
POINT = {k: frozenset({"535.261.03"}) for k in SECURITY}
NON_FREE = "".join(
    f"Package: {p}\nVersion: {v}\nDepends: nvidia-support\n\n"
    for p in ("nvidia-driver", "nvidia-kernel-dkms") for v in ("535.261.03-1", "535.309.01-0+deb12u1"))
CONTRIB = "Package: nvidia-open-kernel-dkms\nVersion: 535.261.03-1\nDepends: dkms (>= 3.0.3-4~)\n\n"


def _lists(root: Path) -> None:
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True, exist_ok=True)
    (lists / "deb.debian.org_debian_dists_bookworm_non-free_binary-amd64_Packages").write_text(NON_FREE)
    (lists / "deb.debian.org_debian_dists_bookworm_contrib_binary-amd64_Packages").write_text(CONTRIB)


def test_the_open_module_lagging_its_driver_is_seen_in_the_offered_versions():
    why = open_module_lags(BOOKWORM, SECURITY)
    assert why and "535.309.01" in why and "nvidia-open-kernel-dkms" in why and "535.261.03" in why
    assert open_module_lags(BOOKWORM, POINT) is None
    assert open_module_lags(BOOKWORM, {}) is None  # no lists read: nothing known, nothing decided


def test_a_gpu_that_runs_either_flavour_gets_the_one_that_follows_the_driver():
    bookworm = target_for("debian", 12, ())
    lagging = decide_gpu(parse_pci_id(H100), bookworm, offered=SECURITY)
    assert lagging.modules == "proprietary" and lagging.packages[0] == "nvidia-kernel-dkms", lagging
    assert any("535.309.01" in w and "proprietary module (nvidia-kernel-dkms)" in w for w in lagging.warnings)
    # the point release alone: both at 535.261.03, the open module as before
    assert decide_gpu(parse_pci_id(H100), bookworm, offered=POINT).packages[0] == "nvidia-open-kernel-dkms"
    # asked for by name: kept, with the warning that apt may refuse it
    asked = decide_gpu(parse_pci_id(H100), bookworm, kernel_modules="open", offered=SECURITY)
    assert asked.packages[0] == "nvidia-open-kernel-dkms" and any("may refuse" in w for w in asked.warnings)


def test_detect_reads_the_offered_versions_from_the_apt_lists(tmp_path):
    root = make_host(tmp_path, "debian-12", "none")
    _lists(root)
    assert archive_versions(root, ("nvidia-driver", "nvidia-open-kernel-dkms")) == {
        "nvidia-driver": SECURITY["nvidia-driver"], "nvidia-open-kernel-dkms": SECURITY["nvidia-open-kernel-dkms"]}
    (gpu,) = [d for _, d in detect_host(root, engines=False, for_gpus=(H100,)).gpus]
    assert gpu.modules == "proprietary" and "nvidia-kernel-dkms" in gpu.packages


def test_before_the_drivers_components_are_enabled_the_security_suite_decides(tmp_path):
    """Issue 31, the installer's default: the point release and bookworm-security with `main non-free-firmware`, so
    the lists show neither the driver (non-free) nor the open module (contrib). gpuprov enables both, and apt then
    refused the open module beside bookworm-security's 535.309.01 (seen with real apt). Where apt fetches the security
    suite, the flavour is the one that suite updates, and what the lists show after the components are enabled
    (SECURITY) keeps it: the next run does not change flavour."""
    assert open_module_lags(BOOKWORM, {}, "bookworm-security")  # nothing in the lists, the security suite on
    assert open_module_lags(BOOKWORM, {}) is None  # the point release alone: the open module as before
    # non-free on, contrib not yet: the open module is the suite's own (535.261.03), behind the security driver
    non_free = {k: v for k, v in SECURITY.items() if k != "nvidia-open-kernel-dkms"}
    assert "535.309.01" in (open_module_lags(BOOKWORM, non_free) or "")
    assert open_module_lags(BOOKWORM, {"nvidia-driver": frozenset({"535.261.03"})}) is None
    root = make_host(tmp_path, "debian-12", "none")
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    for suite in ("bookworm", "bookworm-security"):
        for comp in ("main", "non-free-firmware"):
            (lists / f"deb.debian.org_debian_dists_{suite}_{comp}_binary-amd64_Packages").write_text(
                "Package: base-files\nVersion: 12.4+deb12u13\n\n")
    (gpu,) = [d for _, d in detect_host(root, engines=False, for_gpus=(H100,)).gpus]
    assert gpu.modules == "proprietary" and gpu.packages[0] == "nvidia-kernel-dkms", gpu
    assert any("bookworm-security" in w and "proprietary module" in w for w in gpu.warnings), gpu.warnings
    # the same host without the security suite fetched: the open module, which the point release keeps in step
    for p in lists.glob("*bookworm-security*"):
        p.unlink()
    (gpu,) = [d for _, d in detect_host(root, engines=False, for_gpus=(H100,)).gpus]
    assert gpu.packages[0] == "nvidia-open-kernel-dkms", gpu


def _inst(name: str, source: str, version: str = "535.261.03-1", held: bool = True) -> InstalledPackage:
    return InstalledPackage(name, version, source=source, held=held)


OPEN_535 = {p.name: p for p in (
    _inst("nvidia-driver", "nvidia-graphics-drivers"), _inst("libcuda1", "nvidia-graphics-drivers"),
    _inst("nvidia-smi", "nvidia-graphics-drivers"), _inst("nvidia-driver-libs", "nvidia-graphics-drivers"),
    _inst("nvidia-open-kernel-dkms", "nvidia-open-gpu-kernel-modules"),
    _inst("nvidia-open-kernel-support", "nvidia-graphics-drivers"),
    _inst("nvidia-settings", "nvidia-settings", held=False))}  # the operator's, from another source
PROPRIETARY = ("nvidia-kernel-dkms", "nvidia-driver", "nvidia-smi", "libcuda1", "firmware-misc-nonfree")
OPEN = ("nvidia-open-kernel-dkms", "nvidia-driver", "nvidia-smi", "libcuda1", "firmware-misc-nonfree")


def test_a_held_series_without_a_module_for_a_kernel_follows_the_archive_within_its_branch():
    needed = frozenset(PROPRIETARY) | {"nvidia-kernel-support", "nvidia-driver-libs"}
    up = series_update(OPEN_535, PROPRIETARY, needed, SECURITY, (NEW,))
    assert up is not None
    # every held package of the series unheld (nvidia-driver itself too: apt will not upgrade a held package)
    assert up.unhold == ("libcuda1", "nvidia-driver", "nvidia-driver-libs", "nvidia-open-kernel-dkms",
                         "nvidia-open-kernel-support", "nvidia-smi")
    # the open flavour's packages go in the same transaction; nothing else (the operator's nvidia-settings stays)
    assert up.remove == ("nvidia-open-kernel-dkms", "nvidia-open-kernel-support")
    assert up.old == "nvidia-driver 535.261.03" and NEW in up.why and "535.309.01" in up.why
    # the same flavour, a newer version offered: an update with nothing removed
    same = series_update(OPEN_535, OPEN, frozenset(OPEN), {"nvidia-driver": frozenset({"535.261.03", "535.9"})},
                         (NEW,))
    assert same is not None and same.remove == () and "535.9" in same.why


def test_no_update_without_a_reason():
    needed = frozenset(OPEN)
    assert series_update(OPEN_535, OPEN, needed, SECURITY, ()) is None  # every kernel has its module
    assert series_update(OPEN_535, OPEN, needed, POINT, (NEW,)) is None  # nothing else offered: a build problem
    unheld = {n: _inst(n, p.source, held=False) for n, p in OPEN_535.items()}
    assert series_update(unheld, PROPRIETARY, needed, SECURITY, (NEW,)) is None  # not gpuprov's series


def test_bootstrap_plans_the_update_for_a_kernel_without_its_module(tmp_path):
    """The host after `apt-get full-upgrade` brought 6.1.0-56 and the held open 535.261.03 did not build for it:
    the plan updates the series within branch 535, for every installed kernel, in the proprietary flavour."""
    root = make_host(tmp_path, "debian-12", "none", kernel=OLD)
    for k in (OLD, NEW):
        (root / f"lib/modules/{k}/kernel").mkdir(parents=True, exist_ok=True)
        (root / f"boot/vmlinuz-{k}").write_text("")
    (root / f"lib/modules/{OLD}/updates/dkms").mkdir(parents=True)
    (root / f"lib/modules/{OLD}/updates/dkms/nvidia-current-open.ko").write_text("")
    (root / "vmlinuz").symlink_to(f"boot/vmlinuz-{NEW}")
    dpkg_status(root, {p.name: p.source for p in OPEN_535.values()},
                held=tuple(p.name for p in OPEN_535.values() if p.held))
    _lists(root)
    steps = build_plan(detect_host(root, engines=False, for_gpus=(H100,)), Options(for_gpus=(H100,)))
    step = next(s for s in steps if s.id == "driver.packages")
    assert step.title.startswith("Update the driver nvidia-driver 1.0 within its branch: nvidia-kernel-dkms")
    lines = step.lines()
    assert lines[0].startswith("$ apt-mark unhold ") and "nvidia-driver" in lines[0].split()
    install = next(ln for ln in lines if "apt-get install" in ln).split()
    assert "nvidia-kernel-dkms" in install and "nvidia-open-kernel-dkms-" in install
    assert "nvidia-settings-" not in install
    assert [ln for ln in lines if ln.startswith("$ dkms autoinstall")] == [f"$ dkms autoinstall -k {OLD}",
                                                                            f"$ dkms autoinstall -k {NEW}"]
    assert any(n.startswith("update: kernel") and NEW in n for n in step.notes), step.notes
    # the new series is held again afterwards, and `modprobe nvidia` loads the flavour installed
    assert "nvidia-current" in next(s for s in steps if s.id == "driver.flavour").title
    assert any(s.id == "driver.hold" for s in steps)


def _loaded_host(tmp_path: Path, boot_module: bool) -> Path:
    """An H100 node running 6.1.0-50 with gpuprov's held open 535 loaded; a kernel update installed 6.1.0-56, which
    boots next (/vmlinuz), with or without its nvidia module."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=OLD,
                     modules="nvidia 1 0 - Live 0x0\n",
                     nvrm="NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.261.03  Release Build\n")
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "libnvidia-ml.so.535.261.03").write_text("")
    (root / f"lib/modules/{NEW}/kernel").mkdir(parents=True)
    (root / f"boot/vmlinuz-{NEW}").write_text("")
    (root / "vmlinuz").symlink_to(f"boot/vmlinuz-{NEW}")
    for k in (OLD, NEW) if boot_module else (OLD,):
        (root / f"lib/modules/{k}/updates/dkms").mkdir(parents=True)
        (root / f"lib/modules/{k}/updates/dkms/nvidia-current-open.ko").write_text("")
    dpkg_status(root, {p.name: p.source for p in OPEN_535.values()},
                held=tuple(p.name for p in OPEN_535.values() if p.held))
    return root


def test_a_loaded_driver_is_left_alone_until_the_next_kernel_lacks_its_module(tmp_path):
    """A running GPU node: the loaded driver is left alone while the kernel that boots next has its module; after a
    kernel update without one, bootstrap builds for that kernel (and the running one), instead of saying 'left
    alone' while the next boot loses the GPU."""
    served = build_plan(detect_host(_loaded_host(tmp_path / "a", True), engines=False), Options(engine="none"))
    assert next(s for s in served if s.id.startswith("driver.")).id == "driver.present"
    unserved = build_plan(detect_host(_loaded_host(tmp_path / "b", False), engines=False), Options(engine="none"))
    step = next(s for s in unserved if s.id == "driver.packages")
    assert f"$ dkms autoinstall -k {NEW}" in step.lines(), step.lines()
    assert NEW in step.title


def test_lists_kept_compressed_are_read_too(tmp_path):
    """Docker's Debian images set Acquire::GzipIndexes: apt keeps its lists compressed; .gz and .xz are read, a corrupt
    one is skipped."""
    import gzip
    import lzma

    lists = tmp_path / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    (lists / "x_dists_bookworm_non-free_binary-amd64_Packages.gz").write_bytes(gzip.compress(NON_FREE.encode()))
    (lists / "x_dists_bookworm_contrib_binary-amd64_Packages.xz").write_bytes(lzma.compress(CONTRIB.encode()))
    (lists / "y_dists_bookworm-security_non-free_binary-amd64_Packages.xz").write_bytes(b"not xz")
    assert archive_versions(tmp_path, ("nvidia-driver", "nvidia-open-kernel-dkms")) == {
        "nvidia-driver": SECURITY["nvidia-driver"], "nvidia-open-kernel-dkms": SECURITY["nvidia-open-kernel-dkms"]}

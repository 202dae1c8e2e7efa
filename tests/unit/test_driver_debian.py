"""Debian decisions from Debian's own lists (what nvidia-detect recommends), unknown legacy ids, and branch
pinning (--driver <branch>) on every family. The whole-list agreement with the real nvidia-detect script is
tests/integration/test_driver_debian_detect.py."""
from __future__ import annotations

import pytest

from provision.decide import debian
from provision.decide.driver import decide_fleet, decide_gpu, identify
from provision.decide.gputable import parse_pci_id
from provision.decide.targets import TARGETS


def dec(pci: str, target: str, **kw):
    return decide_gpu(parse_pci_id(pci), TARGETS[target], **kw)


@pytest.mark.parametrize("pci", ["10de:1eb8", "10de:20b1", "10de:1eb4", "10de:1eb9", "10de:20f0", "10de:20f2",
                                 "10de:1e37", "10de:26b8"])
def test_datacentre_gpus_get_bookworms_driver(pci):
    """T4, A100-PCIE-40GB and friends: bookworm's 535 supports them and Debian recommends nvidia-driver."""
    d = dec(pci, "debian-12", kernel_modules="proprietary")
    assert d.packages == ("nvidia-kernel-dkms", "nvidia-driver", "nvidia-smi", "libcuda1", "firmware-misc-nonfree"), \
        d.warnings
    assert d.driver_version == "535.261.03"
    assert dec(pci, "debian-12").packages[0] == "nvidia-open-kernel-dkms"  # the open kmod where the GPU allows it


@pytest.mark.parametrize("pci", ["10de:0fc0", "10de:0fc1", "10de:0fc2", "10de:0ff3", "10de:137d", "10de:1bb3",
                                 "10de:1df5", "10de:1f09"])
def test_gpus_only_tesla_470_supports_on_bookworm(pci):
    d = dec(pci, "debian-12")
    assert d.packages == ("nvidia-tesla-470-kernel-dkms", "nvidia-tesla-470-driver", "nvidia-tesla-470-smi",
                          "libnvidia-tesla-470-cuda1"), d.warnings
    assert d.modules == "proprietary" or d.packages  # 470 has no open modules
    assert dec(pci, "debian-13").packages == ()  # trixie has no 470: refused with Debian's reason
    assert "Debian 13" in dec(pci, "debian-13").warnings[-1]


def test_trixie_tesla_535_and_bullseye_legacy_390():
    assert dec("10de:1bb3", "debian-13").packages[1:2] in ((), ("nvidia-tesla-535-driver",))
    fermi = dec("10de:0de1", "debian-11")  # GeForce GT 430 (390 legacy)
    assert fermi.packages == ("nvidia-legacy-390xx-kernel-dkms", "nvidia-legacy-390xx-driver", "nvidia-legacy-390xx-smi",
                              "libnvidia-legacy-390xx-cuda1")
    assert dec("10de:0de1", "debian-12").packages == () and "390" in dec("10de:0de1", "debian-12").warnings[-1]


@pytest.mark.parametrize("pci", ["10de:00f0", "10de:00ff"])
def test_old_ids_missing_from_the_table_are_legacy_not_current(pci):
    ident = identify(parse_pci_id(pci))
    assert ident.branch in ("96", "173") and ident.kernel_modules == "proprietary" and ident.known  # Debian's lists
    d = dec(pci, "debian-12")
    assert d.packages == () and f"{ident.branch} legacy" in d.warnings[-1]


def test_unknown_id_below_range_is_unknown_legacy():
    ident = identify(parse_pci_id("10de:0a7f"))  # in no list, below Turing
    assert (ident.branch, ident.known) == ("unknown-legacy", False) and "legacy" in ident.warnings[0]
    for t in ("debian-12", "ubuntu-24.04", "rocky-9"):
        assert dec("10de:0a7f", t).packages == ()
    assert decide_fleet([decide_gpu(parse_pci_id(x), None) for x in ("10de:0a7f", "10de:2330")]).common_branch \
        is None
    # ids above every known one are still "newer than the table": newest branch, open modules
    newer = identify(parse_pci_id("10de:3fff"))
    assert (newer.branch, newer.kernel_modules) == ("current", "open")


def test_pinned_lists_match_the_archive():
    for suite in debian.SUITES.values():
        names = [d.package for d in suite.drivers]
        assert names[0] == "nvidia-driver" and len(set(names)) == len(names)
        for d in suite.drivers:
            assert all(lst in debian._lists()[suite.codename] for lst in d.lists), (suite.codename, d.package)


# --driver <branch>: per family, a branch that works, one that does not support the GPU, one not packaged.
PIN_CASES = [
    # Debian: tesla packages
    ("10de:1eb8", "debian-12", {}, "470", ("nvidia-tesla-470-kernel-dkms", "nvidia-tesla-470-driver",
                                           "nvidia-tesla-470-smi", "libnvidia-tesla-470-cuda1")),
    ("10de:1eb8", "debian-12", {}, "535", ("nvidia-open-kernel-dkms", "nvidia-driver", "nvidia-smi", "libcuda1",
                                           "firmware-misc-nonfree")),
    ("10de:1eb8", "debian-13", {}, "535", ("nvidia-tesla-535-kernel-dkms", "nvidia-tesla-535-driver",
                                           "nvidia-tesla-535-smi", "libnvidia-tesla-535-cuda1")),
    ("10de:1eb8", "debian-11", {}, "460", ("nvidia-tesla-460-kernel-dkms", "nvidia-tesla-460-driver",
                                           "nvidia-tesla-460-smi", "libnvidia-tesla-460-cuda1")),
    ("10de:0de1", "debian-11", {}, "390", ("nvidia-legacy-390xx-kernel-dkms", "nvidia-legacy-390xx-driver",
                                           "nvidia-legacy-390xx-smi", "libnvidia-legacy-390xx-cuda1")),
    # Ubuntu -<branch> packages
    ("10de:2330", "ubuntu-22.04", {}, "535", ("nvidia-headless-535-server-open", "nvidia-utils-535-server")),
    ("10de:1db4", "ubuntu-22.04", {}, "470", ("nvidia-headless-470-server", "nvidia-utils-470-server")),
    ("10de:2330", "ubuntu-24.04", {"kernel_modules": "proprietary"}, "570",
     ("nvidia-headless-570-server", "nvidia-utils-570-server")),
    # ELRepo kmod-nvidia-<branch>xx
    ("10de:2330", "rocky-9", {"kernel_modules": "proprietary"}, "580", ("kmod-nvidia-580xx",)),
    ("10de:102d", "rocky-8", {}, "470", ("kmod-nvidia-470xx",)),
    ("10de:2330", "rocky-9", {}, "595", ("kmod-nvidia-open",)),
    # NVIDIA repo module streams
    ("10de:2330", "rocky-9", {"source": "nvidia"}, "570", ("nvidia-driver:570-open",)),
    ("10de:1db4", "rocky-9", {"source": "nvidia"}, "535", ("nvidia-driver:535-dkms",)),
]


@pytest.mark.parametrize("pci,target,kw,pin,packages", PIN_CASES)
def test_pin_branch(pci, target, kw, pin, packages):
    d = dec(pci, target, pin=pin, **kw)
    assert d.packages == packages, d.warnings
    assert d.pin == pin


REFUSALS = [
    ("10de:2330", "debian-12", {}, "470", "does not support this GPU"),  # H100 is newer than 470
    ("10de:1eb8", "debian-12", {}, "390", "does not package driver branch 390"),
    ("10de:1eb8", "debian-13", {}, "470", "does not package driver branch 470"),
    ("10de:1db4", "ubuntu-24.04", {}, "470", "does not package driver branch 470"),
    ("10de:0fc0", "ubuntu-22.04", {}, "535", "does not support this GPU with driver branch 535"),  # Kepler
    ("10de:1db4", "rocky-9", {}, "595", "does not support this GPU"),  # Volta left the current branch
    ("10de:0fc0", "rocky-10", {}, "470", "does not package driver branch 470"),
    ("10de:2901", "rocky-9", {"source": "nvidia"}, "470", "does not"),  # Blackwell on 470
    ("10de:2330", "rocky-9", {"source": "nvidia"}, "123", "does not package driver branch 123"),
]


@pytest.mark.parametrize("pci,target,kw,pin,needle", REFUSALS)
def test_pin_refused_with_the_way_out(pci, target, kw, pin, needle):
    d = dec(pci, target, pin=pin, **kw)
    assert d.packages == ()
    assert needle in d.warnings[-1]
    assert "branches that support it there" in d.warnings[-1] or "no branch" in d.warnings[-1]


def test_bundle_create_takes_the_same_driver_options(tmp_path):
    """bundle create --for-gpu/--driver decide exactly as bootstrap does: a refused pin stops before any download."""
    from tests.conftest import run_cli

    r = run_cli("bundle", "create", "--target", "debian-12", "--components", "driver", "--output",
                str(tmp_path / "b"), "--for-gpu", "10de:2330", "--driver", "470")
    assert r.returncode == 2 and "does not support this GPU" in r.stderr and not (tmp_path / "b").exists()
    r = run_cli("bundle", "create", "--target", "debian-12", "--components", "driver", "--output",
                str(tmp_path / "b"), "--for-gpu", "10de:2330", "--driver", "newest")
    assert r.returncode == 2 and "--driver" in r.stderr

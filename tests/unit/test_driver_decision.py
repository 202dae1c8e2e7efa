"""The driver decision: offline lookups, per-target packages, and a walk over the whole vendored table."""
from __future__ import annotations

import json

import pytest

from provision.decide import debian
from provision.decide.driver import (
    ELREPO_KMODS,
    decide_fleet,
    decide_gpu,
    identify,
)
from provision.decide.gputable import PciId, load_table, parse_pci_id
from provision.decide.targets import TARGETS, parse_target
from provision.errors import Unsupported, UsageError
from tests.conftest import run_cli


def test_subsystem_entry_wins():
    # 10de:1db4 alone is "Tesla V100-PCIE-16GB"; with subsystem 10de:1306 NVIDIA names it "-LS".
    assert identify(parse_pci_id("10de:1db4"))[0] == "Tesla V100-PCIE-16GB"
    assert identify(parse_pci_id("10de:1db4:10de:1306"))[0] == "Tesla V100-PCIE-16GB-LS"


@pytest.mark.parametrize("bad", ["10de", "10de:zzzz", "10de:2330:10de", "0x10de:0x2330", ""])
def test_malformed_pci_id(bad):
    with pytest.raises(UsageError, match="malformed PCI id"):
        parse_pci_id(bad)


def test_unknown_target():
    with pytest.raises(Unsupported, match="unknown target"):
        parse_target("slackware-15")


def test_whole_table_walk():
    """Every device (and every subsystem entry) in the vendored table decides exactly as the table says, and
    for every target the packages exist in that target's rules or a warning says why not."""
    devices = load_table()["devices"]
    assert len(devices) > 1000
    targets = [TARGETS[t] for t in ("centos-7", "rocky-8", "rocky-9", "rocky-10", "debian-11", "debian-12",
                                    "debian-13", "ubuntu-18.04", "ubuntu-24.04", "amzn-2023")]
    for key, entry in devices.items():
        pci = PciId(0x10DE, int(key, 16))
        dec = decide_gpu(pci, None)
        assert (dec.branch, dec.kernel_modules, dec.known) == (entry["branch"], entry["modules"], True), key
        assert dec.modules == ("proprietary" if entry["modules"] == "proprietary" else "open")
        for sub, name in (entry.get("sub") or {}).items():
            sv, sd = (int(x, 16) for x in sub.split(":"))
            assert identify(PciId(0x10DE, int(key, 16), sv, sd))[0] == name
        for t in targets:
            d = decide_gpu(pci, t)
            assert d.packages or d.warnings, (key, t.name)
            if t.el_major and d.packages:
                assert d.packages[0] in ELREPO_KMODS[t.el_major].values()
            if t.os_id == "debian" and d.packages:  # Debian's own lists name a package for it
                assert debian.recommend(int(key, 16), t.codename)[0] is not None, (key, t.name)


def test_legacy_branches_on_el():
    v100, kepler = PciId(0x10DE, 0x1DB4), PciId(0x10DE, 0x0FC0)
    assert decide_gpu(v100, TARGETS["rocky-9"]).packages == ("kmod-nvidia-580xx",)
    assert decide_gpu(kepler, TARGETS["rocky-9"]).packages == ("kmod-nvidia-470xx",)
    assert decide_gpu(kepler, TARGETS["rocky-10"]).packages == ()  # ELRepo dropped 470xx on EL10
    assert decide_gpu(PciId(0x10DE, 0x0DE1), TARGETS["rocky-9"]).packages == ()  # 390xx not built for EL9


def test_h200_not_in_bookworm_driver():
    d = decide_gpu(parse_pci_id("10de:2335:10de:18bf"), TARGETS["debian-12"])
    assert d.packages == () and "no driver in Debian 12 (bookworm) supports it" in d.warnings[0]
    assert decide_gpu(parse_pci_id("10de:2335"), TARGETS["debian-13"]).driver_version == "550.163.01"


def test_kernel_modules_override():
    h100 = parse_pci_id("10de:2330")
    assert decide_gpu(h100, TARGETS["rocky-9"], kernel_modules="proprietary").packages == ("kmod-nvidia",)
    b200 = decide_gpu(parse_pci_id("10de:2901"), TARGETS["rocky-9"], kernel_modules="proprietary")
    assert b200.modules == "open" and "not supported by this GPU" in b200.warnings[0]


def test_nvidia_repo_streams_are_branches_not_versions():
    h100 = parse_pci_id("10de:2330")
    assert decide_gpu(h100, TARGETS["rocky-9"], source="nvidia").packages == ("nvidia-driver:open-dkms",)
    assert decide_gpu(parse_pci_id("10de:1db4"), TARGETS["rocky-9"], source="nvidia").packages == (
        "nvidia-driver:580-dkms",)
    assert decide_gpu(h100, TARGETS["centos-7"], source="nvidia").packages[0].startswith("nvidia-driver-branch-")


def test_fleet_single_branch_volta_and_hopper():
    f = decide_fleet([decide_gpu(parse_pci_id(x), None) for x in ("10de:1db4", "10de:2330")])
    assert f.common_branch == "580" and f.common_modules == "proprietary"
    f = decide_fleet([decide_gpu(parse_pci_id(x), None) for x in ("10de:1db4", "10de:2901")])
    assert f.common_branch == "580" and f.common_modules is None  # open-only Blackwell vs proprietary-only Volta


def test_cli_offline_lookup_json():
    r = run_cli("detect", "--pci-id", "10de:2330:10de:16c1", "--pci-id", "10de:1db4", "--target", "debian-13",
                "--json")
    assert r.returncode == 0, r.stderr
    gpus = json.loads(r.stdout)["gpus"]
    assert [(g["pci_id"], g["branch"], g["kernel_modules"]) for g in gpus] == [
        ("10de:2330", "current", "either"), ("10de:1db4", "580", "proprietary")]
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and "nvidia-open-kernel-dkms" in gpus[0]["packages"]


@pytest.mark.parametrize("args,code,needle", [
    (["--pci-id", "10de:xyz"], 2, "'10de:xyz': a PCI id VENDOR:DEVICE"),
    (["--pci-id", "10de:2330", "--target", "slackware-15"], 4, "unknown target"),
    (["--root", "/nonexistent-root"], 3, "not a directory"),
    (["--kernel-modules", "closed"], 2, "--kernel-modules must be one of"),
])
def test_cli_bad_input_one_line(args, code, needle):
    r = run_cli("detect", *args)
    assert r.returncode == code
    assert r.stdout == "" and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_missing_os_release(tmp_path):
    r = run_cli("detect", "--root", str(tmp_path))
    assert r.returncode == 3 and r.stderr.startswith("Error: no os-release")

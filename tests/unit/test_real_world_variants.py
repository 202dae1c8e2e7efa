"""Parsing and decisions held against real package managers' output and real-world metadata that differ from the
project's own stand-ins (tests/fixtures/el-variants/README.md: where each input came from)."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision import effects
from provision.errors import GpuprovError
from provision.plan.dnf import DnfPurge
from provision.plan.packages import removals

VARIANTS = Path(__file__).resolve().parents[1] / "fixtures" / "el-variants"
# Debian's real dnf 4.14, 80 columns (not a terminal): a name wider than its column goes alone on its line
WRAPPED = (VARIANTS / "dnf-remove-wrapped.txt").read_text()


def test_a_wrapped_dnf_row_is_one_package_not_its_arch():
    assert removals("dnf", WRAPPED) == ["kmod-nvidia-open-dkms", "nvidia-driver-cuda-libs",
                                        "python3-dnf-plugin-versionlock", "nvidia-persistenced"]


def test_a_purge_of_long_names_is_refused_only_for_what_it_really_removes(monkeypatch):
    """The record's packages alone: dnf's dry run removes nothing else but nvidia-persistenced, which the refusal
    names; on main it also named `x86_64` (the wrapped row's arch) as a package gpuprov did not install, and with
    nvidia-persistenced recorded too it refused a clean purge."""
    def run(argv, check=True, env=None, timeout=None, input_text=None, private_stdout=False, probe=False):
        return effects.CommandResult(list(argv), 1, WRAPPED + "Operation aborted.\n", WRAPPED, "Operation aborted.\n")
    monkeypatch.setattr(effects, "run", run)
    recorded = ("kmod-nvidia-open-dkms", "nvidia-driver-cuda-libs", "python3-dnf-plugin-versionlock")
    with pytest.raises(GpuprovError) as e:
        DnfPurge("dnf", recorded, (), False).check()
    assert "would also remove nvidia-persistenced, which" in str(e.value), str(e.value)
    DnfPurge("dnf", (*recorded, "nvidia-persistenced"), (), False).check()  # all of it gpuprov's: no refusal


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

"""A driver installed but not loaded on an rpm host, which gpuprov did not install, is kept (issue 29), as on Debian
(tests/unit/test_adopt.py item 3): the plan asks rpm's database through the dnf adapter; rpm itself is not on this
machine, so its answers are real rpm's, recorded on the el-dnf harness host (tests/fixtures/el-variants/README.md).
The real dnf and rpm run in tests/integration/test_el_kept_driver.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from provision import effects, package_managers, paths
from provision.errors import CONFLICT, GpuprovError
from provision.facts.driver_facts import DRIVER_PACKAGE_RE, nvidia_modules
from provision.facts.rootfs import under
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.report import detect_host
from tests.conftest import make_host

VARIANTS = Path(__file__).resolve().parents[1] / "fixtures" / "el-variants"
KERNEL = "5.14.0-503.14.1.el9_5.x86_64"


@pytest.fixture
def rpm_answers(monkeypatch):
    """`rpm --root ROOT -qa …` answered with a recorded rpm output (set `answer[0]`); every other command as before."""
    answer, asked, real = [""], [], effects.run

    def run(argv, **kw):
        if list(argv[:1]) == ["rpm"] and "-qa" in argv:
            asked.append(tuple(argv))
            return effects.CommandResult(list(argv), 0, answer[0])
        return real(argv, **kw)

    monkeypatch.setattr(effects, "run", run)
    return answer, asked


def el_host(tmp_path: Path, recorded: str, answer: list[str]) -> Path:
    answer[0] = (VARIANTS / recorded).read_text()
    root = make_host(tmp_path, "rocky-9", "datacenter", kernel=KERNEL)  # an H100: open kernel modules
    (root / "var/lib/rpm").mkdir(parents=True)  # rpm's database is there (its files are rpm's to read)
    return root


def driver_plan(root: Path, driver: str = "auto") -> dict:
    rep = detect_host(root, engines=False, pin=driver if driver.isdigit() else None)
    return {s.id: s for s in build_plan(rep, Options(driver=driver, engine="none")) if s.id.startswith("driver.")}


def test_cuda_repository_driver_is_kept_with_dnfs_way_out(tmp_path, rpm_answers):
    answer, asked = rpm_answers
    root = el_host(tmp_path, "rpm-qa-cuda-570-open.txt", answer)
    (root / "etc/dnf/modules.d").mkdir(parents=True)
    (root / "etc/dnf/modules.d/nvidia-driver.module").write_text(
        "[nvidia-driver]\nname=nvidia-driver\nstream=570-open\nprofiles=default\nstate=enabled\n")
    steps = driver_plan(root)
    assert list(steps) == ["driver.installed"], list(steps)
    s = steps["driver.installed"]
    assert s.title == ("NVIDIA driver 570.133.20 from NVIDIA's CUDA repository (kmod-nvidia-open-dkms nvidia-driver): "
                       "installed, not loaded: kept (no driver step)")
    assert any("(dnf remove kmod-nvidia-open-dkms nvidia-driver && dnf module reset nvidia-driver)" in n
               for n in s.notes), s.notes
    assert not any("apt-get" in n for n in s.notes)
    assert asked and all(a[1:3] == ("--root", str(root)) for a in asked)  # the plan's root, not this machine's
    # a branch asked does not replace it either: refused (exit 14), not skipped (issue 43 item 2)
    with pytest.raises(GpuprovError) as refused:
        driver_plan(root, "595")
    assert refused.value.exit_code == CONFLICT and "dnf remove kmod-nvidia-open-dkms" in str(refused.value)


def test_elrepo_driver_of_another_flavour_is_kept_unless_a_branch_is_asked(tmp_path, rpm_answers):
    """ELRepo's proprietary kmod-nvidia where this GPU's plan is kmod-nvidia-open: ELRepo's own, not gpuprov's, so
    kept as Debian keeps the distribution's driver of another branch; --driver names the replacement."""
    answer, _ = rpm_answers
    root = el_host(tmp_path, "rpm-qa-elrepo-kmod-nvidia.txt", answer)
    (root / f"lib/modules/{KERNEL}/extra/nvidia").mkdir(parents=True)  # where ELRepo's kmod puts its module
    (root / f"lib/modules/{KERNEL}/extra/nvidia/nvidia.ko").write_text("")
    [s] = driver_plan(root).values()
    assert s.id == "driver.installed" and s.title.startswith(
        "NVIDIA driver 570.133.07 from ELRepo (kmod-nvidia nvidia-x11-drv): installed, not loaded"), s.title
    assert any(f"reboot to load it: the module is on disk for {KERNEL}" in n for n in s.notes), s.notes
    assert any("`--driver <branch>` replaces it" in n for n in s.notes), s.notes
    assert "driver.installed" not in driver_plan(root, "595")


def test_the_driver_gpuprov_installed_is_its_own(tmp_path, rpm_answers):
    """Before its reboot, gpuprov's own install from NVIDIA's repository (its install record names the packages)
    is not "a driver gpuprov did not install": the usual steps, whose checks say what is done."""
    answer, _ = rpm_answers
    root = el_host(tmp_path, "rpm-qa-cuda-570-open.txt", answer)
    rec = under(root, paths.INSTALL_RECORD)  # the suite's state directory, under the root
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps({"schema": "gpuprov.installed/v1",
                               "packages": {"driver": ["nvidia-driver", "kmod-nvidia-open-dkms", "nvidia-kmod-common"]}}))
    assert "driver.installed" in driver_plan(el_host(tmp_path / "other", "rpm-qa-cuda-570-open.txt", answer))
    assert "driver.installed" not in driver_plan(root)


def test_rpm_names_are_driver_packages_and_the_apt_way_out_is_apts(tmp_path):
    names = {ln.split()[0] for f in VARIANTS.glob("rpm-qa-*.txt") for ln in f.read_text().splitlines()}
    assert sorted(n for n in names if DRIVER_PACKAGE_RE.match(n)) == [
        "kmod-nvidia", "kmod-nvidia-open-dkms", "nvidia-driver", "nvidia-x11-drv"]
    assert package_managers.get("apt").removal_hint(tmp_path, ("cuda-drivers",)) == (("apt-get", "purge", "cuda-drivers"),)
    assert package_managers.get("dnf").removal_hint(tmp_path, ("nvidia-driver",)) == (("dnf", "remove", "nvidia-driver"),)
    (tmp_path / f"lib/modules/{KERNEL}/weak-updates/nvidia").mkdir(parents=True)  # a kABI-compatible kernel's link
    (tmp_path / f"lib/modules/{KERNEL}/weak-updates/nvidia/nvidia.ko").write_text("")
    assert nvidia_modules(tmp_path) == (KERNEL,)


def test_a_root_without_rpms_database_is_not_asked(tmp_path, rpm_answers):
    """A host tree without rpm's database (a fixture, another family's root) is not asked: a plan there runs no
    command (tests/unit/test_plan_truth.py)."""
    answer, asked = rpm_answers
    root = el_host(tmp_path, "rpm-qa-cuda-570-open.txt", answer)
    (root / "var/lib/rpm").rmdir()
    assert package_managers.get("dnf").installed_packages(root, DRIVER_PACKAGE_RE.match) == {} and not asked

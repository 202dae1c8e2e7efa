"""nvidia-persistenced with the driver on data-centre GPUs (issue 26 item 6; provision/plan/persistence.py): planned
with the driver gpuprov installs, left out by --no-persistence (role: gpuprov_persistence), recorded only when
gpuprov enabled it, undone by uninstall only then; verify reports the mode. The golden plans show the steps per
release (tests/golden)."""
from __future__ import annotations

import pytest

from provision import paths, record
from provision.options import Stage
from provision.plan import apply as ap
from provision.plan import persistence
from provision.plan import uninstall as un
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.plan.steps import PackagesInstalled, PathExists, Step
from provision.report import detect_host
from provision.verify.checks import persistence_result
from tests.conftest import make_host


@pytest.fixture(autouse=True)
def private_record(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "INSTALL_RECORD", str(tmp_path / "state" / "installed.json"))


def _ids(tmp_path, distro="debian-12", sysfs="datacenter", opt=Options(), **kw) -> list[str]:
    root = make_host(tmp_path, distro, sysfs, kernel="6.1.0-27-amd64", **kw)
    (root / "run/systemd/system").mkdir(parents=True)
    return [s.id for s in build_plan(detect_host(root, engines=False), opt)]


def test_planned_with_the_driver_on_a_datacentre_gpu(tmp_path):
    ids = _ids(tmp_path)
    assert ids.index("driver.packages") < ids.index("driver.persistence.package") < ids.index("driver.persistence")


def test_no_persistence_leaves_it_out(tmp_path):
    ids = _ids(tmp_path, opt=Options.parse(no_persistence=True))
    assert "driver.packages" in ids and not [i for i in ids if i.startswith("driver.persistence")]


def test_not_for_a_driver_gpuprov_does_not_install(tmp_path):
    """The operator's driver (--driver skip; likewise one found loaded) is left alone, and so is its daemon."""
    ids = _ids(tmp_path, opt=Options(driver="skip"))
    assert "driver.packages" not in ids and not [i for i in ids if i.startswith("driver.persistence")]


def test_not_for_a_consumer_gpu(tmp_path):
    ids = _ids(tmp_path, sysfs="geforce")
    assert "driver.packages" in ids
    assert not [i for i in ids if i.startswith("driver.persistence")]


def test_ubuntu_enables_what_its_driver_package_carries(tmp_path):
    from provision.decide.targets import parse_target as resolve_target

    assert persistence.package(resolve_target("ubuntu-24.04"), "distro") == ()
    assert persistence.package(resolve_target("debian-12"), "distro") == ("nvidia-persistenced",)
    # EL: `distro` is ELRepo, whose nvidia-x11-drv carries the daemon (a real dnf found no nvidia-persistenced in
    # ELRepo's metadata: tests/integration/test_el_dnf.py); NVIDIA's repository packages it apart
    assert persistence.package(resolve_target("rocky-9"), "distro") == ()
    assert persistence.package(resolve_target("rocky-9"), "nvidia") == ("nvidia-persistenced",)


def test_recorded_only_when_gpuprov_enabled_it_and_undone_only_then(tmp_path):
    res = ap.ApplyResult()
    step = Step(persistence.STEP, Stage.DRIVER, "enable", check=PathExists(persistence.WANTS))
    ap.record_installed([step], {}, res)  # not changed (it was enabled already): not ours
    assert record.read().enabled == []
    root = tmp_path / "host"
    wants = root / persistence.WANTS.lstrip("/")
    wants.parent.mkdir(parents=True)
    wants.symlink_to("/lib/systemd/system/nvidia-persistenced.service")
    assert un.persistence_steps(root, record.read()) == []  # enabled, but by the operator
    res.outcomes.append(ap.StepOutcome(persistence.STEP, "enable", ap.Status.CHANGED))
    ap.record_installed([step], {}, res)
    assert record.read().enabled == [persistence.UNIT]
    (s,) = un.persistence_steps(root, record.read())
    assert [c.argv for c in s.actions] == [("systemctl", "disable", "--now", persistence.UNIT)]
    wants.unlink()  # disabled since by the operator: nothing to undo
    assert un.persistence_steps(root, record.read()) == []


def test_verify_reports_the_mode():
    assert persistence_result("Enabled\nEnabled\n").status == "pass"
    r = persistence_result("Enabled\nDisabled\n")
    assert r.status == "skip" and "Disabled on GPU 1 of 2" in r.detail and "nvidia-persistenced" in r.detail
    assert persistence_result(None).detail.startswith("unknown")
    assert persistence_result("[N/A]\n").detail.startswith("unknown")


def test_recorded_when_the_package_gpuprov_installed_enabled_it(monkeypatch):
    """Debian's nvidia-persistenced enables its unit when installed (bookworm 535.171.04-1~deb12u1, in a systemd
    host container): the enable step is then skipped, yet the enable is gpuprov's doing, so it is recorded."""
    monkeypatch.setattr(ap, "packages_installed", lambda manager, pkgs, root=None: True)
    step = Step(persistence.PACKAGE_STEP, Stage.DRIVER, "install", check=PathExists("/nonexistent"))
    ap.record_installed([step], {persistence.PACKAGE_STEP: PackagesInstalled("apt", ())}, ap.ApplyResult())
    assert record.read().enabled == []  # nothing was missing: the operator's package
    ap.record_installed([step], {persistence.PACKAGE_STEP: PackagesInstalled("apt", ("nvidia-persistenced",))},
                        ap.ApplyResult())
    assert record.read().enabled == [persistence.UNIT]
    assert record.read().packages == {"driver": ["nvidia-persistenced"]}


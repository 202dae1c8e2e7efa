"""Issue 27 item 4: a failed update's rollback installs the version that worked from apt's cache where apt kept it.
apt knows only the versions its lists offer: once the archive carries only the update (a security suite replacing
the version), `apt-get install nvidia-driver=OLD` fails ("Version ... was not found") and, on the previous commit, the
rollback then left dpkg half-configured and the node without a driver while saying "reinstalled" (seen with real
apt and DKMS: tests/integration/test_driver_rollback.py, its second round)."""
from __future__ import annotations

from provision.package_managers import apt as apt_pm
from tests.unit.test_kernel_update_safe import _pin, _steps, _unserved_host


def test_the_rollback_installs_the_cached_deb_else_the_archive_version(tmp_path):
    root = _unserved_host(tmp_path, held=())
    _pin(root)
    cache = root / apt_pm.CACHE.lstrip("/")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "nvidia-driver_1.0-1_amd64.deb").write_bytes(b"!<arch>\n")  # apt kept this one; not the module's
    act = _steps(root)["driver.packages"].actions[0]
    install = act.on_failure()[0].argv
    assert f"{apt_pm.CACHE}/nvidia-driver_1.0-1_amd64.deb" in install, install
    assert "nvidia-driver=1.0-1" not in install and "nvidia-open-kernel-dkms=1.0-1" in install, install
    assert "nvidia-driver=1.0-1" in act.previous  # the message and the pin name the versions


def test_epochs_are_spelt_as_apt_names_its_files(tmp_path):
    cache = tmp_path / apt_pm.CACHE.lstrip("/")
    cache.mkdir(parents=True)
    (cache / "nvidia-tesla-470-driver_1%3a470.256.02-1_amd64.deb").write_bytes(b"")
    assert apt_pm.restore_sources(tmp_path, ("nvidia-tesla-470-driver=1:470.256.02-1", "x=1")) == (
        f"{apt_pm.CACHE}/nvidia-tesla-470-driver_1%3a470.256.02-1_amd64.deb", "x=1")

"""Issue 28 item 12: values that cannot work are refused before a plan is printed, whether or not a GPU is there to
decide for (the fixtures have none), with the valid choices in the one line; and `detect --pci-id` decides for the
host's own release when no --target is given, as its help says."""
from __future__ import annotations

import json

import pytest

from provision.cli import main
from provision.decide.targets import TARGETS
from tests.conftest import FIXTURES

UNSUPPORTED = 4
DEBIAN12 = str(FIXTURES / "distros" / "debian-12")


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("cmd", ["plan", "bootstrap --dry-run", "bootstrap --check"])
@pytest.mark.parametrize("branch", ["5355", "999", "390"])
def test_driver_branch_the_target_does_not_package(cmd, branch, capsys):
    assert main([*cmd.split(), "--root", DEBIAN12, "--driver", branch]) == UNSUPPORTED
    err = _err(capsys)
    assert f"--driver {branch}" in err and "535, 470" in err  # the branches Debian 12 packages


@pytest.mark.parametrize("target,source", [("rocky-9", None), ("rocky-9", "nvidia"), ("ubuntu-22.04", None)])
def test_driver_branch_refused_per_source(target, source, capsys):
    args = ["plan", "--root", str(FIXTURES / "distros" / target), "--driver", "999"]
    assert main(args + (["--driver-source", source] if source else [])) == UNSUPPORTED
    from provision.decide.driver import packaged_branches  # here: main lacks it, and the other cases must run there

    err = _err(capsys)
    assert ", ".join(map(str, packaged_branches(TARGETS[target], source))) in err


def test_driver_branch_the_target_packages_plans(capsys):
    assert main(["plan", "--root", DEBIAN12, "--driver", "535", "--json"]) == 0
    assert main(["plan", "--root", DEBIAN12, "--driver", "999", "--only", "engine", "--json"]) == 0  # no driver stage


def test_kernel_not_installed_is_refused_without_a_gpu(capsys):
    assert main(["plan", "--root", DEBIAN12, "--kernel", "9.9.9"]) == UNSUPPORTED
    assert "--kernel 9.9.9" in _err(capsys)


def test_detect_pci_id_decides_for_the_hosts_release(capsys):
    assert main(["detect", "--pci-id", "10de:2330", "--root", DEBIAN12, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"] == "debian-12" and doc["gpus"][0]["packages"]
    assert main(["detect", "--pci-id", "10de:2330", "--root", str(FIXTURES / "distros" / "rocky-9"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"][0]["packages"] == ["kmod-nvidia-open"]
    assert main(["detect", "--pci-id", "10de:2330", "--root", DEBIAN12, "--target", "rocky-9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "rocky-9"  # --target still wins


def test_detect_column_names_the_driver_series(capsys):
    assert main(["detect", "--pci-id", "10de:2330", "--root", DEBIAN12]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ADDRESS"))
    assert "DRIVER SERIES" in header and " BRANCH " not in header

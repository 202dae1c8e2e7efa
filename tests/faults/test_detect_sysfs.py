"""Unreadable sysfs attributes never drop a GPU silently: the GPU is reported with what could be read (its
modalias fills the gaps) and a warning names what was missing; a device that cannot be identified at all is
named in a warning. (Made unreadable with a directory in the attribute's place: reading it fails with EISDIR even
as root; a non-root run with mode 000 fails the same way, with EACCES.)"""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import H200, make_host, run_cli

GPU = "sys/bus/pci/devices/0000:3b:00.0"


def unreadable(path):
    path.unlink()
    path.mkdir()


def detect(root) -> dict:
    r = run_cli("detect", "--root", str(root), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("attr", ["class", "vendor", "device", "subsystem_vendor"])
def test_unreadable_attribute_gpu_kept_from_modalias(tmp_path, attr):
    """The real H200 capture (it has modalias files), one attribute made unreadable."""
    root = tmp_path / "h200"
    shutil.copytree(H200, root, symlinks=True)
    dev = root / "sys/bus/pci/devices/0000:00:06.0"
    unreadable(dev / attr)
    doc = detect(root)
    [gpu] = doc["gpus"]
    assert (gpu["address"], gpu["pci_id"], gpu["subsystem"], gpu["pci_class"]) == (
        "0000:00:06.0", "10de:2335", "10de:18bf", "030200")
    assert gpu["name"] == "NVIDIA H200"
    assert doc["warnings"] == [], doc["warnings"]  # nothing was missing in the end: modalias had it all


def test_unreadable_class_no_modalias_gpu_reported_with_warning(tmp_path):
    root = make_host(tmp_path, "debian-12", "datacenter")
    unreadable(root / GPU / "class")
    doc = detect(root)
    [gpu] = doc["gpus"]
    assert gpu["address"] == "0000:3b:00.0" and gpu["pci_id"] == "10de:2330" and gpu["pci_class"] is None
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    [w] = [w for w in doc["warnings"] if "0000:3b:00.0" in w]
    assert "cannot read class" in w and "reported with what could be read" in w


@pytest.mark.parametrize("attr", ["vendor", "device"])
def test_unidentifiable_device_is_warned(tmp_path, attr):
    root = make_host(tmp_path, "debian-12", "datacenter")
    unreadable(root / GPU / attr)
    doc = detect(root)
    assert doc["gpus"] == []
    [w] = [w for w in doc["warnings"] if "0000:3b:00.0" in w]
    assert f"cannot read {attr}" in w and "not checked for an NVIDIA GPU" in w


def test_other_devices_unaffected(tmp_path):
    """One GPU of four unreadable: the other three are reported as before."""
    root = make_host(tmp_path, "debian-12", "multi-gpu")
    unreadable(root / "sys/bus/pci/devices/0000:2a:00.0/class")
    doc = detect(root)
    assert [g["address"] for g in doc["gpus"]] == [f"0000:{b}:00.0" for b in ("18", "2a", "3a", "5d")]
    assert sum("0000:2a:00.0" in w for w in doc["warnings"]) == 1

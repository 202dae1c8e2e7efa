"""A hostile `--root` tree never hangs detect: a FIFO (no writer), an endless device node or a huge sparse file
in place of any file detect reads ends in a bounded time with a report or a one-line error (exit 3)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from provision.facts.driver_facts import SECURE_BOOT_VAR
from provision.facts.engines import ENGINES
from tests.conftest import make_host, run_cli

GPU = "sys/bus/pci/devices/0000:3b:00.0"
NVRM = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n"
# Every file detect opens on a Debian host with one H100 (engine configs from the engines table itself).
READ_PATHS = [f"{GPU}/class", f"{GPU}/vendor", f"{GPU}/device", f"{GPU}/subsystem_device", f"{GPU}/numa_node",
              "proc/driver/nvidia/version", "proc/modules", "proc/sys/kernel/osrelease", "sys/module/nvidia/version",
              SECURE_BOOT_VAR, "etc/redhat-release", "proc/4242/comm",  # the engines' process scan reads every comm
              *[e.config.lstrip("/") for e in ENGINES]]
LIMIT_S = 30  # detect takes about a second here; a hang is what this catches


def hostile_root(tmp_path, kind: str, rel: str):
    # sys/module/nvidia/version is read when /proc/driver/nvidia/version says nothing
    nvrm = None if rel.startswith("sys/module") else NVRM
    root = make_host(tmp_path, "debian-12", "datacenter", nvrm=nvrm, kernel="6.1.0-28-amd64")
    (root / "sys/firmware/efi/efivars").mkdir(parents=True)
    # as the kernel writes it: what an unreadable attribute is recovered from
    (root / GPU / "modalias").write_text("pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00\n")
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists():
        p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "device":
        os.mknod(p, 0o600 | 0o020000, os.makedev(1, 5))  # a character device reading like /dev/zero: never ends
    else:
        with open(p, "wb") as fh:  # 8 GiB of nothing (sparse): must not be read whole into memory
            fh.truncate(8 << 30)
    return root


def detect(root) -> subprocess.CompletedProcess:
    return run_cli("detect", "--root", str(root), "--json", timeout=LIMIT_S)  # TimeoutExpired fails the test


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
@pytest.mark.parametrize("rel", READ_PATHS)
def test_special_file_never_hangs(tmp_path, kind, rel):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod needs root")  # CI runs as root
    r = detect(hostile_root(tmp_path, kind, rel))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [gpu] = doc["gpus"]  # the GPU is still there whatever else could not be read
    assert (gpu["address"], gpu["pci_id"], gpu["subsystem"]) == ("0000:3b:00.0", "10de:2330", "10de:16c1")


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_os_release_special(tmp_path, kind):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    r = detect(hostile_root(tmp_path, kind, "etc/os-release"))
    assert r.returncode == 3 and "etc/os-release: not a regular file of at most" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_everything_a_fifo(tmp_path):
    """Every attribute of the GPU a FIFO: the device cannot be identified, and detect says so instead of hanging."""
    root = make_host(tmp_path, "debian-12", "datacenter")
    d = root / GPU
    for f in list(d.iterdir()):
        if not f.is_symlink():
            f.unlink()
            os.mkfifo(f)
    os.mkfifo(d / "modalias")
    r = detect(root)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["gpus"] == [] and any("0000:3b:00.0" in w and "not checked" in w for w in doc["warnings"])

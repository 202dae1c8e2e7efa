"""Amazon Linux 2023 through a real dnf and rpm: `gpuprov bootstrap` with its default driver source (NVIDIA's CUDA
repository for amzn2023: ELRepo serves no AL2023, and there is no EPEL) on a host container presenting AL2023
(tests/integration/el_hosts.py: AL2023's os-release and a stand-in system-release with its $releasever and
`platform:al2023` provides), against a stand-in amazonlinux repository (kernel 6.1, kernel-devel, kernel-headers, dkms)
and the stand-in cuda-amzn2023 repository with its `nvidia-driver` module streams (tests/fixtures/el-repos/README.md
says where each fact came from), reached through `--mirror cuda=...`. Stand-in: the payloads (no DKMS build runs).
Real: dnf's modularity on the al2023 platform, its transactions, GPG checks, versionlock and rpm's database.

One host through its stages (module-scoped, in order): bootstrap (driver only, 570) with the stream's DKMS
prerequisites and no EPEL; after the reboot a re-run changes nothing; uninstall --purge-driver purges what gpuprov
installed and resets the stream it enabled.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, url

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GPU = "10de:2330"  # an H100: open kernel modules, so the 570-open stream
KERNEL = "6.1.119-129.201.amzn2023"  # the AMI kernel (stand-in amazonlinux repository)
DRIVER_PKGS = ("nvidia-driver", "nvidia-driver-libs", "nvidia-driver-cuda", "nvidia-driver-cuda-libs",
               "nvidia-kmod-common", "kmod-nvidia-open-dkms")
BOOTSTRAP = (f"gpuprov bootstrap --yes --json --for-gpu {GPU} --engine none --no-validate --driver 570 "
             f"--mirror cuda={url('cuda')}")


@pytest.fixture(scope="module")
def host():
    h = ElHost("amzn2023")
    try:
        h.install_gpuprov()
        h.exec("dnf install -y -q kernel", check=True)  # the AMI's kernel
        yield h
    finally:
        h.remove()


@pytest.fixture(scope="module")
def installed(host):
    before = host.rpms()
    return before, host.exec(BOOTSTRAP)


def stream(host) -> str:
    return host.exec("cat /etc/dnf/modules.d/nvidia-driver.module").stdout


def test_driver_from_nvidias_amzn2023_stream_with_its_dkms_prerequisites(host, installed):
    """On the previous commit the default driver source planned no kernel-devel (DKMS had nothing to build
    against) on AL2023: "distro" was taken for ELRepo's prebuilt kmods, which AL2023 does not get."""
    before, r = installed
    assert r.returncode in (0, 7), r.stdout[-4000:] + r.stderr[-4000:]
    after = host.rpms()
    assert {p: after.get(p) for p in DRIVER_PKGS} == {p: "3:570.133.20-1.amzn2023" for p in DRIVER_PKGS}, after
    assert after.get("kernel-devel") == f"0:{KERNEL}" and "dkms" in after, after
    assert "epel-release" not in after and host.exec("test -e /etc/yum.repos.d/epel.repo").returncode == 1
    assert "stream=570-open" in stream(host) and "state=enabled" in stream(host), stream(host)
    info = host.exec("dnf repoinfo cuda-amzn2023-x86_64 2>&1").stdout
    assert url("cuda") in info and "upstream.invalid" not in info, info
    assert {p: v for p, v in before.items() if after.get(p) != v} == {}, "a package was changed or removed"
    rec = json.loads(host.exec("cat /var/lib/gpuprov/installed.json", check=True).stdout)
    assert rec["streams"] == ["nvidia-driver"], rec


def test_rerun_after_the_reboot_changes_nothing(host, installed):
    host.reboot()
    assert host.exec(BOOTSTRAP).returncode == 15  # the resume: no GPU here to verify the driver on
    before = host.rpms()
    r = host.exec(BOOTSTRAP)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(r.stdout)["changed"] == 0, r.stdout
    assert host.rpms() == before


def test_uninstall_purges_and_resets_the_stream(host, installed):
    before, _ = installed
    r = host.exec("gpuprov uninstall --yes --purge-driver")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert host.rpms().keys() == before.keys()
    assert "state=enabled" not in stream(host), stream(host)

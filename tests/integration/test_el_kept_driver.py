"""A driver the operator installed on an rpm host, not loaded yet, is kept: gpuprov never replaces a driver it did not
install (issue 29). On a Rocky 9 host container with its GPU on the PCI bus (tests/integration/el_hosts.py, `gpu`:
an H200, open kernel modules), the operator installs NVIDIA's driver from the CUDA repository stand-in with plain
dnf, as NVIDIA's guide does (`dnf module install nvidia-driver:570-open`, EPEL for dkms), and has not rebooted.
`gpuprov bootstrap` without --driver-source (on Rocky: ELRepo) must find it in rpm's database and keep it: no ELRepo
added, no package changed, the step naming where it came from and dnf's way out. On the previous commit the
installed-driver facts read dpkg's database only, so gpuprov planned ELRepo's kmod-nvidia-open on top of it.

What is stand-in: the packages' payloads (no DKMS build, so no module on disk) and the GPU (its sysfs files).
What is real: dnf's module install, rpm's database and the query gpuprov asks it."""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, url

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
BOOT = "gpuprov bootstrap --engine none --no-validate"
# the operator's own repository files: a site mirror of NVIDIA's repository and EPEL (the served stand-ins)
REPOS = {"cuda-rhel9.repo": f"[cuda-rhel9-x86_64]\nname=cuda\nbaseurl={url('cuda/rhel9/x86_64')}\ngpgcheck=1\n"
                            f"gpgkey={url('cuda/rhel9/x86_64/D42D0685.pub')}\n",
         "epel.repo": f"[epel]\nname=epel\nbaseurl={url('epel/9/Everything/x86_64')}\ngpgcheck=0\n"}
KEPT = ("NVIDIA driver 570.133.20 from NVIDIA's CUDA repository (kmod-nvidia-open-dkms nvidia-driver): installed, "
        "not loaded: kept (no driver step)")
WAY_OUT = "dnf remove kmod-nvidia-open-dkms nvidia-driver && dnf module reset nvidia-driver"


@pytest.fixture(scope="module")
def host():
    h = ElHost(gpu=True)
    try:
        h.install_gpuprov()
        for name, text in REPOS.items():
            h.write(f"/etc/yum.repos.d/{name}", text)
        h.exec("dnf install -y -q kernel && dnf module install -y -q nvidia-driver:570-open", check=True)
        yield h
    finally:
        h.remove()


def test_the_operators_cuda_repository_driver_is_kept(host):
    before, repos = host.rpms(), host.exec("ls /etc/yum.repos.d/").stdout
    assert before.get("kmod-nvidia-open-dkms") == "3:570.133.20-1.el9", before
    plan = host.exec(f"{BOOT} --dry-run")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    assert KEPT in " ".join(plan.stdout.split()) and "elrepo" not in plan.stdout.lower(), plan.stdout
    # the plan's notes: where it came from and the way out, in dnf's words
    doc = json.loads(host.exec(f"{BOOT} --dry-run --json", check=True).stdout)
    [step] = [s for s in doc["steps"] if s["id"].startswith("driver.")]
    assert step["title"] == KEPT and step["verify_only"], step
    assert any(f"remove NVIDIA's packages first ({WAY_OUT})" in n for n in step["notes"]), step["notes"]
    # a branch asked does not replace it either: refused with the same way out (exit 14), never skipped (issue 43)
    refused = host.exec(f"{BOOT} --dry-run --driver 595")
    assert refused.returncode == 14 and WAY_OUT in refused.stderr, refused.stdout[-2000:] + refused.stderr[-2000:]
    r = host.exec(f"{BOOT} --yes --json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = {s["id"]: s for s in json.loads(r.stdout)["steps"]}
    drivers = [i for i in steps if i.startswith("driver.")]
    assert drivers == ["driver.installed"], drivers
    assert steps["driver.installed"]["title"] == KEPT and steps["driver.installed"]["status"] == "verified"
    assert host.rpms() == before  # nothing installed, changed or removed
    assert host.exec("ls /etc/yum.repos.d/").stdout == repos  # no repository added (ELRepo's, NVIDIA's)

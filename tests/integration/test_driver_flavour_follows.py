"""Issue 40, the operator's path on Debian 12, with real apt, the real `unattended-upgrades` and real DKMS: a server
from the point release, `gpuprov bootstrap --for-gpu 10de:2330` (the open module: neither flavour is maintained
there), rebooted; the operator adds `bookworm-security main` (main only, as a hand-written line often is); the real
`unattended-upgrade` then `apt-get full-upgrade` bring the security kernel, which the open 535.261.03 cannot build
for (the failure recorded, apt exit 0, `dpkg --audit` empty); reboot; `gpuprov bootstrap`:
- its plan decides from the archive as the components step will make it (plan/archive_preview.py: the security
  entry with non-free, refreshed into a private directory): bookworm-security updates nvidia-kernel-dkms and not
  nvidia-open-kernel-dkms, so the series moves to the proprietary flavour within its branch, and the plan says why;
- without --yes the run stops before any change, exit 14, naming the move;
- with --yes: non-free on the security entry, nvidia-driver at the security suite's version, a module for every
  installed kernel, the branch pinned; verify green, its updates check passing; the real `unattended-upgrade`
  afterwards exits 0.

Shares the machine's DKMS builds (driver_hosts.dkms_build_cache): the open 535 for the point release's kernel and
its failed build for the security kernel are test_driver_install's stage 1-2 builds, the proprietary 535 for both
kernels stage 2's and the security-on host's; a CI run builds none of them twice.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.integration.driver_checks import (
    BOOT,
    GPU,
    MARKS,
    SECURITY,
    complete,
    consistent,
    held,
    host,
    left_consistent,
    pinned,
    planned_packages,
    timed,
    unchanged,
    verify,
)

pytestmark = MARKS

SECURITY_MAIN = SECURITY.split(" main ")[0] + " main"  # the operator's line: main only
UPDATES = "driver updates reach the node"


@pytest.fixture(scope="module")
def bookworm_follow():
    yield from host("bookworm")


def _checks(h) -> dict:
    r = h.exec("gpuprov verify --json")
    assert "Traceback" not in r.stderr, r.stderr
    return {c["name"]: c for c in json.loads(r.stdout)["checks"]}


def test_point_release_node_moves_to_the_maintained_flavour(bookworm_follow):
    h = bookworm_follow
    old = h.kernel()
    # 1. the point release alone: neither flavour is maintained, today's rule (the open module)
    packages, _ = planned_packages(h)
    assert "nvidia-open-kernel-dkms" in packages, packages
    r, took = timed(h, BOOT + " --json")
    print(f"issue 40: bootstrap on the point release {took:.1f}s, exit {r.returncode}")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]
    consistent(h, "after bootstrap")
    h.restart()
    assert h.exec(BOOT).returncode == 15  # the reboot's resume: no device to verify

    # 2. the operator adds the security suite, main only; the real unattended-upgrades, then full-upgrade
    h.exec(f"echo '{SECURITY_MAIN}' >> /etc/apt/sources.list", check=True)
    r = h.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q unattended-upgrades")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert _checks(h)[UPDATES]["status"] == "warn"  # the driver's updates cannot reach the node
    r, took = timed(h, "unattended-upgrade -v 2>&1; echo rc=$?")
    print(f"issue 40: unattended-upgrade {took:.1f}s")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout[-3000:]
    consistent(h, "after unattended-upgrade")
    r, took = timed(h, "DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q")
    print(f"issue 40: apt-get full-upgrade {took:.1f}s, exit {r.returncode}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    consistent(h, "after apt-get full-upgrade")
    new = h.kernel()
    assert new != old, (old, new)
    complete(h, new)
    assert "installed" not in h.exec(f"dkms status -k {new}").stdout  # the open 535.261.03 does not build there
    rc, check, _ = verify(h)
    assert rc == 10 and check["status"] == "fail" and new in check["detail"], check

    # 3. the reboot, then bootstrap: planned first; without --yes it stops before any change (exit 14)
    h.restart()
    r = h.exec(f"gpuprov plan --for-gpu {GPU} --engine none --json")
    assert r.returncode == 0, r.stderr
    steps = {s["id"]: s for s in json.loads(r.stdout)["steps"]}
    assert "bookworm-security" in " ".join(steps["driver.components"].get("notes", [])), steps["driver.components"]
    install = next(a for a in steps["driver.packages"]["actions"] if "apt-get install" in a and "-s" not in a.split())
    assert " nvidia-kernel-dkms " in install and "nvidia-open-kernel-dkms-" in install, install
    why = " ".join(steps["driver.packages"].get("notes", []))
    print(f"issue 40: the plan's notes: {why}")
    assert "bookworm-security updates nvidia-kernel-dkms" in why and "nvidia-open-kernel-dkms" in why, why
    before = unchanged(h)
    r = h.exec(f"gpuprov bootstrap --for-gpu {GPU} --engine none --no-validate")
    assert r.returncode == 14, r.stdout[-2000:] + r.stderr[-2000:]
    error = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and "nvidia-open-kernel-dkms to nvidia-kernel-dkms" in error[0], r.stderr
    assert unchanged(h) == before

    # 4. with --yes: the proprietary module at the security suite's version, built for every kernel
    r, took = timed(h, BOOT + " --json")
    print(f"issue 40: bootstrap that moves the flavour {took:.1f}s, exit {r.returncode}")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]
    consistent(h, "after the flavour move")
    assert re.search(r"bookworm-security main.*non-free", h.exec("cat /etc/apt/sources.list").stdout)
    policy = h.exec("apt-cache policy nvidia-driver").stdout
    inst = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.strip()
    cand = re.search(r"Candidate: (\S+)", policy).group(1)
    assert inst == cand, policy
    assert re.search(rf"{re.escape(inst)} 990\n(?:.*\n)*?.*bookworm-security", policy), policy  # from the suite
    assert h.exec("dpkg-query -W -f '${Status}' nvidia-open-kernel-dkms").stdout != "install ok installed"
    for k in (old, new):
        assert re.search(rf"nvidia-current/{re.escape(inst.split('-')[0])}, {re.escape(k)}, x86_64: installed",
                         h.exec(f"dkms status -k {k}").stdout), h.exec("dkms status").stdout
    assert held(h) == set() and pinned(h, "nvidia-driver", "nvidia-kernel-dkms")
    rc, check, _ = verify(h)
    assert check["status"] == "pass" and new in check["detail"], check
    assert _checks(h)[UPDATES]["status"] == "pass"
    r, took = timed(h, "unattended-upgrade -v 2>&1; echo rc=$?")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout[-3000:]
    consistent(h, "after the last unattended-upgrade")


def test_bookworm_follow_host_left_consistent(bookworm_follow):
    left_consistent(bookworm_follow)

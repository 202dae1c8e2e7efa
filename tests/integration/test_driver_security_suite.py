"""The real driver install on a Debian 12 host with the security suite already on, then a branch change on it:
`gpuprov bootstrap --for-gpu 10de:2330` (an H100, baked as on a CPU builder) on a fresh systemd host with a Debian
kernel from the point release and no headers (the helpers: driver_checks.py; stages 1-2 of a point-release host:
test_driver_install.py).

A Debian 12 host, installed with the security suite already on (issue 31's second path), as Debian 12's
installer leaves it (`main non-free-firmware`: the lists show no driver package before gpuprov enables contrib and
non-free): the proprietary 535 the security suite carries (the flavour it updates with the driver; the open one was
chosen before and apt refused it), built for the point release's kernel and, since the headers metapackage follows
the security suite, for the security kernel's headers too (seen: apt's install transaction upgraded
linux-image-amd64 as well, so the security kernel arrived there and the module package's own build covered it); the
real `unattended-upgrade` then applies the rest: exit 0, `dpkg --audit` empty, the security kernel configured
completely with its module, verify green, a second bootstrap changes nothing. (The kernel arriving through
unattended-upgrades itself is stage 2's path.)

Then, on the same host, after the reboot the install recorded, a branch change: `bootstrap --driver 470` for a Tesla
T4 (10de:1eb8, which both 535 and 470 drive): the pinned 535 series unpinned and swapped for nvidia-tesla-470-driver
in one apt transaction, the 470 module built for both installed kernels, the new series pinned, the reboot recorded;
verify's next-boot check green again.

The host's tests end by checking that they left it consistent.

Slow (NVIDIA's DKMS builds: the proprietary 535 for both kernels, the Tesla 470 for both): marked `slow`, run in CI.
The proprietary 535 builds are the same as stage 2's of test_driver_install.py: made once per machine, whichever host
asks first (driver_hosts.dkms_build_cache).
"""
from __future__ import annotations

import json
import re

import pytest

from tests.integration.driver_checks import (
    BOOT,
    INSTALLER_SECURITY,
    MARKS,
    T4,
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


@pytest.fixture(scope="module")
def bookworm_security():
    yield from host("bookworm")


def test_bookworm_security_suite_on_from_the_start(bookworm_security):
    h = bookworm_security
    old = h.kernel()
    # as Debian 12's installer leaves a server: the point release and the security suite, `main
    # non-free-firmware` (neither contrib nor non-free: the lists show no driver package yet)
    h.exec("sed -i 's/ main$/ main non-free-firmware/' /etc/apt/sources.list && "
           f"echo '{INSTALLER_SECURITY}' >> /etc/apt/sources.list", check=True)
    r = h.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q unattended-upgrades")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert h.exec("apt-cache madison nvidia-driver").stdout.strip() == ""  # none before gpuprov's components
    # the flavour bookworm-security updates with the driver, chosen before contrib is there to show the lag
    packages, _ = planned_packages(h)
    assert packages[2:4] == ["nvidia-kernel-dkms", "nvidia-driver"], packages
    r, took = timed(h, BOOT + " --json")
    print(f"bookworm+security: gpuprov bootstrap {took:.1f}s, exit {r.returncode}")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]
    consistent(h, "after bootstrap")
    # the flavour the suite can update: the proprietary module, at the suite's version
    assert h.exec("dpkg-query -W -f '${Status}' nvidia-kernel-dkms").stdout == "install ok installed"
    assert held(h) == set() and pinned(h, "nvidia-driver", "nvidia-kernel-dkms")
    installed = h.kernel()  # seen: the security kernel already, apt brought it in gpuprov's own transaction
    r, took = timed(h, "unattended-upgrade -v 2>&1; echo rc=$?")
    print(f"bookworm+security: unattended-upgrade {took:.1f}s\n{r.stdout[-3000:]}")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout[-3000:]
    consistent(h, "after unattended-upgrade")
    new = h.kernel()
    print(f"bookworm+security: kernel {old}; after gpuprov's install {installed}; after unattended-upgrade {new}")
    assert new != old, (old, new)  # the security kernel, whichever of the two apt runs brought it
    complete(h, new)
    # the pinned driver's module is there for the new kernel before any further gpuprov run: the headers
    # metapackage from the security suite brought that kernel's headers with the install, so DKMS built for it then
    # (seen), or in the kernel's own hook
    assert "installed" in h.exec(f"dkms status -k {new}").stdout, h.exec("dkms status").stdout
    rc, check, _ = verify(h)
    assert check["status"] == "pass" and new in check["detail"], check
    h.restart()  # the reboot the install recorded; then a second bootstrap changes nothing (exit 15: no device)
    before = unchanged(h)
    r2 = h.exec(BOOT)
    assert r2.returncode == 15 and "Traceback" not in r2.stderr, r2.stderr
    assert unchanged(h) == before


def test_bookworm_branch_change_rebuilds_for_every_kernel(bookworm_security):
    h = bookworm_security
    kernels = h.exec("ls /lib/modules").stdout.split()
    assert len(kernels) == 2, kernels  # the point release's and the security suite's
    # the host rebooted after the test above: nothing to do, or the resume of a recorded reboot (exit 15: no device)
    assert h.exec(BOOT).returncode in (0, 15)
    change = f"--for-gpu {T4} --driver 470"
    plan = h.exec(f"gpuprov plan {change} --engine none --json")
    assert plan.returncode == 0, plan.stderr
    step = next(s for s in json.loads(plan.stdout)["steps"] if s["id"] == "driver.packages")
    # the old series' pin goes before apt sees the new one (nothing is on apt-mark hold since the pin replaced it)
    pin_gone = step["actions"].index("$ rm -f /etc/apt/preferences.d/gpuprov-nvidia")
    assert pin_gone < next(i for i, a in enumerate(step["actions"]) if "apt-get install" in a), step["actions"]
    install = next(a for a in step["actions"] if "apt-get install" in a)
    assert "nvidia-tesla-470-driver" in install and " nvidia-driver- " in install + " ", install
    assert all(f"$ dkms autoinstall -k {k}" in step["actions"] for k in kernels), step["actions"]

    r, took = timed(h, f"gpuprov bootstrap --yes {change} --engine none --no-validate --json")
    print(f"bookworm: branch change 535 -> 470 {took:.1f}s")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]  # replaced; reboot required to load it
    assert h.exec("dpkg --audit").stdout.strip() == "" and h.exec("apt-get check").returncode == 0
    # the old series is gone but for what the new one depends on (nvidia-egl-common), and nothing of it is held;
    # the new one is installed and held, whole
    srcs = h.exec("dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${source:Package}\n' | awk '$1 ~ /^[ih]i$/'").stdout
    left = set(re.findall(r"^\S+ (\S+) nvidia-(?:graphics-drivers|open-gpu-kernel-modules)$", srcs, re.M))
    assert not left & {"nvidia-driver", "nvidia-open-kernel-dkms", "libcuda1", "nvidia-smi", "nvidia-alternative",
                       "nvidia-driver-libs"}, left
    tesla = h.exec("dpkg-query -W -f '${Version}' nvidia-tesla-470-driver").stdout.split("-")[0]
    assert tesla.startswith("470."), tesla
    assert held(h) == set() and pinned(h, "nvidia-tesla-470-driver", "nvidia-tesla-470-kernel-dkms",
                                         "nvidia-tesla-470-driver-libs")
    assert "nvidia-graphics-drivers:any" not in h.exec("cat /etc/apt/preferences.d/gpuprov-nvidia").stdout
    # DKMS built 470 for both kernels, the one that boots next included
    for k in kernels:
        assert re.search(rf"nvidia-tesla-470/{re.escape(tesla)}, {re.escape(k)}, x86_64: installed",
                         h.exec(f"dkms status -k {k}").stdout), h.exec("dkms status").stdout
        mods = h.exec(f"find /lib/modules/{k}/updates/dkms -name 'nvidia*.ko*'").stdout.split()
        main = [m for m in mods if m.rsplit("/", 1)[-1].split(".ko")[0] == "nvidia-tesla-470"]  # not its helpers
        assert main and h.exec(f"modinfo -F version {main[0]}").stdout.strip() == tesla, mods
    assert "tesla-470" in h.exec("cat /etc/modprobe.d/nvidia.conf").stdout
    state = json.loads(h.exec("cat /var/lib/gpuprov/state.json").stdout)
    assert state["reboot_required"] is True and "replaced" in state["reason"], state
    rc, check, _ = verify(h)
    assert check["status"] == "pass" and h.kernel() in check["detail"], check


def test_bookworm_security_host_left_consistent(bookworm_security):
    left_consistent(bookworm_security)

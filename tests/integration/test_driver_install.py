"""The driver installed for real: `gpuprov bootstrap --for-gpu 10de:2330` (an H100: a datacentre GPU, baked as on a
CPU builder) on fresh systemd Debian hosts that carry a Debian kernel from the point release, its metapackage and no
headers (as the installer leaves a server). Everything is asserted against what apt offers at test time, never
against hard-coded versions.

Debian 12, one host through two stages of a server's life (module-scoped, in order; each stage starts where the
one before left the host, so the DKMS builds are the only ones these claims need):
1. Install: the open kernel module (the GPU allows it) built by DKMS for the kernel that boots, with that kernel's
   headers and the headers metapackage that follows linux-image-amd64; `modprobe nvidia` loading that flavour,
   signed by DKMS's key, nouveau blacklisted inside that kernel's initramfs, the packages held, the reboot recorded
   with its reason; a second run changes nothing; after the host restarts bootstrap resumes and exits 15 (no device
   to verify).
2. A security kernel (issue 31): the security suite added, the real `unattended-upgrade` run, then `apt-get
   full-upgrade`: a newer kernel ABI arrives with its headers (the metapackage followed it); the pinned open
   535.261.03 does not build for it and bookworm-security has no open 535.309.01. Both exit 0, `dpkg --audit` is
   empty, the kernel is configured completely (its initramfs made), the failed build recorded by gpuprov's DKMS hook
   guard and named by `gpuprov verify` (exit 10). `gpuprov bootstrap` then brings the series to the archive's 535
   (the proprietary flavour, since bookworm's open module does not follow the driver's updates), built for both
   kernels, pinned again; verify is green; a second bootstrap changes nothing.

The host's tests end by checking that they left it consistent. The other real driver installs are in their own files,
each its own host, so the parallel run (run-tests.sh) gives each its own worker: test_driver_security_suite.py (a host
installed with the security suite on, then a branch change) and test_driver_trixie.py (Debian 13). NVIDIA's build of
each flavour, version and kernel is made once per machine and reused by any other host that needs it (stage 2 and the
security-on host both build the proprietary 535 for both kernels): driver_hosts.dkms_build_cache says how.

How long gpuprov's install takes against a plain `apt-get install` of the same packages is measured by
bench/driver_install_bench.py, not asserted here.

Slow (NVIDIA's DKMS builds: the open 535 for the point release's kernel, its failed build for the security kernel,
the proprietary 535 for both kernels): marked `slow`, run in CI.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.integration.driver_checks import (
    BOOT,
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


@pytest.fixture(scope="module")
def bookworm():
    yield from host("bookworm")


def test_bookworm_install_then_resume(bookworm):
    h = bookworm
    k = h.kernel()
    # a server from the point release: the kernel metapackage, no headers
    assert h.exec("dpkg -s linux-image-amd64").returncode == 0
    assert h.exec("dpkg -l 'linux-headers-*' | grep -q '^ii'").returncode != 0
    packages, _ = planned_packages(h)
    assert packages[:2] == [f"linux-headers-{k}", "linux-headers-amd64"] and "nvidia-open-kernel-dkms" in packages, \
        packages
    r, took = timed(h, BOOT + " --json")
    print(f"bookworm: gpuprov bootstrap {took:.1f}s")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]  # done; reboot required to load it
    assert "Traceback" not in r.stderr
    res = json.loads(r.stdout)
    assert {s["id"]: s["status"] for s in res["steps"]}["driver.packages"] == "changed"
    print("bookworm steps: " + ", ".join(f"{s['id']} {s.get('seconds', 0):.1f}s" for s in res["steps"]))

    # apt and dpkg consistent; what is installed is what apt offers now
    assert h.exec("dpkg --audit").stdout.strip() == ""
    assert h.exec("apt-get check").returncode == 0
    cand = h.exec("apt-cache policy nvidia-driver | awk '/Candidate:/{print $2}'").stdout.strip()
    inst = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.strip()
    assert cand and inst == cand
    upstream = inst.split("-")[0]
    # the headers metapackage that follows the kernel metapackage is installed, and not held (it must move on)
    assert h.exec("dpkg-query -W -f '${Status}' linux-headers-amd64").stdout == "install ok installed"
    # DKMS built the open module for the kernel that boots, at the userspace's version, signed by DKMS's key
    assert re.search(rf"nvidia-current-open/{re.escape(upstream)}, {re.escape(k)}, x86_64: installed",
                     h.exec(f"dkms status -k {k}").stdout), h.exec("dkms status").stdout
    modver = h.exec(f"modinfo -k {k} -F version nvidia-current-open").stdout.strip()
    # the userspace libraries (NVML, CUDA) carry their version in their file names
    libver = set(h.exec("find /usr/lib/x86_64-linux-gnu -name 'libnvidia-ml.so.*.*' -o -name 'libcuda.so.*.*' "
                        "| sed -E 's/.*\\.so\\.//'").stdout.split())
    assert modver == upstream and libver == {upstream}, (modver, libver)
    assert h.exec("nvidia-smi").returncode == 9  # there, and says it has no device
    signer = h.exec(f"modinfo -k {k} -F signer nvidia-current-open").stdout.strip()
    key_cn = h.exec("openssl x509 -inform DER -in /var/lib/dkms/mok.pub -noout -subject -nameopt multiline "
                    "| sed -n 's/^ *commonName *= *//p'").stdout.strip()
    assert signer and signer == key_cn, (signer, key_cn)
    # `modprobe nvidia` loads the flavour gpuprov chose
    assert "install nvidia modprobe -i nvidia-current-open" in h.exec("cat /etc/modprobe.d/nvidia.conf").stdout
    # nouveau blacklisted inside that kernel's initramfs
    assert "etc/modprobe.d/gpuprov-blacklist-nouveau.conf" in h.exec(f"lsinitramfs /boot/initrd.img-{k}").stdout
    # pinned to its branch by source package (the whole series, what apt installed with it too), nothing on
    # apt-mark hold (it would keep the security suite's in-branch update from its kernel), the headers free
    assert held(h) == set(), held(h)
    assert pinned(h, "nvidia-driver", "nvidia-open-kernel-dkms", "nvidia-driver-libs", "nvidia-alternative")
    assert not pinned(h, "linux-headers-amd64")
    # DKMS's kernel hooks record a failed build instead of failing the kernel (its autoinstaller reads this file)
    assert h.exec("grep -q 'Written by gpuprov' /etc/sysconfig/dkms").returncode == 0
    # reboot state with its reason
    state = json.loads(h.exec("cat /var/lib/gpuprov/state.json").stdout)
    assert state["reboot_required"] is True and k in state["reason"], state

    # a second run changes nothing (the reboot is still pending: it says so, exit 7)
    before = h.exec(f"md5sum /var/lib/dpkg/status /boot/initrd.img-{k} /etc/apt/sources.list; apt-mark showhold")
    r2 = h.exec(BOOT)
    assert r2.returncode == 7 and "reboot is still pending" in r2.stderr, r2.stderr
    assert h.exec(f"md5sum /var/lib/dpkg/status /boot/initrd.img-{k} /etc/apt/sources.list; apt-mark showhold"
                  ).stdout == before.stdout

    # after a restart of the host: bootstrap resumes and says there is no device to verify (exit 15)
    h.restart()
    r3 = h.exec(BOOT)
    assert r3.returncode == 15, r3.stdout + r3.stderr
    assert "no NVIDIA device" in r3.stderr and "Traceback" not in r3.stderr
    assert len(r3.stderr.strip().splitlines()) == 1


def test_bookworm_security_kernel_never_breaks_apt(bookworm):
    """Issue 31, the point release -> security suite path: the pending security updates applied by the real
    unattended-upgrades, then `apt-get full-upgrade`. A newer kernel ABI arrives (6.1.0-56); the pinned open 535.261.03
    cannot build for it, and bookworm-security's 535.309.01 has no open module. Both exit 0, dpkg stays consistent,
    the kernel is configured completely (its initramfs made), the failed build recorded and named by verify. Then
    `gpuprov bootstrap` brings the series to the archive's 535 for every kernel; a second one changes nothing."""
    h = bookworm
    old = h.kernel()
    rc, check, _ = verify(h)
    assert check["status"] == "pass" and old in check["detail"], check
    h.exec(f"echo '{SECURITY}' >> /etc/apt/sources.list", check=True)
    r = h.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q unattended-upgrades")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    upstream = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.split("-")[0]
    offered = h.exec("apt-cache policy nvidia-driver | awk '/Candidate:/{print $2}'").stdout.strip().split("-")[0]
    print(f"bookworm: installed nvidia-driver {upstream}, candidate under the pin {offered}")

    # the real unattended-upgrades, security origin, as its timer runs it
    r, took = timed(h, "unattended-upgrade -v 2>&1; echo rc=$?")
    print(f"bookworm: unattended-upgrade {took:.1f}s\n{r.stdout[-4000:]}")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout[-3000:]
    consistent(h, "after unattended-upgrade")
    new = h.kernel()
    assert new != old, (old, new)
    complete(h, new)
    failed = h.exec(f"cat /var/lib/gpuprov/dkms-failed/{new}")
    built = "installed" in h.exec(f"dkms status -k {new}").stdout
    print(f"bookworm: after unattended-upgrade, module for {new}: {built}; recorded failure: {failed.stdout.strip()}")
    log = h.exec("cat /var/log/unattended-upgrades/unattended-upgrades-dpkg.log").stdout
    if not built:  # the failure reached the kernel's hook, was recorded there and did not fail the kernel
        assert failed.returncode == 0 and "exit 11" in failed.stdout, failed.stdout
        assert "gpuprov: DKMS could not build a module for kernel " + new in log, log[-3000:]
        rc, check, err = verify(h)
        assert rc == 10 and check["status"] == "fail" and f"kernel {new} boots next" in check["detail"], check
        assert "gpuprov bootstrap" in check["detail"]

    # `apt-get full-upgrade` (the issue's own reproduction) after it: exit 0, consistent
    r, took = timed(h, "DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q")
    print(f"bookworm: apt-get full-upgrade {took:.1f}s, exit {r.returncode}\n{r.stdout[-3000:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    consistent(h, "after apt-get full-upgrade")
    complete(h, new)

    # bootstrap: a module for every kernel, the branch pinned (no hold), verify green
    r, took = timed(h, BOOT + " --json")
    print(f"bookworm: bootstrap after the security updates {took:.1f}s, exit {r.returncode}")
    assert r.returncode in (0, 7), r.stdout[-3000:] + r.stderr[-3000:]
    consistent(h, "after bootstrap")
    now = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.split("-")[0]
    assert now.split(".")[0] == upstream.split(".")[0], (now, upstream)  # within the branch
    for k in (old, new):
        assert "installed" in h.exec(f"dkms status -k {k}").stdout, h.exec("dkms status").stdout
    assert held(h) == set() and pinned(h, "nvidia-driver")
    rc, check, _ = verify(h)
    assert check["status"] == "pass" and new in check["detail"], check
    # after the reboot, a second bootstrap changes nothing: it resumes after the reboot the update recorded (verifies,
    # finds no device: exit 15), or, where apt's full-upgrade already brought the module (seen: it swapped the open
    # module for the proprietary 535.309.01 in its own transaction), finds nothing to do (exit 0)
    first = r.returncode
    h.restart()
    before = unchanged(h)
    r2 = h.exec(BOOT)
    assert r2.returncode == (15 if first == 7 else 0) and "Traceback" not in r2.stderr, (first, r2.stderr)
    assert unchanged(h) == before


def test_bookworm_host_left_consistent(bookworm):
    left_consistent(bookworm)

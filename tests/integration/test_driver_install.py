"""The driver installed for real: `gpuprov bootstrap --for-gpu 10de:2330` (an H100: a datacentre GPU, baked as on a
CPU builder) on fresh systemd Debian hosts that carry a Debian kernel with its headers. Everything is asserted
against what apt offers at test time, never against hard-coded versions.

Debian 12: the open kernel module (the GPU allows it) built by DKMS for the kernel that boots, `modprobe nvidia`
loading that flavour, signed by DKMS's key, nouveau blacklisted inside that kernel's initramfs, the packages held,
the reboot recorded with its reason; a second run changes nothing; after the host restarts bootstrap resumes and
exits 15 (no device to verify). The time is compared with a plain `apt-get install` of the same package set on a
second fresh host from the same image, started at the same instant, each host on its own half of this machine's CPUs:
both see the same load, archive and caches, and neither's DKMS build waits on the other's, so the difference is what
gpuprov adds. (Run one after the other, the 200 s DKMS build varied by 15-30 s between two hosts on this 2-core
machine; side by side on shared CPUs, by up to 13 s: more than the 10 s being checked. gpuprov's own part, outside
the apt-get commands it shares with the reference, measured 2.8 s.) Should the first round exceed the bound, a second
round on two more fresh hosts runs, and the best time of each side is compared, as benchmarks do with noise.

Debian 13: the same, or, while trixie's open module does not build against trixie's kernel, the honest failure:
exit 16 naming package, kernel and the compiler's first error line, dpkg consistent, the ways out.

Slow (about 20 minutes with the image builds): marked `slow`, run in CI.
"""
from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import needs
from tests.integration.driver_hosts import KernelHost, kernel_image

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GPU = "10de:2330"
BOOT = f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate"
COMPONENTS = r"sed -i -E 's/^(deb .*) main$/\1 main contrib non-free non-free-firmware/' /etc/apt/sources.list"


def _timed(host: KernelHost, script: str, timeout: float = 2400):
    t = time.monotonic()
    r = host.exec(script, timeout=timeout)
    return r, time.monotonic() - t


def _planned_packages(host: KernelHost) -> list[str]:
    r = host.exec(f"gpuprov plan --for-gpu {GPU} --engine none --json")
    assert r.returncode == 0, r.stdout + r.stderr
    step = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.packages")
    cmd = next(a for a in step["actions"] if "apt-get install" in a)
    return cmd.split("--no-install-recommends", 1)[1].split()


def cpu_halves() -> tuple[str | None, str | None]:
    """Two disjoint, equal sets of this machine's CPUs (docker's --cpuset-cpus form), or no pinning on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    k = len(cpus) // 2
    if not k:
        return None, None
    return ",".join(map(str, cpus[:k])), ",".join(map(str, cpus[k:2 * k]))


GPUPROV_CPUS, APT_CPUS = cpu_halves()  # the gpuprov hosts' CPUs, the plain-apt reference hosts'


def _side_by_side(h: KernelHost, packages: list[str]):
    """gpuprov's bootstrap on `h` and, started at the same instant, plain apt's install of the same packages on a
    fresh reference host on the other CPUs: (gpuprov's result, its seconds, apt's seconds)."""
    ref = KernelHost("bookworm", "apt", cpus=APT_CPUS)
    try:
        ref.exec(COMPONENTS, check=True)
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(_timed, ref, "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                                "--no-install-recommends " + " ".join(packages))
            r, took = _timed(h, BOOT + " --json")
            rr, apt_took = plain.result()
        assert rr.returncode == 0, rr.stdout[-2000:] + rr.stderr[-2000:]
        assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]  # done; reboot required to load it
    finally:
        ref.remove()
    return r, took, apt_took


@pytest.fixture(scope="module")
def bookworm():
    kernel_image("bookworm")  # built once, before any timing starts
    h = KernelHost("bookworm", "gpuprov", cpus=GPUPROV_CPUS)
    try:
        h.install_gpuprov()
        yield h
    finally:
        h.remove()


def test_bookworm_install_then_resume(bookworm, record_property):
    h = bookworm
    k = h.kernel()
    packages = _planned_packages(h)
    assert packages[0] == f"linux-headers-{k}" and "nvidia-open-kernel-dkms" in packages, packages
    r, took, apt_took = _side_by_side(h, packages)
    rounds = [(round(took, 1), round(apt_took, 1))]
    if took > apt_took + 10:  # a second round on two fresh hosts; the best of each side is compared
        h2 = KernelHost("bookworm", "gpuprov", cpus=GPUPROV_CPUS)
        try:
            h2.install_gpuprov()
            _, took2, apt_took2 = _side_by_side(h2, packages)
            rounds.append((round(took2, 1), round(apt_took2, 1)))
        finally:
            h2.remove()
    took, apt_took = min(g for g, _ in rounds), min(a for _, a in rounds)
    print(f"bookworm: gpuprov bootstrap {took:.1f}s, plain apt-get install of the same {len(packages)} "
          f"packages {apt_took:.1f}s (side by side, CPUs {GPUPROV_CPUS} and {APT_CPUS}; rounds {rounds})")
    record_property("gpuprov_s", round(took, 1))
    record_property("apt_s", round(apt_took, 1))
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
    # held against unattended upgrades
    held = set(h.exec("apt-mark showhold").stdout.split())
    assert {"nvidia-driver", "nvidia-open-kernel-dkms", "nvidia-smi", "libcuda1"} <= held, held
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

    assert took <= apt_took + 10, (took, apt_took)


def test_trixie_open_module_built_or_failure_met_honestly():
    kernel_image("trixie")
    h = KernelHost("trixie", "gpuprov")
    try:
        h.install_gpuprov()
        k = h.kernel()
        r, took = _timed(h, BOOT)
        print(f"trixie: gpuprov bootstrap exit {r.returncode} in {took:.1f}s")
        assert "Traceback" not in r.stderr
        assert h.exec("dpkg --audit").stdout.strip() == "", "dpkg left inconsistent"
        if r.returncode == 16:
            err = r.stderr.strip()
            assert "nvidia-open-kernel-dkms" in err and k in err and "error:" in err, err
            assert "Rolled back" in err and "`dpkg --audit` is empty" in err
            assert "--kernel-modules proprietary" in err and "--driver-source nvidia" in err
            assert h.exec("dpkg -s nvidia-open-kernel-dkms").returncode != 0  # purged, not half-configured
            # no silent switch to the other flavour: no kernel module package and no metapackage left behind
            left = h.exec("dpkg-query -W -f '${Package} ${Status}\\n' 'nvidia-*kernel-dkms' nvidia-driver 2>/dev/null"
                          " | grep 'install ok installed'").stdout
            assert left.strip() == "", left
            log = re.search(r"full log: (\S+)\)", err).group(1)
            assert h.exec(f"test -s {log}").returncode == 0
        else:
            assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]
            assert "installed" in h.exec(f"dkms status -k {k}").stdout
            assert "etc/modprobe.d/gpuprov-blacklist-nouveau.conf" in h.exec(
                f"lsinitramfs /boot/initrd.img-{k}").stdout
            h.restart()
            assert h.exec(BOOT).returncode == 15
    finally:
        h.remove()

"""What the real driver-install tests (test_driver_install, test_driver_security_suite, test_driver_trixie) run and
check on their hosts: gpuprov's commands as they run them, and apt's, dpkg's and DKMS's answers read back."""
from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import needs
from tests.integration.driver_hosts import KernelHost, kernel_image

# Every real driver-install test: slow, run in CI, on hosts from a debootstrap image under the machine's dockerd.
MARKS = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]

GPU = "10de:2330"
BOOT = f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate"
T4 = "10de:1eb8"  # Turing: driven by bookworm's nvidia-driver (535) and by nvidia-tesla-470-driver
SECURITY = "deb http://deb.debian.org/debian-security bookworm-security main contrib non-free non-free-firmware"
INSTALLER_SECURITY = SECURITY.replace("main contrib non-free non-free-firmware", "main non-free-firmware")
NEXT_BOOT = "next-boot kernel module"
# With --engine none there is no engine: these checks fail in every verify here, whatever the kernel's module.
NO_ENGINE = {"engine running", "runtime registered", "container through the runtime"}


def timed(host: KernelHost, script: str, timeout: float = 3600):
    t = time.monotonic()
    r = host.exec(script, timeout=timeout)
    return r, time.monotonic() - t


def planned_packages(host: KernelHost, extra: str = "") -> tuple[list[str], list[str]]:
    """(the packages driver.packages installs, its actions) from `gpuprov plan --json`."""
    r = host.exec(f"gpuprov plan --for-gpu {GPU} --engine none --json {extra}")
    assert r.returncode == 0, r.stdout + r.stderr
    step = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.packages")
    cmd = next(a for a in step["actions"] if "apt-get install" in a)
    return [a for a in cmd.split("--no-install-recommends", 1)[1].split() if a != "--no-remove"], step["actions"]


def verify(h: KernelHost) -> tuple[int, dict, str]:
    """`gpuprov verify --json`: (exit code, the next-boot check, stderr)."""
    r = h.exec("gpuprov verify --json")
    assert "Traceback" not in r.stderr, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    failed = {n for n, c in checks.items() if c["status"] == "fail"}
    assert failed - {NEXT_BOOT} <= NO_ENGINE, checks
    return r.returncode, checks[NEXT_BOOT], r.stderr


def held(h: KernelHost) -> set[str]:
    return set(h.exec("apt-mark showhold").stdout.split())


def pinned(h: KernelHost, *packages: str) -> bool:
    """apt's policy gives each package's installed version gpuprov's branch pin (990)."""
    for p in packages:
        inst = h.exec(f"dpkg-query -W -f '${{Version}}' {p}").stdout.strip()
        if not inst or not re.search(rf"^\W*{re.escape(inst)} 990$", h.exec(f"apt-cache policy {p}").stdout, re.M):
            return False
    return True


def consistent(h: KernelHost, what: str) -> None:
    audit = h.exec("dpkg --audit").stdout.strip()
    assert audit == "" and h.exec("apt-get check").returncode == 0, f"{what}: dpkg --audit says {audit}"


def complete(h: KernelHost, k: str) -> None:
    """The kernel is configured completely: dpkg says installed, its initramfs was made (the hook after DKMS's)."""
    assert h.exec(f"dpkg-query -W -f '${{Status}}' linux-image-{k}").stdout == "install ok installed"
    assert h.exec(f"test -s /boot/initrd.img-{k}").returncode == 0, f"no initramfs for {k}"


def unchanged(h: KernelHost) -> str:
    return h.exec("md5sum /var/lib/dpkg/status /etc/apt/preferences.d/gpuprov-nvidia /etc/sysconfig/dkms "
                  "/etc/modprobe.d/nvidia.conf; apt-mark showhold; ls /lib/modules/*/updates/dkms").stdout


def host(suite: str):
    """A KernelHost of SUITE with gpuprov installed from the wheelhouse, removed afterwards (a fixture's body)."""
    kernel_image(suite)
    h = KernelHost(suite, "gpuprov")
    try:
        h.install_gpuprov()
        yield h
    finally:
        h.remove()


def left_consistent(h: KernelHost) -> None:
    """What each host's tests must leave: dpkg and apt consistent, and no gpuprov run or DKMS build still going."""
    consistent(h, "at the end")
    running = h.exec("cat /proc/[0-9]*/comm 2>/dev/null | grep -xE 'gpuprov|dkms' || true").stdout.strip()
    assert running == "", running

"""Fresh Debian hosts with systemd and a Debian kernel (its metapackage, without headers), for real driver installs.

The prepared image (kernel and headers already installed, systemd as PID 1) is built once per CI run per suite
and reused by the gpuprov host and the plain-apt reference host alike, so both start from the same state and the
timing comparison is fair. Its name carries a hash of the recipe below, so a changed recipe builds a new one.
"""
from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time

from tests.integration.hosts import NESTED, committed_image, ensure_image, ensure_wheelhouse, sh

# Installed into the image: systemd as PID 1, the distribution's kernel metapackage (no headers: a server as the
# installer leaves it, from the point release only; gpuprov installs the headers), Python for gpuprov.
PREP_PACKAGES = ("systemd", "systemd-sysv", "dbus", "kmod", "initramfs-tools", "linux-image-amd64", "python3",
                 "python3-venv")
# initramfs-tools told to take the modules /etc/initramfs-tools/modules lists (none) instead of `most`: a host
# container boots no initramfs, and what the tests read in one (gpuprov's nouveau blacklist, every
# /etc/modprobe.d/*.conf) mkinitramfs copies whatever MODULES says; under `most` neither nouveau nor nvidia's modules
# were in it either (seen: lsinitramfs after stage 1). Each generation takes ~5 s instead of 38-54 s (the module
# walk, not the compression; the 2-core machine at load 4), and test_driver_install's bookworm host alone makes about
# ten: the install's dpkg triggers (three) and nvidia-persistenced's, each new kernel's hook, the driver swap's.
INITRAMFS_CONF = "MODULES=list\n"
RECIPE = "v3 " + " ".join(PREP_PACKAGES) + " " + INITRAMFS_CONF
SYSTEMD_FLAGS = [*NESTED, "--tmpfs", "/run", "--tmpfs", "/run/lock"]


def _minbase(suite: str) -> str:
    if suite == "bookworm":
        return ensure_image()
    name = f"gpuprov-test/driver-{suite}-minbase:1"
    if sh("docker", "image", "inspect", name, check=False).returncode == 0:
        return name
    with tempfile.TemporaryDirectory() as td:
        sh("debootstrap", "--variant=minbase", suite, td, timeout=1200)
        tar = subprocess.Popen(["tar", "-C", td, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, check=True, capture_output=True)
        tar.wait()
    return name


def kernel_image(suite: str) -> str:
    """gpuprov-test/driver-<suite>-kernel:<recipe hash>, built when missing (minutes; once per CI run)."""
    tag = hashlib.sha256(RECIPE.encode()).hexdigest()[:10]
    name = f"gpuprov-test/driver-{suite}-kernel:{tag}"
    if sh("docker", "image", "inspect", name, check=False).returncode == 0:
        return name  # (before _minbase: a cached kernel image needs no minbase image)
    return committed_image(name, _minbase(suite), "mkdir -p /etc/initramfs-tools/conf.d && printf "
                           f"'{INITRAMFS_CONF}' > /etc/initramfs-tools/conf.d/gpuprov-test-modules && "
                           "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install "
                           "-y -q --no-install-recommends " + " ".join(PREP_PACKAGES) + " && apt-get clean",
                           cmd='["/lib/systemd/systemd"]')


class KernelHost:
    """A systemd host container from the prepared image; reached through `docker exec` only."""

    def __init__(self, suite: str, role: str, cpus: str | None = None):
        """cpus: the CPUs the host may use (docker's --cpuset-cpus), so that two hosts timed side by side each have
        their own and neither's build waits on the other's."""
        self.name = f"driver-{suite}-{role}-{int(time.time() * 1000) % 10**8}"
        self.suite = suite
        sh("docker", "run", "-d", "--name", self.name, *SYSTEMD_FLAGS, *(["--cpuset-cpus", cpus] if cpus else []),
           "-v", f"{ensure_wheelhouse()}:/wh:ro", kernel_image(suite))
        self.wait_systemd()

    def wait_systemd(self, timeout: float = 90) -> str:
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            state = self.exec("systemctl is-system-running").stdout.strip()
            if state in ("running", "degraded"):
                return state
            time.sleep(1)
        raise AssertionError(f"systemd in {self.name} did not come up: {state!r}")

    def exec(self, script: str, timeout: float = 1800, check: bool = False) -> subprocess.CompletedProcess:
        return sh("docker", "exec", self.name, "bash", "-c", script, check=check, timeout=timeout)

    def kernel(self) -> str:
        return self.exec("basename $(readlink -f /vmlinuz) | sed s/^vmlinuz-//", check=True).stdout.strip()

    def install_gpuprov(self) -> None:
        # The wheelhouse is built here for this machine's Python; a host with another Python (trixie: 3.13) takes
        # the three compiled dependencies from its own archive instead.
        r = self.exec("set -e; if ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then "
                      "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                      "--no-install-recommends python3-yaml python3-markupsafe python3-charset-normalizer; fi; "
                      "python3 -m venv --system-site-packages /opt/gpuprov && "
                      "/opt/gpuprov/bin/pip install -q --no-index --find-links /wh gpuprov && "
                      "ln -sf /opt/gpuprov/bin/gpuprov /usr/local/bin/gpuprov && gpuprov --version", timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr

    def restart(self) -> None:
        sh("docker", "restart", self.name, timeout=300)
        self.wait_systemd()

    def remove(self) -> None:
        sh("docker", "rm", "-f", self.name, check=False)

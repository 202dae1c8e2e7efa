"""Fresh Debian hosts with systemd and a Debian kernel (its metapackage, without headers), for real driver installs.

The prepared image (kernel and headers already installed, systemd as PID 1) is built once per CI run per suite
and reused by the gpuprov host and the plain-apt reference host alike, so both start from the same state and the
timing comparison is fair. Its name carries a hash of the recipe below, so a changed recipe builds a new one.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
import uuid
from pathlib import Path

from tests.integration.hosts import NESTED, committed_image, debootstrap_image, ensure_image, ensure_wheelhouse, sh
from tests.shared_builds import CACHE

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
MAKE_CACHE = Path(__file__).with_name("dkms_make_cache.py")
WRAPPER_DIR = "/usr/lib/gpuprov-test/bin"  # in the hosts: the DKMS build cache's `make`, alone
DPKG_PATH_CONF = Path(__file__).with_name("dkms_make_cache.apt.conf")


def _minbase(suite: str) -> str:
    return ensure_image() if suite == "bookworm" else debootstrap_image(f"gpuprov-test/driver-{suite}-minbase:1", suite)


def kernel_image_name(suite: str) -> str:
    return f"gpuprov-test/driver-{suite}-kernel:{hashlib.sha256(RECIPE.encode()).hexdigest()[:10]}"


def kernel_image(suite: str) -> str:
    """gpuprov-test/driver-<suite>-kernel:<recipe hash>, built when missing (minutes; once per CI run)."""
    name = kernel_image_name(suite)
    if sh("docker", "image", "inspect", name, check=False).returncode == 0:
        return name  # (before _minbase: a cached kernel image needs no minbase image)
    return committed_image(name, _minbase(suite), "mkdir -p /etc/initramfs-tools/conf.d && printf "
                           f"'{INITRAMFS_CONF}' > /etc/initramfs-tools/conf.d/gpuprov-test-modules && "
                           "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install "
                           "-y -q --no-install-recommends " + " ".join(PREP_PACKAGES) + " && apt-get clean",
                           cmd='["/lib/systemd/systemd"]')


def dkms_build_cache() -> tuple[str, ...]:
    """docker run's arguments that put tests/integration/dkms_make_cache.py in a host as its `make` and the machine's
    DKMS build cache at /var/cache/gpuprov-dkms: a module built from the same inputs (source, kernel headers,
    compiler) by any host of this machine is reused, so NVIDIA's real build of each flavour, version and kernel is
    paid once per machine (issue 37). What a reuse replays and why that is the build: that file's docstring.

    The `make` goes first on every PATH a DKMS build can come from: the host's own (docker exec: gpuprov's
    `dkms autoinstall`) and apt's for dpkg (DPkg::Path, which apt sets to /usr/sbin:/usr/bin:/sbin:/bin and so
    skips /usr/local/bin: seen, every build bypassed a wrapper there), from a directory of its own so nothing else
    on it changes."""
    cache = CACHE / "dkms-builds"
    cache.mkdir(parents=True, exist_ok=True)
    return ("-v", f"{MAKE_CACHE}:{WRAPPER_DIR}/make:ro", "-v", f"{DPKG_PATH_CONF}:/etc/apt/apt.conf.d/00gpuprov-test-make:ro",
            "-e", f"PATH={WRAPPER_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "-v", f"{cache}:/var/cache/gpuprov-dkms")


def dkms_uses() -> list[dict]:
    """The DKMS build cache's log: one entry per build a host asked for (how: built or reused, module, version,
    kernel, rc, seconds)."""
    log = CACHE / "dkms-builds/uses.log"
    return [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []


class KernelHost:
    """A systemd host container from the prepared image; reached through `docker exec` only."""

    def __init__(self, suite: str, role: str, cpus: str | None = None, share_builds: bool = True):
        """cpus: the CPUs the host may use (docker's --cpuset-cpus), so that two hosts timed side by side each have
        their own and neither's build waits on the other's. share_builds: DKMS builds go through the machine's build
        cache (dkms_build_cache); a benchmark that times the build itself turns it off."""
        # unique across workers: two that wait on the same shared image build wake in the same millisecond (seen in
        # CI: `docker run --name` exit 125, the name taken)
        self.name = f"driver-{suite}-{role}-{uuid.uuid4().hex[:10]}"
        self.suite = suite
        sh("docker", "run", "-d", "--name", self.name, *SYSTEMD_FLAGS, *(["--cpuset-cpus", cpus] if cpus else []),
           "-v", f"{ensure_wheelhouse()}:/wh:ro", *(dkms_build_cache() if share_builds else ()), kernel_image(suite))
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
        # boot runs units that may build (dkms's autoinstall for a new kernel): on a loaded 2-core machine, minutes
        self.wait_systemd(timeout=360)

    def remove(self) -> None:
        sh("docker", "rm", "-f", self.name, check=False)

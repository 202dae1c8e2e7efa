"""The real driver install on Debian 13: `gpuprov bootstrap --for-gpu 10de:2330` (an H100, baked as on a CPU builder)
on a fresh systemd trixie host with trixie's kernel and no headers (the helpers: driver_checks.py).

Debian 13: the same install, or, while trixie's open module does not build against trixie's kernel, the honest
failure: exit 16 naming package, kernel and the compiler's first error line, dpkg consistent, the ways out.

Slow (NVIDIA's DKMS build of trixie's open module): marked `slow`, run in CI.
"""
from __future__ import annotations

import re

import pytest

from tests.integration.driver_checks import BOOT, MARKS, host, left_consistent, timed

pytestmark = MARKS


@pytest.fixture(scope="module")
def trixie():
    yield from host("trixie")


def test_trixie_open_module_built_or_failure_met_honestly(trixie):
    h = trixie
    k = h.kernel()
    r, took = timed(h, BOOT)
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


def test_trixie_host_left_consistent(trixie):
    left_consistent(trixie)

"""A refused run changes nothing, on Ubuntu (issue 43 item 4): through real apt and dpkg behind Ubuntu 22.04's release
files (tests/integration/ubuntu_hosts.py), its stand-in archive served as the site's mirror, multiverse off in the
host's sources (so the plan edits sources.list):
1. The mirror has no 550 series: `--driver 550`. Before, bootstrap exited 5 ("Unable to locate package
   nvidia-headless-550-server-open") after editing sources.list and writing the nouveau blacklist, and
   `bootstrap --check` exited 0. Now the preflight's dry run, in a scratch configuration holding the plan's sources,
   stops with exit 4 (no package for this host) before the first change: /etc/apt, /etc/modprobe.d and dpkg's
   package list as they were; `bootstrap --check` and `--dry-run` (install.sh --dry-run) exit 4 too.
2. A package of the transaction has an unsatisfiable dependency (an operator's source offers a newer
   nvidia-utils-580-server that depends on a package no source has): exit 5 before the first change, `--check` 5.
3. That source gone, the run installs, and says what its preflight cost (docs/PROOFS.md).
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import needs
from tests.integration.ubuntu_hosts import UbuntuHost

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
ARGS = "--for-gpu 10de:2330 --engine none --no-validate"
SNAPSHOT = ("find /etc/apt /etc/modprobe.d /usr/share/keyrings -type f -exec sha256sum {} + | sort; "
            "find /etc/apt /etc/modprobe.d -printf '%p %m %u\\n' | sort; "
            "dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n' | sort; "
            "ls /var/lib/gpuprov 2>/dev/null; true")
# an operator's own source: a flat repository with a newer nvidia-utils-580-server that no source can satisfy
BROKEN = r"""set -e
mkdir -p /tmp/bad/DEBIAN /srv/operator
printf '%s\n' 'Package: nvidia-utils-580-server' 'Version: 999.0-1' 'Architecture: amd64' \
  'Maintainer: op <op@invalid>' 'Depends: libgpuprov-missing1' 'Description: an operator rebuild' \
  > /tmp/bad/DEBIAN/control
dpkg-deb -b /tmp/bad /srv/operator/nvidia-utils-580-server_999.0-1_amd64.deb >/dev/null
cd /srv/operator && apt-ftparchive packages . > Packages
echo 'deb [trusted=yes] file:/srv/operator ./' > /etc/apt/sources.list.d/operator.list
apt-get update -qq
"""


@pytest.fixture(scope="module")
def host():
    h = UbuntuHost("22.04")
    try:
        h.install_gpuprov()
        yield h
    finally:
        h.remove()


def snapshot(host) -> str:
    return host.exec(SNAPSHOT, check=True).stdout


def _out(r) -> str:
    return r.stdout[-3000:] + r.stderr[-3000:]


def test_mirror_without_the_series_stops_with_4_before_any_change(host):
    before = snapshot(host)
    r = host.exec(f"gpuprov bootstrap --yes --driver 550 {ARGS}")
    assert r.returncode == 4, _out(r)  # on the starting commit: 5, after sources.list and the blacklist were written
    said = " ".join(r.stderr.split())
    assert "no repository offers nvidia-headless-550-server-open" in said and "nothing was changed" in said, said
    assert snapshot(host) == before
    check = host.exec(f"gpuprov bootstrap --check --driver 550 {ARGS}")
    assert check.returncode == 4 and "nvidia-headless-550-server-open" in check.stderr, _out(check)  # before: 0
    dry = host.exec(f"gpuprov bootstrap --dry-run --driver 550 {ARGS}")
    assert dry.returncode == 4 and "preflight: step driver.packages would stop the run (exit 4)" in dry.stdout, \
        _out(dry)
    assert snapshot(host) == before


def test_unsatisfiable_dependency_stops_with_5_before_any_change(host):
    host.exec(BROKEN, check=True)
    before = snapshot(host)
    r = host.exec(f"gpuprov bootstrap --yes {ARGS}")
    assert r.returncode == 5, _out(r)
    said = " ".join(r.stderr.split())
    assert "libgpuprov-missing1" in said and "nothing was changed" in said, said
    assert snapshot(host) == before
    check = host.exec(f"gpuprov bootstrap --check {ARGS}")
    assert check.returncode == 5 and "libgpuprov-missing1" in check.stderr, _out(check)  # before: 0


def test_the_run_installs_and_the_preflight_is_cheap(host):
    host.exec("rm /etc/apt/sources.list.d/operator.list && apt-get update -qq", check=True)
    r = host.exec(f"gpuprov bootstrap --yes {ARGS}")
    assert r.returncode in (0, 7), _out(r)
    assert "nvidia-utils-580-server" in host.debs(), host.debs()
    m = re.search(r"preflight: (\d+) dry run\(s\) with the repositories the plan adds resolve \(([\d.]+)s\)", r.stderr)
    assert m, r.stderr[-3000:]
    print(f"Ubuntu preflight on a run that installs: {m.group(1)} dry runs, {m.group(2)} s")
    assert float(m.group(2)) < 30

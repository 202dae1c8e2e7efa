"""A refused run changes nothing, on EL (issue 39 item 2): through real dnf 4.14 and rpm 4.18 (tests/integration/
el_hosts.py), a fresh Rocky 9 host whose boot kernel is 9.6's, and a stand-in ELRepo mirror (--mirror elrepo=...):
1. The mirror lags: it carries ELRepo's builds for 9.5 only. Before, bootstrap exited 4 saying "nothing was changed"
   after it had installed elrepo-release, imported ELRepo's key, written elrepo.repo and the nouveau blacklist, and
   `bootstrap --check` exited 0. Now the preflight asks "is this build offered" in a scratch configuration holding the
   repositories the plan adds: exit 4 before the first change, the host's repository files, keys, modprobe.d and rpm
   database as they were; `bootstrap --check` and `--dry-run` (install.sh --dry-run) exit 4 too.
2. The mirror carries the 9.6 build, but not the nvidia-x11-drv-libs it requires: exit 5 from the preflight's dry
   run, the host as it was, `bootstrap --check` 5.
3. The mirror complete: the run installs, and says what its preflight cost (reported in docs/PROOFS.md).
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, url

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
ARGS = f"--for-gpu 10de:2330 --engine none --no-validate --mirror elrepo={url('elrepo')}"
ELREPO = "elrepo/linux/elrepo/el9/x86_64"
MINOR = "5.14.0-570.12.1.el9_6.x86_64"
# what a refused run must leave byte for byte: repository files, keys (files and rpm's gpg-pubkey), dnf's config and
# plugins, modprobe.d, and the rpm database's package list
SNAPSHOT = ("find /etc/yum.repos.d /etc/pki/rpm-gpg /etc/dnf /etc/modprobe.d /etc/rpm -type f -exec sha256sum {} + "
            "| sort; find /etc/yum.repos.d /etc/pki/rpm-gpg /etc/dnf /etc/modprobe.d -printf '%p %m %u\\n' | sort; "
            "rpm -qa | sort; ls /var/lib/gpuprov 2>/dev/null; true")


@pytest.fixture(scope="module")
def host():
    h = ElHost("9")
    try:
        h.install_gpuprov()
        h.publish_later("rocky/9/BaseOS/x86_64/os", "later-minor")  # 9.6's kernel offered; ELRepo's mirror: 9.5's
        h.exec("dnf install -y -q kernel", check=True)
        assert h.exec("rpm -q kernel-core").stdout.strip() == f"kernel-core-{MINOR}"
        yield h
    finally:
        h.remove()


def snapshot(host) -> str:
    return host.exec(SNAPSHOT, check=True).stdout


def _out(r) -> str:
    return r.stdout[-3000:] + r.stderr[-3000:]


def test_lagging_mirror_stops_with_4_before_any_change(host):
    before = snapshot(host)
    r = host.exec(f"gpuprov bootstrap --yes {ARGS}")
    assert r.returncode == 4, _out(r)
    said = " ".join(r.stderr.split())
    assert f"ELRepo offers no build of kmod-nvidia-open for kernel {MINOR}'s minor release (el9_6) yet: nothing " \
           "was changed" in said, said
    assert snapshot(host) == before  # on the starting commit: elrepo-release, its key, elrepo.repo, the blacklist
    check = host.exec(f"gpuprov bootstrap --check {ARGS}")
    assert check.returncode == 4 and "ELRepo offers no build" in check.stderr, _out(check)  # before: 0
    plan = host.exec(f"gpuprov bootstrap --dry-run {ARGS}")  # what `install.sh --dry-run` runs; `plan` alike
    assert plan.returncode == 4 and "preflight: step driver.packages would stop the run (exit 4)" in plan.stdout, \
        _out(plan)
    assert snapshot(host) == before


def test_unsatisfiable_dependency_stops_with_5_before_any_change(host):
    # the mirror syncs 9.6's build, but without the libraries package it requires
    host.publish_later(ELREPO, "later-minor")
    host.exec(f"set -e; rm /srv/www/{ELREPO}/nvidia-x11-drv-libs-570.172.08*.rpm; "
              f"createrepo_c -q --update /srv/www/{ELREPO}; dnf clean all -q", check=True)
    before = snapshot(host)
    r = host.exec(f"gpuprov bootstrap --yes {ARGS}")
    assert r.returncode == 5, _out(r)
    said = " ".join(r.stderr.split())
    assert "nvidia-x11-drv-libs" in said and "nothing was changed" in said, said
    assert snapshot(host) == before
    check = host.exec(f"gpuprov bootstrap --check {ARGS}")
    assert check.returncode == 5 and "nvidia-x11-drv-libs" in check.stderr, _out(check)


def test_complete_mirror_installs_and_the_preflight_is_cheap(host):
    host.exec(f"set -e; cp /srv/repos/later-minor/{ELREPO}/nvidia-x11-drv-libs-570.172.08*.rpm /srv/www/{ELREPO}/; "
              f"createrepo_c -q --update /srv/www/{ELREPO}; dnf clean all -q", check=True)
    r = host.exec(f"gpuprov bootstrap --yes {ARGS}")
    assert r.returncode in (0, 7), _out(r)
    assert host.rpms()["kmod-nvidia-open"].endswith(":570.172.08-1.el9_6.elrepo"), host.rpms()
    m = re.search(r"preflight: (\d+) dry run\(s\) with the repositories the plan adds resolve \(([\d.]+)s\)", r.stderr)
    assert m, r.stderr[-3000:]
    print(f"EL preflight on a run that installs: {m.group(1)} dry runs, {m.group(2)} s")
    assert float(m.group(2)) < 30

"""ELRepo's kmods and the minor releases' kernels, through real dnf 4.14 and rpm (tests/integration/el_hosts.py).
ELRepo builds each kmod for one minor release's kernel and requires it; weak-modules links it into the other kernels
of that minor release only (tests/fixtures/el-repos: 570.144-1.el9_5.elrepo for Rocky 9.5's 5.14.0-503.14.1.el9_5,
570.172.08-1.el9_6.elrepo for 9.6's 5.14.0-570.12.1.el9_6). One Rocky 9.5 host through three stages:
1. ELRepo carries the 9.6 build, the host's repositories no 9.6 kernel (an EUS host): before this change dnf's
   best=True failed the install ("nothing provides kernel >= …", exit 5) after the ELRepo step had changed the host.
   Now the build for the installed kernel's minor release (570.144, el9_5), asked for by its version, and the plan
   says so.
2. The 9.6 kernel offered: before, dnf installed it in the driver's transaction and the plan said nothing. Now the
   kernel stays the operator's.
3. The operator's `dnf upgrade` brings 9.6's kernel; gpuprov's lock keeps the 9.5 kmod, which weak-modules does not
   link into it: it would boot without a module (verify exit 10). Before, bootstrap changed nothing (the packages
   were installed); now it moves the kmod to the 9.6 build past the lock for that one transaction (no kernel
   touched), proves the module is there for that kernel, and the hold step renews the lock; verify passes; after the
   reboot a re-run changes nothing. While the site's ELRepo mirror lacks the 9.6 build, bootstrap stops with exit 4
   before anything changes, the kmod and its lock list as they were.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, url

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
DRIVER = (f"gpuprov bootstrap --yes --for-gpu 10de:2330 --engine none --no-validate "
          f"--mirror elrepo={url('elrepo')}")
KERNEL, MINOR = "5.14.0-503.14.1.el9_5.x86_64", "5.14.0-570.12.1.el9_6.x86_64"
ELREPO = "elrepo/linux/elrepo/el9/x86_64"


@pytest.fixture(scope="module")
def host():
    h = ElHost("9")
    try:
        h.install_gpuprov()
        h.exec("dnf install -y -q kernel", check=True)  # the operator's server before gpuprov
        for group in ("later", "later-minor"):  # ELRepo's tree as it is today: 570.144, and 570.172.08 for 9.6
            h.publish_later(ELREPO, group)
        yield h
    finally:
        h.remove()


def kernels(host) -> list[str]:
    return host.exec("rpm -q kernel-core").stdout.split()


def kmod(host) -> str:
    return host.rpms()["kmod-nvidia-open"]


def locks(host) -> list[str]:
    """The versionlock list's entries, sorted."""
    return sorted(ln for ln in host.exec("cat /etc/dnf/plugins/versionlock.list").stdout.splitlines()
                  if ln.strip() and not ln.startswith("#"))


def next_boot(host) -> tuple[int, dict]:
    r = host.exec("gpuprov verify --json")
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}["next-boot kernel module"]


def test_no_newer_kernel_offered_the_build_for_the_installed_kernel(host):
    plan = host.exec(DRIVER.replace("bootstrap --yes", "bootstrap --dry-run"))
    assert "ELRepo's build for kernel " + KERNEL + "'s minor release: el9_5" in " ".join(plan.stdout.split()), \
        plan.stdout
    r = host.exec(DRIVER)
    assert r.returncode in (0, 7), r.stdout[-3000:] + r.stderr[-3000:]
    assert kmod(host).endswith(":570.144-1.el9_5.elrepo"), host.rpms()
    assert kernels(host) == [f"kernel-core-{KERNEL}"], kernels(host)


def test_newer_kernel_offered_is_not_pulled_in(host):
    r = host.exec("gpuprov uninstall --yes --purge-driver")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    host.publish_later("rocky/9/BaseOS/x86_64/os", "later-minor")  # 9.6's kernel is offered
    offered = host.exec("dnf --refresh list --available kernel-core").stdout
    assert "570.12.1" in offered, offered
    r = host.exec(DRIVER)
    assert r.returncode in (0, 7), r.stdout[-3000:] + r.stderr[-3000:]
    assert kmod(host).endswith(":570.144-1.el9_5.elrepo"), host.rpms()
    assert kernels(host) == [f"kernel-core-{KERNEL}"], kernels(host)  # on the previous commit: 9.6's beside it


def test_the_kmod_follows_the_next_minor_releases_kernel(host):
    host.reboot()
    assert host.exec(DRIVER).returncode == 15  # the resume after the install's reboot: no device to verify on
    up = host.exec("dnf upgrade -y 2>&1")
    assert up.returncode == 0, up.stdout[-3000:]
    assert f"kernel-core-{MINOR}" in kernels(host) and kmod(host).endswith(":570.144-1.el9_5.elrepo")
    assert host.exec(f"ls /lib/modules/{MINOR}/weak-updates/nvidia/nvidia.ko").returncode != 0  # another kABI
    rc, check = next_boot(host)
    assert rc == 10 and check["status"] == "fail" and MINOR in check["detail"], check
    plan = host.exec(DRIVER.replace("bootstrap --yes", "bootstrap --dry-run"))
    assert f"Move ELRepo's kmod to its build for kernel {MINOR}" in " ".join(plan.stdout.split()), plan.stdout
    # the site's ELRepo mirror has not synced the 9.6 build yet: exit 4 before anything changes (the newer 9.5 build
    # is not taken instead, the lock list is not touched)
    locked = locks(host)
    host.exec(f"rm /srv/www/{ELREPO}/*el9_6*.rpm && createrepo_c -q --update /srv/www/{ELREPO} && "
              "dnf makecache -q --refresh", check=True)
    r = host.exec(DRIVER)
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    assert (f"ELRepo offers no build of kmod-nvidia-open for kernel {MINOR}'s minor release (el9_6) yet: nothing was "
            "changed") in " ".join(r.stderr.split()), r.stderr[-3000:]
    assert kmod(host).endswith(":570.144-1.el9_5.elrepo") and locks(host) == locked, (host.rpms(), locks(host))
    host.publish_later(ELREPO, "later-minor")  # the mirror syncs
    host.exec("dnf makecache -q --refresh", check=True)
    before = kernels(host)
    r = host.exec(DRIVER + " --json")
    assert r.returncode in (0, 7), r.stdout[-3000:] + r.stderr[-3000:]
    assert kmod(host).endswith(":570.172.08-1.el9_6.elrepo"), host.rpms()
    assert host.rpms()["nvidia-x11-drv"].endswith(":570.172.08-1.el9_6.elrepo"), host.rpms()
    assert kernels(host) == before  # no kernel installed or removed
    assert host.exec(f"test -f /lib/modules/{MINOR}/extra/nvidia/nvidia.ko").returncode == 0
    rc, check = next_boot(host)
    assert check["status"] == "pass" and MINOR in check["detail"], check
    assert "kmod-nvidia-open-0:570.172.08-1.el9_6.elrepo.*" in locks(host), locks(host)
    assert not any("570.144" in ln for ln in locks(host)), locks(host)
    host.reboot()
    assert host.exec(DRIVER).returncode == 15
    r = host.exec(DRIVER + " --json")
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] == 0, r.stdout[-3000:] + r.stderr[-3000:]

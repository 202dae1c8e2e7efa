"""Ubuntu day two on a running GPU node (issue 43 items 1 and 2), through real apt, dpkg, DKMS and unattended-upgrades
behind Ubuntu 22.04/24.04's release files (tests/integration/ubuntu_hosts.py: the stand-in archive, an H200 on the PCI
bus, the running kernel). No --for-gpu: the hosts decide for the GPU they see, and show its driver loaded (what is
faked: /proc/driver/nvidia/version and `nvidia-smi -L`; UbuntuHost.load_driver).

22.04 with linux-generic, one node through its stages, in order:
1. bootstrap --driver 570: Canonical's precompiled modules for the running kernel (5.15.0-91); after the reboot, with
   570 loaded, a second run is "left alone" and changes nothing.
2. The archive's -updates gets 5.15.0-131 without its precompiled modules (Canonical publishes them days later); the
   real `unattended-upgrade` installs the kernel (exit 0), verify is red naming it. bootstrap, without --driver,
   adds the same series' DKMS flavour for 5.15.0-131 (Canonical's module stays for 5.15.0-91), the plan says why;
   verify's next-boot check is green. (On main: "left alone", 0 changes, verify still red.)
   Before that, its DKMS build fails (the kernel's headers broken): the default boot entry stays on 5.15.0-91 (GRUB's
   own update-grub, with gpuprov's drop-in), verify warns of it, a re-run changes nothing more, `gpuprov uninstall`
   gives the entry back; once the headers are repaired, the bootstrap that builds the module gives it back too.
3. After the reboot into 5.15.0-131: left alone. Then Canonical publishes its modules for 5.15.0-131: the next
   bootstrap moves back to them, DKMS removed in the same transaction.
4. --driver 580 with 570 loaded: the branch change is planned and done (on main: "left alone", exit 0), the plan
   naming the reboot; --kernel-modules proprietary likewise planned.

22.04 with the HWE kernel (linux-generic-hwe-22.04 at 6.8.0-49, precompiled, loaded): `apt-get full-upgrade` brings
6.8.0-51, which has no precompiled modules; bootstrap adds DKMS for it. 24.04 (linux-generic): an ABI bump (6.8.0-52)
without precompiled modules through `apt-get full-upgrade`, the same.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.conftest import needs
from tests.integration.ubuntu_hosts import GRUB_UUID, UbuntuHost

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
BOOT = "gpuprov bootstrap --yes --engine none --no-validate"
PIN = "/etc/apt/preferences.d/gpuprov-nvidia"
K91, K131 = "5.15.0-91-generic", "5.15.0-131-generic"
LRM = "linux-modules-nvidia-570-server-open-"
NEXT_BOOT = "next-boot kernel module"
BOOT_DEFAULT = "default boot entry"
DROP_IN = "/etc/default/grub.d/gpuprov-boot.cfg"
ENTRY = "gnulinux-advanced-{u}>gnulinux-{k}-advanced-{u}"  # grub-mkconfig's 10_linux names its entries so
# the real unattended-upgrades, allowed the -updates suite as an Ubuntu server's 50unattended-upgrades allows it
UU_CONF = 'Unattended-Upgrade::Origins-Pattern { "origin=Ubuntu,archive=jammy-updates"; };\n'


def _out(r) -> str:
    return r.stdout[-5000:] + r.stderr[-3000:]


def _checks(h) -> tuple[int, dict]:
    """`gpuprov verify --json`: its exit code and its checks by name."""
    r = h.exec("gpuprov verify --json")
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}


def _next_boot(h) -> tuple[int, dict]:
    """`gpuprov verify --json`: its exit code and the next-boot kernel module check."""
    rc, checks = _checks(h)
    return rc, checks[NEXT_BOOT]


def _step(h, extra: str = "") -> dict:
    """The driver step `gpuprov plan` shows (driver.packages, or the verify-only one)."""
    r = h.exec(f"gpuprov plan --engine none --json {extra}")
    assert r.returncode == 0, _out(r)
    return next(s for s in json.loads(r.stdout)["steps"] if s["id"] in ("driver.packages", "driver.present"))


def _module(h, kernel: str) -> str:
    return h.exec(f"modinfo -k {kernel} -F filename nvidia").stdout.strip()


def _left_alone(h, r) -> None:
    assert r.returncode == 0, _out(r)
    assert "left alone" in r.stderr and re.match(r"bootstrap: 0 change", r.stdout), _out(r)


# Ubuntu 22.04's stock sources.list layout: multiverse on lines of its own (issue 43 item 3)
STOCK = "".join(f"deb http://127.0.0.1:8090/ubuntu {suite} {comps}\n" for suite in ("jammy", "jammy-updates")
                for comps in ("main restricted", "universe", "multiverse"))


@pytest.fixture(scope="module")
def node():
    h = UbuntuHost("22.04", running=K91)
    try:
        h.write("/etc/apt/sources.list", STOCK)
        h.exec("apt-get update -q", check=True)
        h.install_gpuprov()
        h.grub()  # GRUB_DEFAULT=0: the newest kernel boots
        h.config_before = h.pm_config()
        yield h
    finally:
        h.remove()


@pytest.fixture(scope="module")
def loaded(node):
    r = node.exec(f"{BOOT} --driver 570")
    assert r.returncode == 7, _out(r)
    assert {f"{LRM}generic", f"{LRM}{K91}", "nvidia-headless-no-dkms-570-server-open"} <= node.debs().keys()
    node.reboot()
    node.load_driver("570.195.03")
    return node


def test_stock_sources_get_no_component_appended(loaded):
    """Issue 43 item 3: every component is on a line of each suite already; on the commit before, bootstrap appended
    multiverse to the `main restricted` lines and left a sources.list.gpuprov-*.bak."""
    assert loaded.exec("cat /etc/apt/sources.list").stdout == STOCK
    assert loaded.exec("ls /etc/apt | grep -c gpuprov").stdout.strip() == "0"


def test_loaded_and_nothing_asked_differs_left_alone(loaded):
    before = loaded.debs()
    r = loaded.exec(f"{BOOT} --driver 570")  # the resume (the module loaded, nvidia-smi -L), then the plan
    _left_alone(loaded, r)
    _left_alone(loaded, loaded.exec(BOOT))  # without --driver: the series gpuprov installed, loaded
    assert loaded.debs() == before


@pytest.fixture(scope="module")
def abi_bump(loaded):
    loaded.publish_updates("abi")
    loaded.write("/etc/apt/apt.conf.d/51gpuprov-test", UU_CONF)
    r = loaded.exec("apt-get update -q && unattended-upgrade -v 2>&1; echo rc=$?")
    loaded.update_grub()  # what the kernel's zz-update-grub hook does on a machine (it skips containers)
    return r


def test_unattended_upgrade_brings_a_kernel_without_precompiled_modules(loaded, abi_bump):
    assert abi_bump.stdout.rstrip().endswith("rc=0"), abi_bump.stdout[-4000:]
    debs = loaded.debs()
    assert f"linux-image-{K131}" in debs and f"linux-headers-{K131}" in debs, sorted(debs)
    assert f"{LRM}{K131}" not in debs and loaded.kernel() == K131
    assert loaded.exec("dpkg --audit").stdout == ""
    rc, check = _next_boot(loaded)
    assert rc == 10 and check["status"] == "fail" and f"kernel {K131} boots next" in check["detail"], check


def test_dkms_failure_keeps_the_default_boot_entry(loaded, abi_bump):
    """Issue 43 item 1: DKMS cannot build for 5.15.0-131 either (its headers broken: /lib/modules/K/build gone).
    bootstrap stops with exit 16 as before, and the default boot entry stays on 5.15.0-91, which has Canonical's
    module: gpuprov's drop-in sets GRUB_DEFAULT to its entry and GRUB's update-grub writes grub.cfg; the operator's
    /etc/default/grub is untouched. On the commit before, the node booted 5.15.0-131 without a module."""
    assert loaded.grub_default() == "0"
    operator = loaded.exec("cat /etc/default/grub").stdout
    loaded.exec(f"mv /lib/modules/{K131}/build /root/headers-{K131}", check=True)
    entry = ENTRY.format(u=GRUB_UUID, k=K91)
    step = _step(loaded)  # said before the first change
    assert (f"if DKMS cannot build for {K131}: the default boot entry stays on {K91} ({DROP_IN} sets GRUB_DEFAULT; "
            "update-grub)") in step["notes"], step["notes"]
    assert step["on_failure"][-1] == "/usr/sbin/update-grub", step["on_failure"]
    before = loaded.debs()
    r = loaded.exec(BOOT)
    assert r.returncode == 16, _out(r)
    assert f"the default boot entry stays on {K91} until {K131} has an nvidia module" in r.stderr, _out(r)
    assert loaded.debs() == before  # the DKMS flavour it added purged again
    assert f"GRUB_DEFAULT='{entry}'" in loaded.exec(f"cat {DROP_IN}").stdout
    assert loaded.grub_default() == entry
    assert loaded.exec("cat /etc/default/grub").stdout == operator
    assert loaded.exec(f"cat /var/lib/gpuprov/dkms-failed/{K131}").returncode == 0
    _, checks = _checks(loaded)
    assert checks[NEXT_BOOT]["status"] == "pass" and checks[NEXT_BOOT]["detail"].startswith(f"{K91} boots next"), \
        checks[NEXT_BOOT]
    assert checks[BOOT_DEFAULT]["status"] == "warn", checks[BOOT_DEFAULT]
    assert checks[BOOT_DEFAULT]["detail"].startswith(f"kept on {K91} by gpuprov ({DROP_IN} sets GRUB_DEFAULT): "
                                                     f"kernel {K131} has no NVIDIA module"), checks[BOOT_DEFAULT]
    # a re-run: the same stop, nothing more changed (grub.cfg as update-grub wrote it)
    cfg = loaded.exec("stat -c %Y /boot/grub/grub.cfg; md5sum /boot/grub/grub.cfg").stdout
    assert loaded.exec(BOOT).returncode == 16
    assert loaded.exec("stat -c %Y /boot/grub/grub.cfg; md5sum /boot/grub/grub.cfg").stdout == cfg
    # uninstall gives the entry back (the driver stays: no --purge-driver)
    r = loaded.exec("gpuprov uninstall --yes")
    assert r.returncode == 0, _out(r)
    assert loaded.exec(f"test -e {DROP_IN}").returncode == 1 and loaded.grub_default() == "0"
    assert loaded.debs() == before
    # kept again by the next failing bootstrap; the headers repaired, the next test's bootstrap builds the module
    assert loaded.exec(BOOT).returncode == 16 and loaded.grub_default() == entry
    loaded.exec(f"mv /root/headers-{K131} /lib/modules/{K131}/build", check=True)


def test_bootstrap_adds_dkms_for_the_kernel_canonical_has_not_served(loaded, abi_bump):
    step = _step(loaded)  # no --driver: the series gpuprov installed and pinned, not the newest branch
    assert step["id"] == "driver.packages", step
    assert step["title"].startswith(f"Add DKMS to the driver's series for kernel {K131}, which Canonical has no "
                                    "precompiled module for yet: nvidia-headless-570-server-open"), step["title"]
    why = next(n for n in step["notes"] if n.startswith("kernel module: "))
    assert f"the archive has no {LRM}{K131}" in why and f"precompiled modules stay for {K91}" in why, why
    before = loaded.debs()
    r = loaded.exec(BOOT)
    assert r.returncode == 7, _out(r)  # the module loads at the next boot
    after = loaded.debs()
    assert {p for p in before if p not in after} == set(), "a package was removed"
    assert {"nvidia-headless-570-server-open", "nvidia-dkms-570-server-open"} <= after.keys()
    assert not [p for p in after if "580" in p], sorted(after)
    assert _module(loaded, K131) == f"/lib/modules/{K131}/updates/dkms/nvidia.ko"
    assert loaded.exec(f"modinfo -k {K131} -F version nvidia").stdout.strip() == "570.195.03"
    assert _module(loaded, K91) == f"/lib/modules/{K91}/kernel/nvidia-570srv-open/nvidia.ko"  # Canonical's, kept
    assert loaded.exec("dpkg --audit").stdout == ""
    _, checks = _checks(loaded)
    assert checks[NEXT_BOOT]["status"] == "pass" and K131 in checks[NEXT_BOOT]["detail"], checks[NEXT_BOOT]
    assert "Pin: version 570.*" in loaded.exec(f"cat {PIN}").stdout
    # the module built: the default boot entry is the distribution's again (test_dkms_failure_keeps_… kept it)
    assert loaded.exec(f"test -e {DROP_IN}").returncode == 1 and loaded.grub_default() == "0"
    assert checks[BOOT_DEFAULT]["status"] == "skip", checks[BOOT_DEFAULT]
    assert loaded.exec(f"test -e /var/lib/gpuprov/dkms-failed/{K131}").returncode == 1


def test_precompiled_modules_published_later_move_it_back(loaded, abi_bump):
    loaded.running = K131
    loaded.reboot()
    before = loaded.debs()
    _left_alone(loaded, loaded.exec(BOOT))  # running 5.15.0-131 with DKMS's module: nothing to do
    assert loaded.debs() == before
    loaded.publish_updates("abi-lrm")
    loaded.exec("apt-get update -q", check=True)  # apt's daily lists refresh
    step = _step(loaded)
    assert step["title"].startswith("Move the driver's kernel module back to Canonical's precompiled modules"), step
    r = loaded.exec(BOOT)
    assert r.returncode == 7, _out(r)
    after = loaded.debs()
    assert {p for p in before if p not in after} == {"nvidia-headless-570-server-open", "nvidia-dkms-570-server-open"}
    assert {f"{LRM}{K131}", f"{LRM}{K91}", f"{LRM}generic"} <= after.keys()
    for k in (K91, K131):
        assert _module(loaded, k) == f"/lib/modules/{k}/kernel/nvidia-570srv-open/nvidia.ko", k
    assert loaded.exec("dkms status").stdout.strip() == ""
    assert loaded.exec("dpkg --audit").stdout == ""
    _, check = _next_boot(loaded)
    assert check["status"] == "pass", check


def test_driver_branch_asked_with_another_loaded_is_done(loaded, abi_bump):
    loaded.reboot()
    before = loaded.debs()
    _left_alone(loaded, loaded.exec(BOOT))
    assert loaded.debs() == before
    flavour = _step(loaded, "--kernel-modules proprietary")  # planned, not left alone (not applied here)
    assert flavour["title"].startswith("Replace the driver nvidia-headless-no-dkms-570-server-open 570.195.03 with "
                                       "linux-modules-nvidia-570-server-generic "), flavour["title"]
    assert "nvidia-headless-no-dkms-570-server " in flavour["title"]
    step = _step(loaded, "--driver 580")
    assert step["title"].startswith("Replace the driver nvidia-headless-no-dkms-570-server-open 570.195.03 with "
                                    "linux-modules-nvidia-580-server-open-generic "), step["title"]
    assert any(n.startswith("reboot: driver nvidia-headless-no-dkms-570-server-open 570.195.03 replaced")
               for n in step["notes"]), step["notes"]
    r = loaded.exec(f"{BOOT} --driver 580")
    assert r.returncode == 7, _out(r)
    after = loaded.debs()
    # but Canonical's objects packages, which depend on nothing (uninstall takes them: the test below)
    assert not [p for p in after if "570" in p and not p.startswith("linux-objects-")], sorted(after)
    assert {"nvidia-headless-no-dkms-580-server-open", f"linux-modules-nvidia-580-server-open-{K131}",
            f"linux-modules-nvidia-580-server-open-{K91}"} <= after.keys(), sorted(after)
    for k in (K91, K131):
        assert loaded.exec(f"modinfo -k {k} -F version nvidia").stdout.strip() == "580.95.05", k
    assert "Pin: version 580.*" in loaded.exec(f"cat {PIN}").stdout
    assert loaded.exec("dpkg --audit").stdout == ""


def test_uninstall_takes_every_kernels_modules(loaded, abi_bump):
    """Issue 43 item 3, after the stages above (Canonical's modules for two kernels, DKMS in between, a branch change
    that left 570's objects): `uninstall --purge-driver` leaves no NVIDIA package and no kernel's modules.dep listing
    an NVIDIA module; apt's configuration is as before gpuprov. On the commit before, linux-objects-nvidia-570-*
    (and the 580 series' dependencies) stayed."""
    r = loaded.exec("gpuprov uninstall --yes --purge-driver")
    assert r.returncode == 0, _out(r)
    debs = loaded.debs()
    assert not [p for p in debs if "nvidia" in p], sorted(p for p in debs if "nvidia" in p)
    assert {f"linux-image-{K91}", f"linux-image-{K131}"} <= debs.keys()
    assert loaded.exec("grep -l nvidia /lib/modules/*/modules.dep").stdout == ""
    assert loaded.pm_config() == loaded.config_before, loaded.pm_config()
    assert loaded.exec("dpkg --audit").stdout == ""


# ---------------------------------------------------------------- the HWE kernel; 24.04


KHWE, KHWE_NEXT = "6.8.0-49-generic", "6.8.0-51-generic"
HWE_49 = " ".join(f"{p}=6.8.0-49.49~22.04.1" for p in
                  ("linux-generic-hwe-22.04", "linux-image-generic-hwe-22.04", "linux-headers-generic-hwe-22.04"))


def _day_two(h, kernel_before: str, kernel_after: str, upgrade: str, lrm: str, version: str,
             stage: str | None = None) -> None:
    """Installed with Canonical's modules and loaded; `upgrade` (after the archive's `stage` is published) brings
    `kernel_after`, which has none: bootstrap (no --driver) adds DKMS for it, Canonical's module kept for
    `kernel_before`."""
    r = h.exec(BOOT)
    assert r.returncode == 7, _out(r)
    assert f"{lrm}{kernel_before}" in h.debs()
    h.reboot()
    h.load_driver(version)
    _left_alone(h, h.exec(BOOT))
    if stage:
        h.publish_updates(stage)
    r = h.exec(upgrade)
    assert r.returncode == 0 and h.kernel() == kernel_after, _out(r)
    assert f"{lrm}{kernel_after}" not in h.debs()
    rc, check = _next_boot(h)
    assert rc == 10 and f"kernel {kernel_after} boots next" in check["detail"], check
    before = h.debs()
    r = h.exec(BOOT)
    assert r.returncode == 7, _out(r)
    after = h.debs()
    assert not [p for p in before if p not in after], "a package was removed"
    assert _module(h, kernel_after) == f"/lib/modules/{kernel_after}/updates/dkms/nvidia.ko"
    assert h.exec(f"modinfo -k {kernel_after} -F version nvidia").stdout.strip() == version
    assert "/kernel/nvidia-" in _module(h, kernel_before)
    assert h.exec("dpkg --audit").stdout == ""
    _, check = _next_boot(h)
    assert check["status"] == "pass", check


def test_hwe_kernel_without_precompiled_modules_on_a_running_node():
    """22.04's HWE kernel (the driver auto-chosen: 580-server-open)."""
    h = UbuntuHost("22.04", kernel_meta=HWE_49, running=KHWE)
    try:
        h.install_gpuprov()
        _day_two(h, KHWE, KHWE_NEXT, "DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q",
                 "linux-modules-nvidia-580-server-open-", "580.95.05")
    finally:
        h.remove()


def test_noble_abi_bump_without_precompiled_modules_on_a_running_node():
    h = UbuntuHost("24.04", running="6.8.0-49-generic")
    try:
        h.install_gpuprov()
        _day_two(h, "6.8.0-49-generic", "6.8.0-52-generic",  # -updates: 6.8.0-52 without its precompiled modules
                 "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q",
                 "linux-modules-nvidia-580-server-open-", "580.95.05", stage="abi")
    finally:
        h.remove()

"""Ubuntu through apt: `gpuprov bootstrap` on Ubuntu 22.04 and 24.04 host containers (tests/integration/ubuntu_hosts.py:
Debian's apt and dpkg behind Ubuntu's identity files), against a stand-in Ubuntu archive (tests/fixtures/ubuntu-archive,
built with dpkg-deb and apt-ftparchive, signed) served on loopback as a site's mirror of the archive. The hosts have no
network. What is stand-in: the packages' payloads (kernels, modules, libraries) and the DKMS build's compiler step.
What is real: apt's resolution and transactions, pins, Conflicts/Provides/Replaces, maintainer scripts, the kernel
hooks (run-parts of /etc/kernel/*.d), initramfs-tools, DKMS's add/build/install/autoinstall, depmod and modinfo.

22.04 (linux-generic; the archive carries precompiled modules for it), one host through its stages, in order:
1. The operator has libnvidia-compute-580-server (an application's); `--driver 570` would have apt remove it (the
   branches' libraries conflict): exit 14 before any package changes.
2. The operator removes it; bootstrap installs 570-server-open with Canonical's precompiled modules
   (linux-modules-nvidia-570-server-open-generic and its ABI package), the no-DKMS headless metapackage (no DKMS, no
   compiler step), the branch pinned; after the reboot a second run changes nothing.
3. The archive's -updates gets a kernel ABI bump (5.15.0-92) with its precompiled modules, and the 570-server branch
   retired into transitional packages of 580: `apt-get full-upgrade` takes the kernel and its
   linux-modules-nvidia-570-server-open-5.15.0-92-generic; the pin keeps 570 (without it apt would move the branch).
4. `--driver 580`: the 570 series and its precompiled modules replaced by 580's in one transaction, pinned anew.
5. `gpuprov uninstall --purge-driver`: the driver packages gone, the pin gone, the kernels stay.

24.04 (linux-aws; the archive has no precompiled modules for the aws flavour): DKMS builds the module for the kernel,
with its headers and linux-headers-aws; a kernel ABI bump brings its headers (the headers metapackage follows) and
DKMS builds for it from the headers' own hook; a re-run after the reboot changes nothing.

22.04 with linux-generic-hwe-22.04 on a GPU machine (the running GA kernel and the next-boot HWE kernel): precompiled
for both, or DKMS for both where the next-boot ABI has no precompiled package yet; 24.04 with linux-generic:
precompiled. Ubuntu's engines: docker.io and containerd from the archive, really running on a systemd host (Debian's
binaries under Ubuntu's packages), an operator's containerd.io kept (exit 14). NVIDIA's repository through --mirror.

Marked slow; about five minutes here once the image and archive are cached (built once per recipe: ~2.5 min + ~30 s).
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs
from tests.integration.ubuntu_hosts import UbuntuHost

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GPU = "10de:2330"  # an H100: a datacentre GPU with open kernel modules, so nvidia-headless-<b>-server-open
BOOT = f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate"
PIN = "/etc/apt/preferences.d/gpuprov-nvidia"
K91, K92 = "5.15.0-91-generic", "5.15.0-92-generic"


def _out(r) -> str:
    return r.stdout[-4000:] + r.stderr[-4000:]


def _changed(before: dict, after: dict) -> dict:
    return {p: (before.get(p), after.get(p)) for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


def _modinfo(host, kernel: str) -> str:
    return host.exec(f"modinfo -k {kernel} -F version nvidia").stdout.strip()


@pytest.fixture(scope="module")
def jammy():
    h = UbuntuHost("22.04")
    try:
        h.install_gpuprov()
        h.exec("DEBIAN_FRONTEND=noninteractive apt-get install -y -q libnvidia-compute-580-server", check=True)
        h.config_before = h.pm_config()  # apt's sources, keyrings and pins before gpuprov
        yield h
    finally:
        h.remove()


def test_removal_refused_with_14(jammy):
    before = jammy.debs()
    r = jammy.exec(f"{BOOT} --driver 570")
    assert r.returncode == 14, _out(r)
    assert "libnvidia-compute-580-server" in r.stderr, r.stderr
    assert jammy.debs() == before


@pytest.fixture(scope="module")
def installed(jammy):
    jammy.exec("apt-get purge -y -q libnvidia-compute-580-server", check=True)
    before = jammy.debs()
    plan = jammy.exec(f"gpuprov plan --for-gpu {GPU} --engine none --driver 570 --json")
    assert plan.returncode == 0, _out(plan)
    step = next(s for s in json.loads(plan.stdout)["steps"] if s["id"] == "driver.packages")
    return before, jammy.exec(f"{BOOT} --driver 570"), step["actions"]


def test_precompiled_modules_chosen_where_the_archive_has_them(jammy, installed):
    before, r, planned = installed
    assert r.returncode == 7, _out(r)  # 7: the reboot is due
    after = jammy.debs()
    new = set(after) - set(before)
    # what `gpuprov plan` printed is what ran: these four asked of apt, the ABI package then marked automatic
    asked = (f"linux-modules-nvidia-570-server-open-generic linux-modules-nvidia-570-server-open-{K91} "
             "nvidia-headless-no-dkms-570-server-open nvidia-utils-570-server")
    assert any(a.endswith(f"install -y --no-install-recommends --no-remove {asked}") for a in planned), planned
    assert f"$ apt-mark auto linux-modules-nvidia-570-server-open-{K91}" in planned, planned
    manual = set(jammy.exec("apt-mark showmanual").stdout.split()) & new
    assert manual == set(asked.split()) - {f"linux-modules-nvidia-570-server-open-{K91}"}, sorted(manual)
    assert {"linux-modules-nvidia-570-server-open-generic", f"linux-modules-nvidia-570-server-open-{K91}",
            "nvidia-headless-no-dkms-570-server-open", "nvidia-utils-570-server"} <= new, sorted(new)
    assert not [p for p in new if p.startswith("nvidia-dkms-") or p == "nvidia-headless-570-server-open"], sorted(new)
    assert f"linux-modules-nvidia-570-server-open-{K91}" in jammy.exec("apt-mark showauto").stdout.split()
    assert {p: v for p, v in _changed(before, after).items() if v[1] is None} == {}, "a package was removed"
    assert _modinfo(jammy, K91) == "570.195.03"
    assert jammy.exec(f"ls /lib/modules/{K91}/updates 2>/dev/null").stdout == ""  # nothing DKMS built
    pin = jammy.exec(f"cat {PIN}").stdout
    assert "src:nvidia-graphics-drivers-570-server:any\nPin: version 570.*\nPin-Priority: 990" in pin, pin
    assert "linux-meta" not in pin and "linux-restricted-modules" not in pin, pin  # the modules follow the kernel
    assert jammy.exec(f"lsinitramfs /boot/initrd.img-{K91} | grep -c gpuprov-blacklist-nouveau").stdout.strip() == "1"


def test_rerun_after_reboot_changes_nothing(jammy, installed):
    jammy.reboot()
    before, pin = jammy.debs(), jammy.exec(f"cat {PIN}").stdout
    r = jammy.exec(f"{BOOT} --driver 570")
    assert r.returncode == 15, _out(r)  # resumed: installed, no device to verify on
    assert jammy.debs() == before and jammy.exec(f"cat {PIN}").stdout == pin


@pytest.fixture(scope="module")
def upgraded(jammy, installed):
    jammy.publish_updates()
    jammy.exec("apt-get update -q", check=True)
    # without gpuprov's pin apt would take the retired branch's transitional packages: the 580 series
    unpinned = jammy.exec("apt-get -s full-upgrade -o Dir::Etc::PreferencesParts=/dev/null 2>/dev/null").stdout
    before = jammy.debs()
    r = jammy.exec("DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q")
    return unpinned, before, r


def test_kernel_abi_bump_brings_its_precompiled_modules_and_the_pin_holds(jammy, upgraded):
    unpinned, before, r = upgraded
    assert "Inst nvidia-headless-no-dkms-570-server-open [570.195.03-0ubuntu0.22.04.1] (580.95.05" in unpinned, \
        unpinned
    assert r.returncode == 0, _out(r)
    after = jammy.debs()
    assert after[f"linux-image-{K92}"] and after[f"linux-modules-nvidia-570-server-open-{K92}"], after
    assert jammy.kernel() == K92
    assert _modinfo(jammy, K92) == "570.195.03"
    held = {p: v for p, v in after.items() if p.startswith(("nvidia-", "libnvidia-"))}
    assert held and all(v.startswith("570.195.03-") for v in held.values()), held
    assert jammy.exec("dpkg --audit").stdout == ""


def test_branch_change_swaps_series_and_precompiled_modules(jammy, upgraded):
    jammy.reboot()
    before = jammy.debs()
    r = jammy.exec(f"{BOOT} --driver 580")
    assert r.returncode == 7, _out(r)
    after = jammy.debs()
    # but Canonical's objects packages, which depend on nothing (uninstall takes them: the record names their series)
    assert not [p for p in after if "570" in p and not p.startswith("linux-objects-")], sorted(after)
    assert {"linux-modules-nvidia-580-server-open-generic", f"linux-modules-nvidia-580-server-open-{K92}",
            "nvidia-headless-no-dkms-580-server-open"} <= after.keys(), sorted(after)
    assert _modinfo(jammy, K92) == "580.95.05"  # the kernel that boots next
    assert _modinfo(jammy, K91) == "580.95.05"  # and the older one: its own ABI package, not only the meta's
    assert {p for p, v in _changed(before, after).items() if v[1] is None} <= {p for p in before if "570" in p}
    pin = jammy.exec(f"cat {PIN}").stdout
    assert "Pin: version 580.*" in pin and "570" not in pin, pin
    assert jammy.exec("dpkg --audit").stdout == ""


def test_uninstall_removes_the_driver_and_keeps_the_kernels(jammy, upgraded):
    before = jammy.debs()
    named = ["linux-modules-nvidia-580-server-open-generic", f"linux-modules-nvidia-580-server-open-{K91}",
             f"linux-modules-nvidia-580-server-open-{K92}", "nvidia-headless-no-dkms-580-server-open",
             "nvidia-utils-580-server"]  # what the branch change's install step named
    r = jammy.exec("gpuprov uninstall --yes --purge-driver")
    assert r.returncode == 0, _out(r)
    after = jammy.debs()
    assert not set(named) & after.keys(), f"{sorted(after)}\n{r.stdout[-6000:]}"
    # issue 43 item 3: what they pulled in goes too (every package a transaction of gpuprov's added, and the 570
    # series' objects the branch change left), and nothing of the operator's; on the commit before, the objects,
    # signatures and shared libraries stayed
    assert not [p for p in after if "nvidia" in p], sorted(p for p in after if "nvidia" in p)
    kept = {p: v for p, v in before.items() if "nvidia" not in p}
    assert {p: after.get(p) for p in kept} == kept  # linux-generic, both kernels, their headers
    assert jammy.exec("grep -l nvidia /lib/modules/*/modules.dep").stdout == ""  # no kernel lists a module
    # apt's configuration as before gpuprov, byte for byte: sources.list without multiverse appended, no
    # sources.list.gpuprov-*.bak, no pin
    assert jammy.pm_config() == jammy.config_before, jammy.pm_config()
    assert jammy.exec(f"test -e {PIN}").returncode == 1


@pytest.fixture(scope="module")
def noble():
    h = UbuntuHost("24.04", kernel_meta="linux-aws")
    try:
        h.install_gpuprov()
        yield h
    finally:
        h.remove()


K1018, K1019 = "6.8.0-1018-aws", "6.8.0-1019-aws"


def test_dkms_where_the_archive_has_no_precompiled_modules(noble):
    before = noble.debs()
    r = noble.exec(BOOT)
    assert r.returncode == 7, _out(r)
    after = noble.debs()
    new = set(after) - set(before)
    assert {"nvidia-headless-580-server-open", "nvidia-dkms-580-server-open"} <= new, sorted(new)
    assert {f"linux-headers-{K1018}", "linux-headers-aws"} <= after.keys()  # linux-aws brought them already
    assert not [p for p in after if p.startswith("linux-modules-nvidia")], sorted(after)
    status = noble.exec(f"dkms status -k {K1018}").stdout
    assert "nvidia-srv/580.95.05" in status and status.rstrip().endswith(": installed"), status
    assert _modinfo(noble, K1018) == "580.95.05"
    # the components edit went into Ubuntu 24.04's deb822 sources
    assert "Components: main restricted universe multiverse" in noble.exec(
        "cat /etc/apt/sources.list.d/ubuntu.sources").stdout


def test_kernel_abi_bump_brings_headers_and_dkms_builds(noble):
    noble.publish_updates()
    r = noble.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q")
    assert r.returncode == 0, _out(r)
    assert f"linux-headers-{K1019}" in noble.debs()
    assert noble.kernel() == K1019
    status = noble.exec(f"dkms status -k {K1019}").stdout
    assert status.rstrip().endswith(": installed"), status
    assert _modinfo(noble, K1019) == "580.95.05"
    noble.reboot()
    before = noble.debs()
    r = noble.exec(BOOT)
    assert r.returncode == 15, _out(r)
    assert noble.debs() == before


# ---------------------------------------------------------------- kernel flavours on a GPU machine
# 22.04 with the HWE kernel (linux-generic-hwe-22.04) booting next while the release's GA kernel runs, and an H200 on
# the PCI bus (no --for-gpu): gpuprov builds for the running and the next-boot kernel. Canonical's precompiled modules
# are chosen only when the archive has them for both; a newer HWE ABI whose linux-modules-nvidia-… Canonical has not
# published yet (6.8.0-51 in the stand-in) means DKMS for both; and when the HWE metapackage moves to that ABI after a
# precompiled install (day two), verify is red (exit 10) and bootstrap adds the same series' DKMS flavour for that
# kernel, Canonical's modules kept for the kernels they serve (issue 43; before, it replaced them with DKMS for every
# kernel: a failed build then left no kernel with a module). The running node: tests/integration/test_ubuntu_day_two.py.
KGA, KHWE, KHWE_NEXT = "5.15.0-91-generic", "6.8.0-49-generic", "6.8.0-51-generic"
GPU_BOOT = "gpuprov bootstrap --yes --engine none --no-validate --driver 570"
LRM = "linux-modules-nvidia-570-server-open-"


def _hwe_host(hwe: str) -> UbuntuHost:
    h = UbuntuHost("22.04", kernel_meta=f"linux-image-{KGA} {hwe}", running=KGA)
    h.install_gpuprov()
    return h


def _driver_step(host) -> dict:
    r = host.exec("gpuprov plan --engine none --driver 570 --json")
    assert r.returncode == 0, _out(r)
    return next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.packages")


def test_hwe_precompiled_for_the_running_and_the_next_boot_kernel():
    h = _hwe_host(" ".join(f"{p}=6.8.0-49.49~22.04.1" for p in
                           ("linux-generic-hwe-22.04", "linux-image-generic-hwe-22.04", "linux-headers-generic-hwe-22.04")))
    try:
        assert h.kernel() == KHWE
        step = _driver_step(h)
        assert f"kernel module: Ubuntu's precompiled, signed modules ({LRM}generic-hwe-22.04, following " \
            "linux-image-generic-hwe-22.04)" in step["notes"], step["notes"]
        # each kernel's own ABI package: the one running now and the one booting next
        assert f"apt-mark auto {LRM}{KHWE} {LRM}{KGA}" in step["commands"], step["commands"]
        before = h.debs()
        r = h.exec(GPU_BOOT)
        assert r.returncode == 7, _out(r)
        after = h.debs()
        new = set(after) - set(before)
        assert {f"{LRM}generic-hwe-22.04", f"{LRM}{KHWE}", f"{LRM}{KGA}",
                "nvidia-headless-no-dkms-570-server-open"} <= new, sorted(new)
        assert not [p for p in new if p.startswith(("nvidia-dkms-", "linux-headers-"))], sorted(new)
        assert not [p for p in before if p not in after], "a package was removed"
        for k in (KGA, KHWE):  # Canonical's module, not a DKMS build
            assert h.exec(f"modinfo -k {k} -F filename nvidia").stdout.strip() == \
                f"/lib/modules/{k}/kernel/nvidia-570srv-open/nvidia.ko"
            assert _modinfo(h, k) == "570.195.03"
        assert h.exec("dkms status").stdout.strip() == ""
        # day two: the HWE metapackage moves to 6.8.0-51, for which Canonical has no precompiled modules yet
        r = h.exec("DEBIAN_FRONTEND=noninteractive apt-get install -y -q linux-generic-hwe-22.04")
        assert r.returncode == 0 and h.kernel() == KHWE_NEXT, _out(r)
        verify = h.exec("gpuprov verify --json")
        assert verify.returncode == 10 and f"kernel {KHWE_NEXT} boots next" in verify.stdout, _out(verify)
        h.reboot()
        r = h.exec(GPU_BOOT)  # the resume verifies the first install: no module loads in a container (exit 5)
        assert r.returncode == 5 and "no driver loaded" in r.stderr, _out(r)
        before = h.debs()
        r = h.exec(GPU_BOOT)  # DKMS added for the new ABI; Canonical's modules stay for the kernels they serve
        assert r.returncode == 7, _out(r)
        after = h.debs()
        assert not [p for p in before if p not in after], sorted(p for p in before if p not in after)
        assert {"nvidia-dkms-570-server-open", "nvidia-headless-570-server-open"} <= after.keys()
        for k, path in ((KGA, "kernel/nvidia-570srv-open"), (KHWE, "kernel/nvidia-570srv-open"),
                        (KHWE_NEXT, "updates/dkms")):
            assert h.exec(f"modinfo -k {k} -F filename nvidia").stdout.strip() == \
                f"/lib/modules/{k}/{path}/nvidia.ko"
    finally:
        h.remove()


def test_hwe_dkms_where_the_next_boot_kernel_has_no_precompiled_modules():
    h = _hwe_host("linux-generic-hwe-22.04")
    try:
        assert h.kernel() == KHWE_NEXT
        # the archive has them for the running kernel and the HWE flavour's metapackage, not for the next-boot ABI
        offered = set(h.exec(f"apt-cache pkgnames {LRM}").stdout.split())
        assert {f"{LRM}{KGA}", f"{LRM}generic-hwe-22.04"} <= offered and f"{LRM}{KHWE_NEXT}" not in offered, offered
        step = _driver_step(h)
        assert f"kernel module: the archive has no {LRM}{KHWE_NEXT} (kernel {KHWE_NEXT}): DKMS builds the module" \
            in step["notes"], step["notes"]
        before = h.debs()
        r = h.exec(GPU_BOOT)
        assert r.returncode == 7, _out(r)
        after = h.debs()
        new = set(after) - set(before)
        assert {"nvidia-headless-570-server-open", "nvidia-dkms-570-server-open", f"linux-headers-{KGA}"} <= new, \
            sorted(new)
        assert not [p for p in after if p.startswith("linux-modules-nvidia")], sorted(after)
        assert f"linux-image-{KHWE}" not in after  # the flavour metapackage's older ABI was not pulled in
        assert not [p for p in before if p not in after], "a package was removed"
        for k in (KGA, KHWE_NEXT):
            assert h.exec(f"modinfo -k {k} -F filename nvidia").stdout.strip() == \
                f"/lib/modules/{k}/updates/dkms/nvidia.ko"
            assert _modinfo(h, k) == "570.195.03"
            assert h.exec(f"dkms status -k {k}").stdout.rstrip().endswith(": installed")
    finally:
        h.remove()


def test_noble_generic_precompiled():
    """24.04 with linux-generic (the aws host above has DKMS): Canonical's modules for noble's generic kernel."""
    h = UbuntuHost("24.04")
    try:
        h.install_gpuprov()
        before, config = h.debs(), h.pm_config()
        r = h.exec(BOOT)
        assert r.returncode == 7, _out(r)
        new = set(h.debs()) - set(before)
        assert {"linux-modules-nvidia-580-server-open-generic", "linux-modules-nvidia-580-server-open-6.8.0-49-generic",
                "nvidia-headless-no-dkms-580-server-open"} <= new, sorted(new)
        assert not [p for p in new if p.startswith("nvidia-dkms-")], sorted(new)
        assert _modinfo(h, "6.8.0-49-generic") == "580.95.05"
        # issue 43 item 3: the archive's -updates brings 6.8.0-50, and with it the metapackage pulls that kernel's
        # precompiled modules, objects and signatures in (no transaction of gpuprov's); uninstall --purge-driver
        # purges them too, and gives apt's configuration back byte for byte (ubuntu.sources, which bootstrap gave
        # multiverse); on the commit before, 6.8.0-50's modules stayed and its modules.dep listed nvidia.ko
        h.publish_updates()
        h.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q", check=True)
        later = {"linux-modules-nvidia-580-server-open-6.8.0-50-generic", "linux-signatures-nvidia-6.8.0-50-generic",
                 "linux-objects-nvidia-580-server-open-6.8.0-50-generic"}
        assert later <= h.debs().keys(), sorted(h.debs())
        assert _modinfo(h, "6.8.0-50-generic") == "580.95.05"
        plan = h.exec("gpuprov uninstall --dry-run -v --purge-driver")
        assert all(p in plan.stdout for p in later), plan.stdout  # said before it is done
        r = h.exec("gpuprov uninstall --yes --purge-driver")
        assert r.returncode == 0, _out(r)
        assert not [p for p in h.debs() if "nvidia" in p], sorted(p for p in h.debs() if "nvidia" in p)
        assert set(h.debs()) >= {p for p in before if "nvidia" not in p} and "linux-image-6.8.0-50-generic" in h.debs()
        assert h.exec("grep -l nvidia /lib/modules/*/modules.dep").stdout == ""
        assert h.pm_config() == config, h.pm_config()
    finally:
        h.remove()


# ---------------------------------------------------------------- Ubuntu's engines through apt
# A 22.04 host with systemd as PID 1. The archive's docker.io, containerd and runc carry Debian bookworm's real
# binaries and maintainer scripts under Ubuntu's names, versions and Depends/Conflicts (ubuntu_hosts.py's repack), so
# the engines really start in the host. In order: an operator's containerd.io (Docker's repository's, which
# Conflicts with Ubuntu's containerd) stops `--engine docker` with exit 14 and nothing changed; once the operator
# removes it, `--engine containerd` installs containerd and registers the runtime; `--engine docker` then installs
# docker.io beside it (containerd kept), daemon.json written and the running dockerd lists the runtime; each re-run
# changes nothing. gpuprov already behaves so: these hold it against the real packages' transactions.
ENG = "gpuprov bootstrap --yes --driver skip --no-validate --engine"
CONTAINERD_IO = """set -e; d=$(mktemp -d); mkdir -p $d/DEBIAN $d/usr/bin
printf '#!/bin/sh\\necho operator containerd\\n' > $d/usr/bin/containerd; chmod 755 $d/usr/bin/containerd
printf 'Package: containerd.io\\nVersion: 1.7.27-1\\nArchitecture: amd64\\nMaintainer: Containerd team \
<help@containerd.io>\\nProvides: containerd, runc\\nConflicts: containerd, runc\\nReplaces: containerd, runc\\n\
Description: the operator containerd.io (Docker repository control fields)\\n' > $d/DEBIAN/control
dpkg-deb -b $d /tmp/containerd.io.deb >/dev/null; dpkg -i /tmp/containerd.io.deb >/dev/null"""


@pytest.fixture(scope="module")
def engines():
    h = UbuntuHost("22.04", systemd=True)
    try:
        h.install_gpuprov()
        yield h
    finally:
        h.remove()


def _unchanged(host) -> str:
    return host.exec("md5sum /var/lib/dpkg/status /etc/docker/daemon.json /etc/containerd/config.toml 2>&1; "
                     "systemctl is-active docker containerd").stdout


def test_engine_install_refused_with_14_before_removing_the_operators_containerd(engines):
    engines.exec(CONTAINERD_IO, check=True)
    before, state = engines.debs(), _unchanged(engines)
    r = engines.exec(f"{ENG} docker")
    assert r.returncode == 14, _out(r)
    assert "would remove installed packages: containerd.io" in r.stderr, r.stderr
    assert engines.debs() == before and _unchanged(engines) == state
    engines.exec("dpkg --purge containerd.io", check=True)


def test_containerd_from_the_archive_registered_and_rerun_noop(engines):
    r = engines.exec(f"{ENG} containerd")
    assert r.returncode == 0, _out(r)
    debs = engines.debs()
    assert debs["containerd"] == "1.7.12-0ubuntu2~22.04.1" and debs["runc"] == "1.1.12-0ubuntu2~22.04.1", debs
    assert "docker.io" not in debs
    assert "/etc/containerd/conf.d/99-gpuprov.toml" in engines.exec("cat /etc/containerd/config.toml").stdout
    assert engines.exec("systemctl is-active containerd").stdout.strip() == "active"
    assert engines.exec("ctr version").returncode == 0  # Debian's real containerd, under Ubuntu's package
    state = _unchanged(engines)
    r = engines.exec(f"{ENG} containerd")
    assert r.returncode == 0 and "0 changes" in r.stdout + r.stderr, _out(r)
    assert _unchanged(engines) == state


def test_docker_io_from_the_archive_keeps_containerd_and_rerun_noop(engines):
    before = engines.debs()
    r = engines.exec(f"{ENG} docker")
    assert r.returncode == 0, _out(r)
    after = engines.debs()
    assert after["docker.io"] == "24.0.7-0ubuntu2~22.04.1", after
    assert {p: after.get(p) for p in before} == before  # containerd, runc and everything else kept as they were
    daemon = json.loads(engines.exec("cat /etc/docker/daemon.json", check=True).stdout)
    assert daemon["runtimes"]["nvidia"]["path"] == "/usr/local/bin/gpuprov-runtime", daemon
    assert daemon["default-runtime"] == "nvidia", daemon
    info = engines.exec("docker info --format '{{.DefaultRuntime}} {{json .Runtimes}}'", check=True).stdout
    assert info.startswith("nvidia ") and "/usr/local/bin/gpuprov-runtime" in info, info  # the real dockerd
    state = _unchanged(engines)
    r = engines.exec(f"{ENG} docker")
    assert r.returncode == 0 and "0 changes" in r.stdout + r.stderr, _out(r)
    assert _unchanged(engines) == state


# ---------------------------------------------------------------- NVIDIA's repository on Ubuntu
# `--driver-source nvidia` on 22.04 through `--mirror cuda=URL`: NVIDIA's flat repository for ubuntu2204 (a stand-in of
# its packaging: nvidia-open-580 -> nvidia-driver-580-open -> nvidia-headless/nvidia-dkms-580-open …, NVIDIA's
# versions) served on the host's loopback. On main the plan named nvidia-open-580 but never added the repository, so
# apt found no such package; now a driver.repo step adds it (signed-by its key, at the mirror) and the real apt
# installs from it, DKMS builds NVIDIA's `nvidia` module, the series is pinned, and a re-run changes nothing.
CUDA = ("--for-gpu 10de:2330 --driver-source nvidia --driver 580 --engine none "
        "--mirror cuda=http://127.0.0.1:8090/cuda")
CUDA_LIST = "/etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list"


def test_nvidia_repository_through_the_mirror():
    h = UbuntuHost("22.04")
    try:
        h.install_gpuprov()
        before, config = h.debs(), h.pm_config()
        r = h.exec(f"gpuprov bootstrap --yes --no-validate {CUDA}")
        assert r.returncode == 7, _out(r)
        assert h.exec(f"cat {CUDA_LIST}").stdout == ("deb [signed-by=/etc/apt/keyrings/cuda-archive-keyring.asc] "
                                                     "http://127.0.0.1:8090/cuda/ubuntu2204/x86_64/ /\n")
        after = h.debs()
        new = {p: after[p] for p in set(after) - set(before)}
        assert new.get("nvidia-open-580") == "580.95.05-0ubuntu1", new
        assert {"nvidia-driver-580-open", "nvidia-dkms-580-open", "libnvidia-compute-580"} <= new.keys(), new
        # every NVIDIA package from NVIDIA's repository (apt-cache policy: its URL is the installed version's source)
        policy = h.exec("apt-cache policy nvidia-driver-580-open").stdout
        assert "*** 580.95.05-0ubuntu1 990" in policy and "127.0.0.1:8090/cuda/ubuntu2204/x86_64" in policy, policy
        assert not [p for p in before if p not in after], "a package was removed"
        assert h.exec(f"dkms status -k {K91}").stdout.strip() == f"nvidia/580.95.05, {K91}, x86_64: installed"
        assert _modinfo(h, K91) == "580.95.05"
        pin = h.exec(f"cat {PIN}").stdout
        assert "src:nvidia-graphics-drivers-580:any\nPin: version 580.*\nPin-Priority: 990" in pin, pin
        state = h.exec(f"md5sum /var/lib/dpkg/status {CUDA_LIST} /etc/apt/keyrings/cuda-archive-keyring.asc").stdout
        r = h.exec(f"gpuprov bootstrap --yes --no-validate {CUDA}")
        assert r.returncode == 7 and "reboot is still pending" in r.stderr, _out(r)
        assert h.exec(f"md5sum /var/lib/dpkg/status {CUDA_LIST} /etc/apt/keyrings/cuda-archive-keyring.asc"
                      ).stdout == state
        # issue 39 item 2: uninstall --purge-driver takes NVIDIA's list and keyring out again (on the commit before
        # both stayed), and DKMS's modules with the packages
        r = h.exec("gpuprov uninstall --yes --purge-driver")
        assert r.returncode == 0, _out(r)
        assert h.pm_config() == config, h.pm_config()
        assert not [p for p in h.debs() if "nvidia" in p], sorted(p for p in h.debs() if "nvidia" in p)
        assert h.exec("grep -l nvidia /lib/modules/*/modules.dep").stdout == ""
    finally:
        h.remove()

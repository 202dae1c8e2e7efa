"""EL through a real dnf and rpm: `gpuprov bootstrap` on Rocky 9 and Rocky 8 host containers (one image,
tests/integration/el_hosts.py: Debian's dnf 4.14 and rpm 4.18 behind Rocky's release files), against stand-in
ELRepo, BaseOS/AppStream and Docker CE repositories (tests/fixtures/el-repos) served on loopback and reached through
`--mirror NAME=URL`. The host has no network: nothing reaches an upstream archive. What is stand-in: the packages'
payloads (no real kernel or module; a stand-in weak-modules, run by the kmods' and the kernel's real
scriptlets). What is real: dnf's dependency resolution, transactions, GPG checks, the versionlock plugin,
obsoletes/conflicts, rpm's database, and dracut (Debian's, set to EL's image name and hostonly default).

One host per release through its stages (module-scoped, in order, each starting where the last left it):
1. The operator's host: kernel, podman and runc installed from the distribution with dnf. Docker CE asked for
   there: containerd.io obsoletes runc, so the install would replace it: exit 14 before any package changes, and
   Docker's repository left disabled (the operator's next `dnf upgrade` would replace runc otherwise).
2. bootstrap (driver only) with --mirror elrepo=...: elrepo-release, kmod-nvidia-open and nvidia-x11-drv from
   the mirror, the driver locked with dnf versionlock; a second run changes nothing.
3. ELRepo publishes 570.144 and the distribution a kernel: `dnf upgrade` takes the kernel, the lock keeps 570.133.07,
   and the kmod serves the new kernel through weak-updates (kABI tracking), which verify's next-boot check finds.
4. `gpuprov uninstall --purge-driver` stops with exit 14 where a package of the operator's needs the driver (dnf's
   own dry run says so), and once it is gone purges the driver packages gpuprov recorded (dependencies included:
   every package its transactions added) and their version locks, and nothing the operator had.
Marked slow; about two minutes once the image and repositories are cached (built once per recipe).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, url

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GPU = "10de:2330"  # an H100: the open kernel module, so ELRepo's kmod-nvidia-open
DRIVER = (f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate "
          f"--mirror elrepo={url('elrepo')}")
KMOD = "kmod-nvidia-open"


@dataclass(frozen=True)
class Release:
    """What differs between the Rocky releases in the stand-in repositories (tests/fixtures/el-repos)."""
    major: str
    kernel: str  # the installed kernel's release
    later_kernel: str  # the errata kernel published mid-way
    elrepo_tag: str  # ELRepo's release tag of the kmod built for it
    operator: str  # what the operator installed before gpuprov (EL 8's podman and runc are a module: not here)


RELEASES = {"9": Release("9", "5.14.0-503.14.1.el9_5.x86_64", "503.40.1", "1.el9_5.elrepo", "kernel podman"),
            "8": Release("8", "4.18.0-553.el8_10.x86_64", "553.16.1", "1.el8_10.elrepo", "kernel")}


@pytest.fixture(scope="module", params=sorted(RELEASES, reverse=True), ids=lambda m: f"rocky-{m}")
def rel(request) -> Release:
    return RELEASES[request.param]


@pytest.fixture(scope="module")
def host(rel):
    h = ElHost(rel.major)
    try:
        h.install_gpuprov()
        h.exec(f"dnf install -y -q {rel.operator}", check=True)  # the operator's server before gpuprov
        yield h
    finally:
        h.remove()


def test_docker_ce_replacing_runc_stops_with_14(host, rel):
    if rel.major != "9":
        pytest.skip("Docker CE's runc trap is proven on EL 9: EL 8's podman and runc come from the container-tools "
                    "module, which the stand-in EL 8 repositories do not carry")
    before = host.rpms()
    assert "runc" in before and "podman" in before
    r = host.exec(f"gpuprov bootstrap --yes --engine docker --engine-source docker-ce --driver skip --no-validate "
                  f"--mirror docker-ce={url('docker-ce')}")
    assert r.returncode == 14, r.stdout[-3000:] + r.stderr[-3000:]
    assert "runc" in r.stderr, r.stderr
    # what the step did before its dry run refused the install is said, not "nothing was changed"
    assert "nothing was changed" not in r.stderr and "/etc/yum.repos.d/docker-ce.repo was written" in r.stderr
    assert "enabled = 0" in host.exec("dnf config-manager --dump docker-ce-stable").stdout
    assert host.rpms() == before
    # and nothing left behind makes the operator's next `dnf upgrade` do what gpuprov refused to do
    upgrade = host.exec("dnf upgrade --assumeno 2>&1").stdout
    assert "containerd.io" not in upgrade and "Nothing to do" in upgrade, upgrade


@pytest.fixture(scope="module")
def config_before(host) -> dict:
    """dnf's and rpm's configuration before the driver's bootstrap (Docker CE's refused run has been)."""
    return host.pm_config()


@pytest.fixture(scope="module")
def driven(host, config_before):
    before = host.rpms()
    r = host.exec(DRIVER)
    return before, r


def test_driver_from_elrepo_mirror(host, driven, rel):
    before, r = driven
    assert r.returncode in (0, 7), r.stdout[-4000:] + r.stderr[-4000:]  # 7: a reboot is due (the new module)
    after = host.rpms()
    assert after[KMOD].endswith(f":570.133.07-{rel.elrepo_tag}"), after
    assert after["nvidia-x11-drv"] == after["nvidia-x11-drv-libs"] == after[KMOD], after
    assert "elrepo-release" in after and "kmod-nvidia" not in after
    assert {p: v for p, v in before.items() if after.get(p) != v} == {}, "a package was changed or removed"
    # the record names every package this bootstrap added (dependencies, elrepo-release and the versionlock plugin
    # included), and nothing the operator had
    rec = json.loads(host.exec("cat /var/lib/gpuprov/installed.json", check=True).stdout)
    assert sorted(rec["packages"]["driver"]) == sorted(after.keys() - before.keys()), rec
    assert KMOD in rec["holds"], rec
    # The repository dnf keeps using is the mirror, not upstream: a later `dnf upgrade` must reach it.
    repo = host.exec("dnf repoinfo elrepo 2>/dev/null | grep -i '^repo-baseurl'").stdout
    assert url("elrepo") in repo, repo
    assert host.exec(f"rpm -q --whatprovides /lib/modules/{rel.kernel}/extra/nvidia/nvidia.ko").stdout.startswith(KMOD)


def test_rerun_changes_nothing(host, driven):
    before = host.rpms()
    r = host.exec(DRIVER + " --json")
    assert r.returncode in (0, 7), r.stdout[-3000:] + r.stderr[-3000:]
    assert host.rpms() == before
    assert "Installed:" not in r.stdout


def test_versionlock_holds_across_dnf_upgrade(host, driven, rel):
    locks = host.exec("dnf versionlock list").stdout
    assert KMOD in locks, locks
    host.publish_later(f"elrepo/linux/elrepo/el{rel.major}/x86_64")
    host.publish_later(f"rocky/{rel.major}/BaseOS/x86_64/os")
    offered = host.exec(f"dnf --refresh --disableplugin=versionlock list --available {KMOD} kernel-core").stdout
    assert "570.144" in offered and rel.later_kernel in offered, offered  # the update is there to be taken
    r = host.exec("dnf upgrade -y")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    after = host.rpms()
    assert after[KMOD].endswith(f":570.133.07-{rel.elrepo_tag}"), after
    assert after["nvidia-x11-drv"].endswith(f":570.133.07-{rel.elrepo_tag}"), after
    kernels = host.exec("rpm -q kernel-core").stdout.split()
    assert any(rel.later_kernel in k for k in kernels), kernels  # the kernel is not held
    # kABI tracking: the kmod built for the installed kernel serves the errata kernel of its minor release through
    # weak-updates (weak-modules, run by the kernel's own scriptlet), and verify's next-boot check finds it there
    new = next(k for k in kernels if rel.later_kernel in k).removeprefix("kernel-core-")
    link = host.exec(f"readlink /lib/modules/{new}/weak-updates/nvidia/nvidia.ko").stdout.strip()
    assert link == f"/lib/modules/{rel.kernel}/extra/nvidia/nvidia.ko", link
    checks = {c["name"]: c for c in json.loads(host.exec("gpuprov verify --json").stdout)["checks"]}
    boot = checks["next-boot kernel module"]
    assert boot["status"] == "pass" and new in boot["detail"] and "weak-updates" in boot["detail"], boot


# The operator's own package, built and installed on the host after gpuprov: it needs the driver's libraries.
OPERATOR_RPM = r"""set -e; mkdir -p /tmp/op/SPECS; cat > /tmp/op/SPECS/op.spec <<'SPEC'
Name: site-cuda-app
Version: 1.0
Release: 1
Summary: an operator's package that needs the driver's libraries
License: site
BuildArch: noarch
Requires: nvidia-x11-drv-libs
%description
the operator's
%files
SPEC
rpmbuild -bb --quiet --define '_topdir /tmp/op' /tmp/op/SPECS/op.spec
rpm -i /tmp/op/RPMS/noarch/site-cuda-app-1.0-1.noarch.rpm"""


def test_purge_stops_at_a_package_that_needs_the_driver(host, driven):
    host.exec(OPERATOR_RPM, check=True)
    try:
        before = host.rpms()
        r = host.exec("gpuprov uninstall --yes --purge-driver")
        assert r.returncode == 14, r.stdout[-3000:] + r.stderr[-3000:]
        assert "site-cuda-app" in r.stderr and "nothing was removed" in r.stderr, r.stderr
        assert host.rpms() == before  # dnf's dry run only: nothing removed, nothing unlocked
        assert KMOD in host.exec("dnf versionlock list").stdout
    finally:
        host.exec("rpm -e site-cuda-app", check=True)


def test_uninstall_purges_only_what_gpuprov_recorded(host, driven):
    before, _ = driven  # the operator's packages, before gpuprov
    r = host.exec("gpuprov uninstall --yes --purge-driver")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    after = host.rpms()
    assert not {KMOD, "nvidia-x11-drv", "nvidia-x11-drv-libs"} & after.keys(), after
    # what gpuprov installed is gone (the versionlock plugin and elrepo-release with the driver), and all the
    # operator had stays (the kernels, podman, runc)
    assert after.keys() == before.keys(), (sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys()))
    assert "nvidia" not in host.exec("cat /etc/dnf/plugins/versionlock.list 2>/dev/null").stdout
    # the kmod's removal took its weak-updates links and modules.dep lines with it (its own scriptlets)
    assert host.exec("ls /lib/modules/*/weak-updates/nvidia/ 2>/dev/null; grep -h nvidia /lib/modules/*/modules.dep"
                     ).stdout == ""
    # nothing of the driver's left to undo: on EL 9 the record keeps only Docker CE's repository file, which the
    # refused engine install of stage 1 left (disabled) and `uninstall --purge-engine` takes out; on EL 8 that stage
    # is skipped, so nothing is left to record and the record goes
    text = host.exec("cat /var/lib/gpuprov/installed.json 2>/dev/null").stdout
    if host.exec("test -e /etc/yum.repos.d/docker-ce.repo").returncode != 0:
        assert text == "", text
        return
    rec = json.loads(text)
    assert not rec["packages"] and set(rec["repo_config"]) == {"engine"} and not rec["keys"].get("driver"), rec


def test_uninstall_restores_dnfs_configuration(host, driven, config_before):
    """Issue 39 item 2: after the purge above, dnf's configuration is as before bootstrap: elrepo.repo and its
    .rpmsave (`config-manager --save` had pointed it at the mirror), versionlock.list and its .rpmsave, and ELRepo's
    key in rpm gone. On the commit before, the .rpmsave copies and the gpg-pubkey stayed."""
    after = host.pm_config()
    assert after == config_before, ({k: v for k, v in after.items() if config_before.get(k) != v},
                                     sorted(config_before.keys() - after.keys()))
    assert host.exec("dnf -q makecache 2>&1").returncode == 0  # every repository dnf names still answers

"""NVIDIA's CUDA repository on more releases through a real dnf and rpm: Amazon Linux 2023 (its default driver source:
ELRepo serves no AL2023, and there is no EPEL), Alibaba Cloud Linux 3 (its default too: ELRepo's el8 kmods are built
for RHEL 8's 4.18 kernel, Alinux boots its own 5.10; NVIDIA's rhel8 tree, EPEL 8 through Alinux's own
epel-aliyuncs-release) and Rocky 8 (`--driver-source nvidia`, with EPEL for dkms), each a host container of
tests/integration/el_hosts.py's one image: AL2023 presented by its os-release and a stand-in system-release (its
$releasever and `platform:al2023` provides), Alinux 3 by its os-release and a stand-in alinux-release ($releasever 3,
`platform:al8`), Rocky 8 by Rocky 8.10's release files. Against stand-in repositories (tests/fixtures/el-repos/README.md
says where each fact came from): AL2023's amazonlinux (kernel 6.1, kernel-devel, kernel-headers, dkms), Alinux 3's
alinux3-os (kernel 5.10.134-15.1.al8, kernel-devel, kernel-headers, epel-aliyuncs-release) or Rocky 8's BaseOS, EPEL 8,
and NVIDIA's cuda-amzn2023 / cuda-rhel8 with their `nvidia-driver` module streams (the rhel8 streams declaring no
platform, as NVIDIA's generator writes them: active on el8 and al8), reached through `--mirror`. Stand-in: the payloads
(no DKMS build runs). Real: dnf's modularity, its transactions, GPG checks, versionlock and rpm's database.

One host per release through its stages (module-scoped, in order): bootstrap (driver only, 570) with the stream's DKMS
prerequisites; after the reboot a re-run changes nothing; uninstall --purge-driver purges what gpuprov installed and
resets the stream it enabled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, url

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GPU = "10de:2330"  # an H100: open kernel modules, so the 570-open stream
DRIVER_PKGS = ("nvidia-driver", "nvidia-driver-libs", "nvidia-driver-cuda", "nvidia-driver-cuda-libs",
               "nvidia-kmod-common", "kmod-nvidia-open-dkms")


@dataclass(frozen=True)
class Release:
    host: str  # ElHost's release
    kernel: str  # the installed kernel's version-release
    tag: str  # NVIDIA's release tag for it
    repo: str  # NVIDIA's repository id there
    options: str  # the bootstrap's source and mirrors
    epel: str  # the package that brings EPEL (for dkms), "" where the distribution has dkms


RELEASES = {
    "amzn-2023": Release("amzn2023", "6.1.119-129.201.amzn2023", "1.amzn2023", "cuda-amzn2023-x86_64",
                         f"--mirror cuda={url('cuda')}", ""),
    "alinux-3": Release("alinux3", "5.10.134-15.1.al8", "1.el8", "cuda-rhel8-x86_64",
                        f"--mirror cuda={url('cuda')} --mirror epel={url('epel')}", "epel-aliyuncs-release"),
    "rocky-8": Release("8", "4.18.0-553.el8_10", "1.el8", "cuda-rhel8-x86_64",
                       f"--driver-source nvidia --mirror cuda={url('cuda')} --mirror epel={url('epel')}", "epel-release"),
}


@pytest.fixture(scope="module", params=sorted(RELEASES))
def rel(request) -> Release:
    return RELEASES[request.param]


def bootstrap(rel: Release) -> str:
    return f"gpuprov bootstrap --yes --json --for-gpu {GPU} --engine none --no-validate --driver 570 {rel.options}"


@pytest.fixture(scope="module")
def host(rel):
    h = ElHost(rel.host)
    try:
        h.install_gpuprov()
        h.exec("dnf install -y -q kernel", check=True)  # the installed kernel
        yield h
    finally:
        h.remove()


@pytest.fixture(scope="module")
def config_before(host) -> dict:
    return host.pm_config()


@pytest.fixture(scope="module")
def installed(host, rel, config_before):
    before = host.rpms()
    return before, host.exec(bootstrap(rel))


def stream(host) -> str:
    return host.exec("cat /etc/dnf/modules.d/nvidia-driver.module").stdout


def test_driver_from_nvidias_stream_with_its_dkms_prerequisites(host, rel, installed):
    """AL2023, on the previous commit: the default driver source planned no kernel-devel (DKMS had nothing to build
    against): "distro" was taken for ELRepo's prebuilt kmods, which AL2023 does not get. Alinux 3 on main: ELRepo's
    el8 kmod-nvidia-open (kABI-tracking for RHEL 8's 4.18 kernel: it loads into no 5.10 .al8 kernel)."""
    before, r = installed
    assert r.returncode in (0, 7), r.stdout[-4000:] + r.stderr[-4000:]
    after = host.rpms()
    assert {p: after.get(p) for p in DRIVER_PKGS} == {p: f"3:570.133.20-{rel.tag}" for p in DRIVER_PKGS}, after
    assert after.get("kernel-devel") == f"0:{rel.kernel}" and after.get("kernel-headers") == f"0:{rel.kernel}"
    assert "dkms" in after and {p for p in ("epel-release", "epel-aliyuncs-release") if p in after} == \
        ({rel.epel} if rel.epel else set()), after
    assert host.exec("test -e /etc/yum.repos.d/epel.repo").returncode == (0 if rel.epel else 1)
    assert "stream=570-open" in stream(host) and "state=enabled" in stream(host), stream(host)
    info = host.exec(f"dnf repoinfo {rel.repo} 2>&1").stdout
    assert url("cuda") in info and "upstream.invalid" not in info, info
    assert {p: v for p, v in before.items() if after.get(p) != v} == {}, "a package was changed or removed"
    rec = json.loads(host.exec("cat /var/lib/gpuprov/installed.json", check=True).stdout)
    assert rec["streams"] == ["nvidia-driver"], rec


def test_rerun_after_the_reboot_changes_nothing(host, rel, installed):
    host.reboot()
    assert host.exec(bootstrap(rel)).returncode == 15  # the resume: no GPU here to verify the driver on
    before = host.rpms()
    r = host.exec(bootstrap(rel))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(r.stdout)["changed"] == 0, r.stdout
    assert host.rpms() == before


def test_uninstall_purges_and_resets_the_stream(host, rel, installed):
    before, _ = installed
    assert set(DRIVER_PKGS) <= host.rpms().keys() and "state=enabled" in stream(host)  # what it removes is there
    r = host.exec("gpuprov uninstall --yes --purge-driver")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert host.rpms().keys() == before.keys()
    assert "state=enabled" not in stream(host), stream(host)


def test_uninstall_restores_dnfs_configuration(host, rel, installed, config_before):
    """Issue 39 item 2: NVIDIA's cuda-amzn2023.repo / cuda-rhel8.repo (enabled, at the mirror, on the commit before),
    EPEL's leftovers and the keys dnf imported are gone after the purge above."""
    assert host.pm_config() == config_before, host.pm_config()


def test_docker_engine_packages_from_their_repository(host, rel):
    """The engine's packages through the plan's own commands (engine.packages as `gpuprov plan --json` prints them,
    each run in the host; the dry run's `--assumeno` answers no), Docker CE's repository at its mirror. On the previous
    commit Alinux 3's baseurl read `$releasever` (3), where Docker publishes no tree: dnf failed on the missing
    metadata. AL2023: Docker publishes none; the plan takes the distribution's `docker`."""
    r = host.exec(f"gpuprov plan --json --engine docker --driver skip --mirror docker-ce={url('docker-ce')}")
    if rel.host == "amzn2023":  # the stand-in AL2023 repositories carry no `docker`: the preflight says so (exit 4)
        assert r.returncode == 4 and "no repository offers docker" in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    else:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    step = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "engine.packages")
    commands = [a[2:] for a in step["actions"] if a.startswith("$ ")]
    if rel.host == "amzn2023":
        assert commands[-1] == "dnf install -y docker" and not any("docker-ce" in c for c in commands), commands
        return
    assert any("/centos/8/$basearch/stable" in c for c in commands), commands
    for c in commands:
        done = host.exec(c + " 2>&1")
        assert done.returncode == 0 or "--assumeno" in c, f"{c}\n{done.stdout[-3000:]}"
    after = host.rpms()
    assert {p: after.get(p) for p in ("docker-ce", "docker-ce-cli", "containerd.io")} == \
        {"docker-ce": "3:28.1.1-1.el8", "docker-ce-cli": "1:28.1.1-1.el8", "containerd.io": "0:1.7.27-3.1.el8"}, after
    info = host.exec("dnf repoinfo docker-ce-stable 2>&1").stdout
    assert f"{url('docker-ce')}/centos/8/x86_64/stable" in info, info

"""Hosts that are not bare (issue 18 items 1-3), on fixture roots: the engine found is detected with its origin and
kept (no install), its real config configured; no package install can remove a package (the dry run first, exit 14
naming the packages; --no-remove in the install itself); a driver installed but not loaded that gpuprov did not
install is kept, with no driver step. (Real apt and real engines: tests/integration/test_adopt_engines.py.)"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from provision import package_managers
from provision.errors import CONFLICT, GpuprovError
from provision.plan import steps as st
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.plan.packages import PackageInstall
from provision.report import detect_host
from tests.conftest import make_host

KERNEL = "6.1.0-27-amd64"
DOCKER_CE = "5:28.0.1-1~debian.12~bookworm"


def dpkg(root: Path, *packages: tuple[str, str, str, tuple[str, ...]]) -> None:
    """dpkg's status and file lists under `root`: (name, version, maintainer, files)."""
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    stanzas = []
    for name, version, maint, files in packages:
        stanzas.append(f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\nMaintainer: {maint}\n"
                       f"Version: {version}\nDescription: x\n")
        (info / f"{name}.list").write_text("".join(f"{f}\n" for f in files))
    (root / "var/lib/dpkg/status").write_text("\n".join(stanzas))


def binary(root: Path, path: str) -> None:
    (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / path.lstrip("/")).write_text("#!/bin/sh\n")


def daemon(root: Path, pid: int, comm: str, argv: list[str], exe: str) -> None:
    """A running daemon as /proc shows it (comm, cmdline, exe) under the fixture root."""
    d = root / f"proc/{pid}"
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    os.symlink(exe, d / "exe")


def docker_ce_host(tmp_path: Path) -> Path:
    root = make_host(tmp_path, "debian-12", "none", kernel=KERNEL)
    dpkg(root, ("docker-ce", DOCKER_CE, "Docker <support@docker.com>", ("/usr/bin/dockerd",)),
         ("containerd.io", "1.7.25-1", "Containerd team", ("/usr/bin/containerd", "/usr/bin/runc")))
    binary(root, "/usr/bin/dockerd")
    binary(root, "/usr/bin/containerd")
    return root


def plan(root: Path, **opt) -> dict[str, st.Step]:
    return {s.id: s for s in build_plan(detect_host(root), Options(driver="skip", **opt))}


# ------------------------------------------------------------------ item 1: adopt the engine that is there


def test_docker_ce_is_detected_and_kept(tmp_path):
    root = docker_ce_host(tmp_path)
    engines = {e["name"]: e for e in detect_host(root).to_dict()["engines"]}
    assert engines["docker"]["origin"]["source"] == "docker-ce"
    assert engines["docker"]["origin"]["description"] == "Docker CE 28.0.1 (docker-ce)"
    assert engines["docker"]["origin"]["unit"] == "docker" and engines["docker"]["origin"]["pid"] is None
    assert engines["containerd"]["origin"]["package"] == "containerd.io"
    steps = plan(root)
    assert steps["engine.present"].title == "Docker CE 28.0.1 (docker-ce): kept"
    assert steps["engine.present"].verify_only and not steps["engine.present"].commands
    assert "engine.packages" not in steps and "engine.repo" not in steps
    assert not any("apt-get" in " ".join(c.argv) for s in steps.values() for c in s.commands
                   if c.argv[:2] != ("apt-get", "install") or "-f" not in c.argv)  # only dpkg's repair step
    steps = plan(root, engine="containerd")
    assert steps["engine.present"].title == "containerd.io (Docker CE) 1.7.25 (containerd.io): kept"


def test_a_half_installed_engine_package_is_completed_not_kept(tmp_path):
    """A run killed while dpkg unpacked docker.io leaves its binary: that is no static dockerd to keep, the install
    step completes the package."""
    root = make_host(tmp_path, "debian-12", "none", kernel=KERNEL)
    dpkg(root, ("docker.io", "20.10.24+dfsg1-1+deb12u1+b6", "Debian Go Packaging Team", ("/usr/sbin/dockerd",)))
    status = root / "var/lib/dpkg/status"
    status.write_text(status.read_text().replace("install ok installed", "install ok half-configured"))
    binary(root, "/usr/sbin/dockerd")
    assert [e.origin for e in detect_host(root).engines if e.name == "docker"] == [None]
    assert "engine.packages" in plan(root)


def test_an_install_is_planned_only_where_none_is_found_or_asked(tmp_path):
    root = make_host(tmp_path, "debian-12", "none", kernel=KERNEL)
    (root / "etc/docker").mkdir(parents=True)
    (root / "etc/docker/daemon.json").write_text("{}\n")  # a config alone is no engine
    assert "engine.packages" in plan(root) and "engine.present" not in plan(root)
    asked = plan(docker_ce_host(tmp_path / "b"), engine_source="distro")  # explicit: installed (item 2 guards it)
    assert "engine.packages" in asked and "engine.present" not in asked


def test_static_dockerd_with_its_own_config_file(tmp_path):
    """No package owns the running dockerd; it reads /srv/docker.json: that file is the one configured."""
    root = make_host(tmp_path, "debian-12", "none", kernel=KERNEL)
    dpkg(root, ("containerd", "1.6.20~ds1-1+deb12u3", "Debian Go Packaging Team", ("/usr/bin/containerd",)))
    binary(root, "/usr/local/bin/dockerd")
    daemon(root, 4242, "dockerd", ["dockerd", "--config-file", "/srv/docker.json"], "/usr/local/bin/dockerd")
    (root / "srv").mkdir()
    (root / "srv/docker.json").write_text('{"log-level": "warn"}\n')
    [docker] = [e for e in detect_host(root).engines if e.name == "docker"]
    assert docker.origin.source == "static" and docker.origin.package is None and docker.origin.pid == 4242
    assert docker.config_path == "/srv/docker.json" and docker.config_exists
    steps = plan(root)
    assert steps["engine.present"].title == ("dockerd from static binaries (/usr/local/bin/dockerd, no package owns "
                                             "it): kept")
    (action,) = steps["engine.config"].actions
    assert action.config == "/srv/docker.json" and steps["engine.config"].check.action is action
    assert "engine.service" not in steps  # running, and no unit to start it with
    assert '+      "path": "/usr/local/bin/gpuprov-runtime",' in steps["engine.config"].diffs(root)["/srv/docker.json"]


def test_snap_docker_config(tmp_path):
    root = make_host(tmp_path, "ubuntu-24.04", "none", kernel=KERNEL)
    (root / "var/snap/docker/current/config").mkdir(parents=True)
    (root / "var/snap/docker/current/config/daemon.json").write_text("{}\n")
    daemon(root, 77, "dockerd", ["dockerd", "--group", "docker"], "/snap/docker/3064/bin/dockerd")
    [docker] = [e for e in detect_host(root).engines if e.name == "docker"]
    assert (docker.origin.source, docker.origin.unit) == ("snap", "snap.docker.dockerd")
    assert docker.config_path == "/var/snap/docker/current/config/daemon.json"
    (action,) = plan(root)["engine.config"].actions
    assert action.config == "/var/snap/docker/current/config/daemon.json"


# ------------------------------------------------------------------ item 2: never remove a package by accident

APT_SIM = """NOTE: This is only a simulation!
The following packages will be REMOVED:
  containerd.io docker-ce docker-ce-cli
The following NEW packages will be installed:
  containerd docker.io runc
Remv docker-ce [5:28.0.1-1~debian.12~bookworm]
Remv containerd.io [1.7.25-1]
Remv docker-ce-cli [5:28.0.1-1~debian.12~bookworm]
Inst runc (1.1.5+ds1-1+deb12u1 Debian:12.15/oldstable [amd64])
Conf runc (1.1.5+ds1-1+deb12u1 Debian:12.15/oldstable [amd64])
"""
DNF_ASSUMENO = """Last metadata expiration check: 0:01:02 ago on Wed 25 Nov 2026 10:00:00 AM UTC.
Dependencies resolved.
================================================================================
 Package              Arch     Version              Repository            Size
================================================================================
Installing:
 docker-ce            x86_64   3:28.0.1-1.el9       docker-ce-stable      22 M
     replacing  moby-engine.x86_64 24.0.5-1.el9
Installing dependencies:
 containerd.io        x86_64   1.7.25-3.1.el9       docker-ce-stable      43 M
Removing dependent packages:
 podman-docker        noarch   4:4.9.4-1.el9        @appstream            11 k

Transaction Summary
================================================================================
Install  2 Packages
Remove   1 Package

Operation aborted.
"""


def test_removals_are_read_from_the_package_managers_dry_run():
    assert package_managers.get("apt").removals(APT_SIM) == ["docker-ce", "containerd.io", "docker-ce-cli"]
    assert package_managers.get("dnf").removals(DNF_ASSUMENO) == ["moby-engine", "podman-docker"]
    assert package_managers.get("apt").removals("Inst runc (1.1.5)\n") == []
    assert package_managers.get("dnf").removals("Nothing to do.\nComplete!\n") == []


# Debian's dnf 4.14 on an EL host container (tests/integration/test_el_cuda.py), `dnf remove --assumeno …`: a name
# wider than its column is on a line of its own, the row's other fields on the next
DNF_WRAPPED = """Dependencies resolved.
================================================================================
 Package                       Arch   Version               Repository     Size
================================================================================
Removing:
 dkms                          noarch 3.1.6-1.el9           @epel          26
 epel-release                  noarch 9-9.el9               @@commandline 2.1 k
 python3-dnf-plugin-versionlock
                               noarch 4.3.0-16.el9          @appstream     12 k

Transaction Summary
================================================================================
Remove  3 Packages

Operation aborted.
"""


def test_a_wrapped_dnf_row_is_one_package():
    """On the previous commit the wrapped row's second line read as a package named `noarch`: `uninstall
    --purge-driver` stopped with exit 14 ("would also remove noarch, which gpuprov did not install")."""
    assert package_managers.get("dnf").removals(DNF_WRAPPED) == ["dkms", "epel-release", "python3-dnf-plugin-versionlock"]


class Runs:
    """effects.run recorded, answering the dry run with `sim`."""

    def __init__(self, monkeypatch, sim: str):
        self.argvs: list[tuple[str, ...]] = []

        def run(argv, check=True, env=None, timeout=None, input_text=None, private_stdout=False, probe=False):
            if probe:  # the package database read before and after an install (its result in words)
                return st.effects.CommandResult(list(argv), 0, "", "")
            self.argvs.append(tuple(argv))
            out = sim if "-s" in argv or "--assumeno" in argv else ""
            return st.effects.CommandResult(list(argv), 0, out, out)
        monkeypatch.setattr(st.effects, "run", run)


@pytest.mark.parametrize("manager,sim", [("apt", APT_SIM), ("dnf", DNF_ASSUMENO)])
def test_an_install_that_would_remove_stops_before_it_runs(monkeypatch, manager, sim):
    rec = Runs(monkeypatch, sim)
    with pytest.raises(GpuprovError) as e:
        PackageInstall(manager, ("docker.io",)).execute()
    assert e.value.exit_code == CONFLICT and "--allow-remove" in str(e.value)
    assert ("docker-ce" if manager == "apt" else "moby-engine") in str(e.value)
    assert len(rec.argvs) == 1  # the dry run only: the install never ran
    allowed = PackageInstall(manager, ("docker.io",), allow_remove=True)
    allowed.execute()
    assert rec.argvs[-1] == allowed.install().argv and "--no-remove" not in rec.argvs[-1]


def test_every_install_in_every_plan_is_removal_safe(tmp_path):
    """No apt/dnf/yum install argv in any golden plan can remove: apt's carry --no-remove, dnf/yum's never
    --allowerasing, and each is preceded by its dry run."""
    for path in sorted(Path(__file__).parents[1].joinpath("golden").glob("*.json")):
        for step in json.loads(path.read_text())["steps"]:
            cmds = [c[2:].split("NEEDRESTART_MODE=a ")[-1] for c in step["actions"] if c.startswith("$ ")]
            for i, c in enumerate(cmds):
                words = c.split()
                if words[:1] == ["apt-get"] and "install" in words and "-s" not in words:
                    assert "--no-remove" in words, (path.name, c)
                    assert "-f" in words or cmds[i - 1].split()[1] == "-s", (path.name, c)
                if words[:1] in (["dnf"], ["yum"]) and "install" in words and "--assumeno" not in words:
                    assert "--allowerasing" not in words and "--assumeno" in cmds[i - 1], (path.name, c)


@pytest.mark.skipif(subprocess.run(["dpkg-query", "-W", "-f", "${Status}", "docker.io"], capture_output=True,
                                   text=True).stdout != "install ok installed", reason="needs docker.io installed "
                    "(the CI machine's engine)")
def test_real_apt_says_what_an_install_would_remove():
    """This machine's own apt, asked only to simulate: podman-docker conflicts with the docker.io installed here."""
    with pytest.raises(GpuprovError) as e:
        PackageInstall("apt", ("podman-docker",)).check_removals()
    assert e.value.exit_code == CONFLICT and "docker.io" in str(e.value)


# ------------------------------------------------------------------ item 3: a driver installed, not loaded


def gpu_host(tmp_path: Path) -> Path:
    return make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL)


def driver_plan(root: Path, driver: str = "auto") -> dict[str, st.Step]:
    rep = detect_host(root, engines=False, pin=driver if driver.isdigit() else None)
    return {s.id: s for s in build_plan(rep, Options(driver=driver, engine="none")) if s.id.startswith("driver.")}


def test_cuda_repository_driver_is_kept(tmp_path):
    root = gpu_host(tmp_path)
    dpkg(root, ("cuda-drivers", "580.95.05-1", "cudatools <cudatools@nvidia.com>", ()),
         ("nvidia-driver", "580.95.05-1", "cudatools <cudatools@nvidia.com>", ()))
    (root / f"lib/modules/{KERNEL}/updates/dkms").mkdir(parents=True)
    (root / f"lib/modules/{KERNEL}/updates/dkms/nvidia.ko.xz").write_text("")
    (root / "run").mkdir(exist_ok=True)
    (root / "run/reboot-required").write_text("*** System restart required ***\n")
    steps = driver_plan(root)
    assert list(steps) == ["driver.installed"], list(steps)
    s = steps["driver.installed"]
    assert s.title == ("NVIDIA driver 580.95.05 from NVIDIA's CUDA repository (cuda-drivers nvidia-driver): "
                       "installed, not loaded: kept (no driver step)")
    assert any(KERNEL in n for n in s.notes) and any("reboot is pending" in n for n in s.notes)
    assert any("apt-get purge cuda-drivers nvidia-driver" in n for n in s.notes)
    # a branch asked does not replace it either, and is refused rather than skipped (issue 43 item 2): exit 14
    # with the way out
    with pytest.raises(GpuprovError) as refused:
        driver_plan(root, "535")
    assert refused.value.exit_code == CONFLICT and "--driver 535" in str(refused.value), refused.value
    assert "apt-get purge cuda-drivers nvidia-driver" in str(refused.value)


def test_run_installer_driver_is_kept(tmp_path):
    root = gpu_host(tmp_path)
    binary(root, "/usr/bin/nvidia-installer")
    (root / f"lib/modules/{KERNEL}/kernel/drivers/video").mkdir(parents=True)
    (root / f"lib/modules/{KERNEL}/kernel/drivers/video/nvidia.ko").write_text("")
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.86.10").write_text("")
    [s] = driver_plan(root).values()
    assert s.id == "driver.installed" and "570.86.10 from NVIDIA's .run installer" in s.title
    assert any("nvidia-installer --uninstall" in n for n in s.notes)


def test_distro_driver_of_another_branch_is_kept_unless_a_branch_is_asked(tmp_path):
    root = gpu_host(tmp_path)
    debian = "Debian NVIDIA Maintainers <pkg-nvidia-devel@lists.alioth.debian.org>"
    dpkg(root, ("nvidia-tesla-470-driver", "470.256.02-1", debian, ()),
         ("nvidia-tesla-470-kernel-dkms", "470.256.02-1", debian, ()))
    assert list(driver_plan(root)) == ["driver.installed"]
    assert "driver.packages" in driver_plan(root, "535")  # --driver names a branch: the change is planned


def test_the_plans_own_driver_packages_are_not_kept(tmp_path):
    """gpuprov's own install, before its reboot: the usual steps, whose checks say what is done."""
    root = gpu_host(tmp_path)
    debian = "Debian NVIDIA Maintainers <pkg-nvidia-devel@lists.alioth.debian.org>"
    dpkg(root, ("nvidia-driver", "535.247.01-1~deb12u1", debian, ()),
         ("nvidia-open-kernel-dkms", "535.247.01-1~deb12u1", debian, ()))
    steps = driver_plan(root)
    assert "driver.installed" not in steps and "driver.packages" in steps
    assert "driver.installed" not in driver_plan(gpu_host(tmp_path / "bare"))  # nothing installed


def test_owner_found_through_a_multi_arch_file_list(tmp_path):
    """dpkg names a Multi-Arch: same package's file list info/NAME:ARCH.list: the origin is still that package (the
    list is looked up by name, not found by listing info/)."""
    root = docker_ce_host(tmp_path)
    info = root / "var/lib/dpkg/info"
    (info / "containerd.io.list").rename(info / "containerd.io:amd64.list")
    origin = next(e for e in detect_host(root).engines if e.name == "containerd").origin
    assert (origin.source, origin.package) == ("docker-ce", "containerd.io"), origin
    (info / "containerd.io:amd64.list").write_text("/usr/bin/something-else\n")
    origin = next(e for e in detect_host(root).engines if e.name == "containerd").origin
    assert origin.source == "static", origin  # no package owns it

"""Issue 44: a run killed while dpkg unpacks converges too. What a killed dpkg leaves, read from its status file as
dpkg writes it (the stanzas below are dpkg 1.21's, from a bookworm host killed with SIGKILL in the middle of
unpacking libdevmapper1.02.1 and configuring dmsetup, as in the issue): the recover step reinstalls exactly the
versions dpkg needs unpacked again, before apt repairs the rest; a version apt can no longer fetch stops the plan
before any change (exit 4), naming the package and the way out; the step's check sees every unfinished state. The
real kill at each of dpkg's phases: tests/integration/test_dpkg_killed.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision.errors import Unsupported
from provision.facts.packages import UNFINISHED_STATES, dpkg_unfinished
from provision.options import Stage
from provision.plan.build import recover_step

LIB = ("libdevmapper1.02.1", "2:1.02.185-2", "install reinstreq half-installed")
DMSETUP = ("dmsetup", "2:1.02.185-2", "install ok unpacked")
OK = ("libc6", "2.36-9+deb12u14", "install ok installed")


def status(root: Path, *pkgs: tuple[str, str, str]) -> Path:
    d = root / "var/lib/dpkg"
    (d / "updates").mkdir(parents=True, exist_ok=True)
    (d / "status").write_text("".join(
        f"Package: {n}\nStatus: {s}\nPriority: optional\nSection: libs\nMaintainer: Debian\nArchitecture: amd64\n"
        f"Multi-Arch: same\nVersion: {v}\nDescription: x\n\n" for n, v, s in pkgs))
    return root


def offered(root: Path, *pkgs: tuple[str, str, str]) -> None:
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True, exist_ok=True)
    (lists / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages").write_text("".join(
        f"Package: {n}\nSource: lvm2\nVersion: {v}\nArchitecture: amd64\nFilename: pool/x.deb\n\n" for n, v, _ in pkgs))


def actions(step) -> list[str]:
    return [ln for ln in step.lines() if ln.startswith("$ ")]


def test_reinstall_required_is_unpacked_again_at_its_version_before_apt_repairs(tmp_path):
    root = status(tmp_path, OK, LIB, DMSETUP)
    offered(root, LIB, DMSETUP)
    step = recover_step(Stage.DRIVER, root=root)
    cmds = actions(step)
    assert cmds[0].endswith("dpkg --configure -a || true")  # allowed to fail: it does for a reinstall-required one
    assert cmds[1].endswith("apt-get install --reinstall -y --no-install-recommends --no-remove "
                            "libdevmapper1.02.1=2:1.02.185-2"), cmds
    assert cmds[2].endswith("apt-get install -f -y --no-install-recommends --no-remove") and len(cmds) == 3
    assert "reinstall libdevmapper1.02.1=2:1.02.185-2" in step.title and "dmsetup (unpacked)" in step.title
    assert not step.check.satisfied(root)


def test_a_version_apt_cannot_fetch_stops_before_any_change(tmp_path):
    root = status(tmp_path, OK, LIB)
    offered(root, ("libdevmapper1.02.1", "2:1.02.185-3", ""))  # the archive moved on
    with pytest.raises(Unsupported) as err:
        recover_step(Stage.DRIVER, root=root)
    msg = str(err.value)
    assert err.value.exit_code == 4 and "\n" not in msg
    assert "libdevmapper1.02.1 2:1.02.185-2 half-installed" in msg and "/var/cache/apt/archives" in msg
    assert "apt-get install --reinstall libdevmapper1.02.1" in msg


def test_a_cached_deb_is_enough(tmp_path):
    root = status(tmp_path, OK, LIB)
    cache = root / "var/cache/apt/archives"
    cache.mkdir(parents=True)
    (cache / "libdevmapper1.02.1_2%3a1.02.185-2_amd64.deb").write_bytes(b"!<arch>\n")  # apt's name: epoch as %3a
    assert "libdevmapper1.02.1=2:1.02.185-2" in actions(recover_step(Stage.DRIVER, root=root))[1]


@pytest.mark.parametrize("state", UNFINISHED_STATES)
def test_every_unfinished_state_is_seen(tmp_path, state):
    root = status(tmp_path, OK, ("nvidia-kernel-dkms", "535.261.03-1", f"install ok {state}"))
    offered(root, ("nvidia-kernel-dkms", "535.261.03-1", ""))
    (u,) = dpkg_unfinished(root)
    assert u.state == state and u.reinstall == (state == "half-installed")
    assert not recover_step(Stage.DRIVER, root=root).check.satisfied(root)


def test_a_finished_dpkg_needs_nothing(tmp_path):
    root = status(tmp_path, OK, ("dmsetup", "2:1.02.185-2", "install ok installed"),
                  ("old-pkg", "1.0", "deinstall ok config-files"))
    step = recover_step(Stage.DRIVER, root=root)
    assert step.check.satisfied(root) and len(actions(step)) == 2
    (root / "var/lib/dpkg/updates/0001").write_text("")  # the journal dpkg had not yet folded in
    assert not step.check.satisfied(root)


def test_the_journal_a_killed_run_left_is_read_as_dpkg_reads_it(tmp_path):
    """A run killed mid-unpack recorded the package's state only in dpkg's journal (updates/NNNN), not yet folded into
    the status file (seen: the status file still said installed at the old version)."""
    root = status(tmp_path, OK, ("libdevmapper1.02.1", "2:1.02.185-1", "install ok installed"))
    offered(root, LIB)
    (root / "var/lib/dpkg/updates/0000").write_text(
        f"Package: {LIB[0]}\nStatus: {LIB[2]}\nArchitecture: amd64\nVersion: {LIB[1]}\n\n")
    (u,) = dpkg_unfinished(root)
    assert (u.name, u.version, u.state, u.reinstall) == (LIB[0], LIB[1], "half-installed", True)
    assert "libdevmapper1.02.1=2:1.02.185-2" in actions(recover_step(Stage.DRIVER, root=root))[1]

"""Issue 39 item 7: a host whose /tmp is mounted noexec (or nodev). `./install.sh` failed with a bare `Permission
denied` (pip builds gpuprov's wheel there, the dry run's virtualenv runs from there), and so did `bundle create`'s
debootstrap (it runs the new root's programs and opens its device nodes there). Both now stop before they do
anything, naming the directory, the mount option and the way out (`TMPDIR=`). Each test mounts a noexec,nodev tmpfs
in a private mount namespace and points TMPDIR at it: the host's own /tmp is untouched."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import needs
from tests.faults.conftest import root_only

REPO = Path(__file__).resolve().parents[2]


def _under_noexec_tmp(tmp_path: Path, argv: list[str], **env) -> subprocess.CompletedProcess:
    mnt = tmp_path / "tmp"
    mnt.mkdir(parents=True)
    script = f'mount -t tmpfs -o noexec,nodev gpuprov-test {mnt} && exec "$@"'
    e = {**os.environ, "TMPDIR": str(mnt), "PYTHONPATH": str(REPO), **env}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          capture_output=True, text=True, env=e, timeout=300)


@needs("unshare", "findmnt")
@root_only
def test_install_sh_names_a_noexec_tmp_and_the_fix(tmp_path):
    """On main: `Permission denied` from the throwaway virtualenv's pip (dry run), exit 126."""
    for args in (["--dry-run"], ["--install-only"]):
        r = _under_noexec_tmp(tmp_path / args[0].lstrip("-"), ["bash", str(REPO / "install.sh"), *args],
                              GPUPROV_PREFIX=str(tmp_path / "venv"), GPUPROV_BIN_DIR=str(tmp_path / "bin"))
        assert r.returncode == 4, r.stdout + r.stderr
        mnt = tmp_path / args[0].lstrip("-") / "tmp"
        assert f"programs cannot run from {mnt} (it is mounted noexec)" in r.stderr, r.stderr
        assert f"TMPDIR=/var/tmp {REPO / 'install.sh'} {args[0]}" in r.stderr and "nothing was installed" in r.stderr
        assert not (tmp_path / "venv").exists() and not (tmp_path / "bin").exists()


@needs("unshare")
@root_only
def test_bundle_create_names_a_noexec_nodev_tmp_before_any_download(tmp_path):
    """On main: debootstrap's own failure after it had fetched the base system (`Permission denied`)."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "docker").write_text("#!/bin/sh\nexit 1\n")  # no image of the target yet: debootstrap would build it
    (stub / "docker").chmod(0o755)
    out = tmp_path / "b"
    r = _under_noexec_tmp(tmp_path, [sys.executable, "-m", "provision", "bundle", "create", "--target", "debian-12",
                                     "--components", "engine", "--output", str(out)],
                          PATH=f"{stub}:{os.environ['PATH']}")
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"{tmp_path / 'tmp'} is mounted noexec,nodev" in r.stderr and "TMPDIR=/var/tmp" in r.stderr, r.stderr
    assert "nothing was downloaded" in r.stderr and not out.exists()

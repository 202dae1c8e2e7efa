"""Fault injection: real mounts (tmpfs full, read-only), real signals, real concurrent gpuprov processes. Each test
asserts *nothing lost* (bytes, links, modes, owners, backups) and the documented exit code (README's table)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI, run_cli

RT = "/usr/local/bin/gpuprov-runtime"
# The README's exit codes, spelled out here so these tests also run against an older gpuprov (they must fail there).
CONFIG_INVALID, HOST_BUSY, DECLINED, WRITE_FAILED, CONFLICT = 6, 11, 12, 13, 14

root_only = pytest.mark.skipif(os.geteuid() != 0 and not IN_CI, reason="needs root (mounts, chown)")


def configure(path: Path, *args: str, lock_dir: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """`gpuprov engine configure docker --config PATH --no-restart …` as an operator runs it. A private lock dir keeps
    these tests from queueing behind real gpuprov runs on the same machine (the lock logic is the same)."""
    env = {"GPUPROV_LOCK_DIR": str(lock_dir or path.parent / ".lock")}
    return run_cli("engine", "configure", "docker", "--config", str(path), "--runtime-path", RT, "--no-restart",
                   *args, env=env, **kw)


def snapshot(d: Path) -> dict[str, tuple]:
    """Everything in a directory that an operator could lose: names, link targets, bytes, modes, owners."""
    out = {}
    for p in sorted(d.iterdir()):
        st = p.lstat()
        out[p.name] = (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir",
                       st.st_mode, st.st_uid, st.st_gid)
    return out


def backups(d: Path, name: str = "daemon.json") -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(f"{name}.gpuprov-") and p.name.endswith(".bak"))


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(size) -> a fresh tmpfs directory of that size (unmounted afterwards)."""
    mounts = []

    def make(size: str, name: str = "mnt") -> Path:
        d = tmp_path / name
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)], check=True)
        mounts.append(d)
        return d

    yield make
    for d in reversed(mounts):
        subprocess.run(["umount", "-l", str(d)], check=False)


def user_daemon_json(pad: int = 0) -> bytes:
    doc = {"data-root": "/srv/docker", "log-driver": "json-file", "log-opts": {"max-size": "10m"},
           "runtimes": {"kata": {"path": "/opt/kata/bin/kata-runtime"}}}
    if pad:
        doc["labels"] = ["x" * pad]
    return (json.dumps(doc, indent=4) + "\n").encode()


@pytest.fixture
def base(tmp_path, monkeypatch):
    """Where gpuprov unpacks or copies bundles (GPUPROV_BUNDLE_DIR); the default place is checked to stay untouched
    as well."""
    from provision import paths
    from tests.bundles import listing

    d = tmp_path / "unpack-base"
    monkeypatch.setenv("GPUPROV_BUNDLE_DIR", str(d))
    before = listing(Path(paths.BUNDLES))
    yield d
    assert listing(Path(paths.BUNDLES)) == before, "something was left under /var/lib/gpuprov/bundles"

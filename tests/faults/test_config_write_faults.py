"""The one write path under faults: a full disk, a read-only mount, a symlinked daemon.json, owners and modes,
backups in the same second, SIGKILL in the middle of a write."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import gpuprov_bin
from tests.faults.conftest import RT, WRITE_FAILED, backups, configure, root_only, snapshot, user_daemon_json

pytestmark = root_only


def _fill(d: Path, leave: int) -> None:
    """Fill the filesystem of `d` so that about `leave` bytes stay free."""
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    with open(d / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))


def test_disk_full_leaves_file_and_no_backup(mount_tmpfs):
    """ENOSPC at each stage (no room for the backup; room for the backup but not the new file): exit 13, one line,
    the file byte-identical, no backup (or partial backup) and no temp file left."""
    for leave in (64 * 1024, 300 * 1024):
        d = mount_tmpfs("1m", f"full-{leave}")
        p = d / "daemon.json"
        p.write_bytes(user_daemon_json(pad=200 * 1024))
        os.chmod(p, 0o640)
        _fill(d, leave)
        before = snapshot(d)
        r = configure(p, lock_dir=d.parent / "lock")
        assert r.returncode == WRITE_FAILED, (leave, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "No space left on device" in r.stderr
        assert "was not changed" in r.stderr
        assert snapshot(d) == before  # nothing written, nothing left behind: no .bak, no temp file


def test_read_only_mount(mount_tmpfs):
    d = mount_tmpfs("1m", "ro")
    p = d / "daemon.json"
    p.write_bytes(user_daemon_json())
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
    before = snapshot(d)
    r = configure(p, lock_dir=d.parent / "lock")
    assert r.returncode == WRITE_FAILED, r.stderr
    assert "Read-only file system" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert snapshot(d) == before


def test_symlinked_config_stays_a_link_and_keeps_owner_and_mode(tmp_path):
    """/etc/docker/daemon.json -> a file kept elsewhere (a git checkout): the link stays, the target is edited, the
    target's mode and owner are kept, and the backup beside it has the same mode, owner and the old bytes."""
    etc = tmp_path / "etc-docker"
    conf = tmp_path / "srv" / "conf"
    etc.mkdir()
    conf.mkdir(parents=True)
    target = conf / "daemon.json"
    old = user_daemon_json()
    target.write_bytes(old)
    os.chown(target, 1234, 5678)
    os.chmod(target, 0o640)
    link = etc / "daemon.json"
    link.symlink_to("../srv/conf/daemon.json")
    r = configure(link, lock_dir=tmp_path / "lock")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and os.readlink(link) == "../srv/conf/daemon.json"
    assert sorted(p.name for p in etc.iterdir()) == ["daemon.json"]
    st = target.stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o640, 1234, 5678)
    assert json.loads(target.read_text())["runtimes"]["nvidia"]["path"] == RT
    [bak] = backups(conf)
    bst = bak.stat()
    assert bak.read_bytes() == old and (bst.st_mode & 0o7777, bst.st_uid, bst.st_gid) == (0o640, 1234, 5678)


def test_backups_in_the_same_second_are_all_kept(tmp_path, monkeypatch):
    """Three edits within one second: three backups, each holding exactly the content before its edit. The clock
    that names backups is held at one second (on a loaded machine three real edits can straddle a second)."""
    import provision.fsutil as fsutil
    from provision.engines.configure import configure as configure_api

    frozen = time.localtime()
    real_strftime = time.strftime
    monkeypatch.setattr(fsutil.time, "strftime", lambda fmt, t=None: real_strftime(fmt, frozen if t is None else t))
    p = tmp_path / "daemon.json"
    p.write_bytes(user_daemon_json())
    versions = []
    for i in range(3):
        versions.append(p.read_bytes())
        configure_api("docker", config=str(p), runtime_name=f"rt{i}", runtime_path=RT, restart=False)
    found = backups(tmp_path)
    assert len(found) == 3, [b.name for b in found]
    assert sorted(b.read_bytes() for b in found) == sorted(versions)
    assert len({b.name[len("daemon.json.gpuprov-"):][:14] for b in found}) == 1  # really the same second


def test_sigkill_during_writes(tmp_path):
    """Kill a real `gpuprov engine configure` at random moments and right when a new name appears in the directory
    (the middle of a backup or of the new file), many times: daemon.json is always the old or the new version and
    valid JSON, and every backup is a complete earlier version (never a partial copy under a .bak name)."""
    d = tmp_path / "etc"
    d.mkdir()
    p = d / "daemon.json"
    p.write_bytes(user_daemon_json(pad=2 * 1024 * 1024))  # a large file widens the write window
    versions = {p.read_bytes()}
    rng = random.Random(1234)
    env = {**os.environ, "GPUPROV_LOCK_DIR": str(tmp_path / "lock")}
    t0 = time.monotonic()
    probe = subprocess.run([*gpuprov_bin(), "engine", "configure", "docker", "--config", str(p), "--runtime-path",
                            RT, "--runtime-name", "probe", "--no-restart", "--dry-run"], env=env, capture_output=True)
    assert probe.returncode == 0
    span = time.monotonic() - t0
    kills = 0
    for i in range(90):  # until 30 writers ran and 15 of them were killed (fewer land in time on a loaded machine)
        if i >= 30 and kills >= 15:
            break
        before = p.read_bytes()
        names = {e.name for e in os.scandir(d)}
        proc = subprocess.Popen([*gpuprov_bin(), "engine", "configure", "docker", "--config", str(p),
                                 "--runtime-path", RT, "--runtime-name", f"rt{i}", "--no-restart"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if i % 2:  # the moment a new directory entry shows up: inside the backup or the new file's write
            deadline = time.monotonic() + 3 * span + 5
            while proc.poll() is None and time.monotonic() < deadline:
                if {e.name for e in os.scandir(d)} - names:
                    break
        else:
            time.sleep(rng.uniform(0.5, 1.2) * span)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        now = p.read_bytes()
        doc = json.loads(now)  # always valid
        assert now == before or doc["runtimes"].get(f"rt{i}", {}).get("path") == RT
        versions.add(now)
        for bak in backups(d):
            assert bak.read_bytes() in versions, f"{bak.name} is not a complete earlier version"
    assert kills >= 15  # the test really killed writers

"""Nobody in, round two (issue 19, items 9-11): files root writes and reads back.

- 9: no write through a link another user planted (metrics --textfile, k8s manifests --output: the one write path
  refuses it, exit 6, and a directory others can write without the sticky bit unless --allow-shared-dir);
- 10: state is root's whatever the umask: directories made with explicit modes; state and caches read back only when
  they and every directory above them are root's alone (else a cache miss, or a refusal);
- 11: an operator's save between gpuprov's read and its rename is never lost: re-read and re-merged, exit 14 after a
  few tries.

"Another user" is `nobody` (uid 65534) for real: its links and files are made by a process running as nobody
(setpriv), in directories under a world-traversable scratch directory."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.faults.conftest import CONFIG_INVALID, CONFLICT, RT, root_only, user_daemon_json

pytestmark = root_only

NOBODY = 65534
SECRET = b"root-only secret\n"


def as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv], check=True)


@pytest.fixture
def scratch():
    """A directory nobody can reach (tmp_path's parents are 0700), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="gpuprov-writes-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def victim(scratch) -> Path:
    """A root-only file a planted link points at."""
    v = scratch / "victim"
    v.write_bytes(SECRET)
    v.chmod(0o600)
    return v


def untouched(v: Path) -> bool:
    st = v.lstat()
    return v.read_bytes() == SECRET and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


METRICS = ("import sys\nfrom provision.commands import metrics\nmetrics._collect = lambda: 'gpuprov_test 1\\n'\n"
           "from provision.cli import main\nsys.exit(main(sys.argv[1:]))")


def metrics_cli(*args: str) -> subprocess.CompletedProcess:
    """`gpuprov metrics …` through the real command line, with the readings stubbed (no GPU here): what is under test
    is where the text goes."""
    return subprocess.run([sys.executable, "-c", METRICS, "metrics", *args], capture_output=True, text=True,
                          cwd=REPO)


def manifests_cli(out: Path, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    (tmp / "runtime.json").write_text(json.dumps({"share_state": str(tmp / "share.json")}))
    return run_cli("k8s", "manifests", "--output", str(out), *args,
                   env={"GPUPROV_RUNTIME_CONFIG": str(tmp / "runtime.json")})


# --- 9: never write through a planted link ---------------------------------------------------------------------

def test_metrics_textfile_refuses_a_link_another_user_planted(scratch, victim):
    """A collector directory like /tmp (sticky, everyone may add names): nobody plants gpuprov.prom -> a root-only
    file. Exit 6 in one line naming the link; the root-only file keeps its bytes and its 0600 mode."""
    d = scratch / "textfile"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    as_nobody("ln", "-s", str(victim), str(d / "gpuprov.prom"))
    r = metrics_cli("--textfile", str(d))
    assert r.returncode == CONFIG_INVALID, r.stderr
    assert "gpuprov.prom is a symlink another user could have planted" in one_line(r)
    assert untouched(victim) and (d / "gpuprov.prom").is_symlink()


def test_k8s_manifests_refuses_planted_links_in_the_file_and_on_the_way(scratch, victim, tmp_path):
    """--output DIR where nobody planted runtimeclass.yaml -> the root-only file; and --output through a link nobody
    planted as a directory on the way (DIR/out -> /etc-like root directory): both exit 6, nothing written."""
    d = scratch / "out"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    as_nobody("ln", "-s", str(victim), str(d / "runtimeclass.yaml"))
    r = manifests_cli(d, tmp=tmp_path)
    assert r.returncode == CONFIG_INVALID, r.stderr
    assert "runtimeclass.yaml is a symlink another user could have planted" in one_line(r)
    assert untouched(victim) and sorted(p.name for p in d.iterdir()) == ["runtimeclass.yaml"]

    etc = scratch / "etc-like"
    etc.mkdir(mode=0o755)
    as_nobody("ln", "-s", str(etc), str(d / "via"))
    r = manifests_cli(d / "via", tmp=tmp_path)
    assert r.returncode == CONFIG_INVALID and "via is a symlink another user could have planted" in one_line(r)
    assert list(etc.iterdir()) == []


def test_root_link_in_a_directory_others_can_write_is_refused(scratch, victim, tmp_path):
    """A link that is root's but sits in a directory another user owns: that user could have swapped it, so it is
    not followed either ("the link and every directory on its way")."""
    d = scratch / "theirs"
    d.mkdir()
    os.symlink(victim, d / "gpuprov.prom")
    os.chown(d, NOBODY, NOBODY)
    for extra in ((), ("--allow-shared-dir",)):
        r = metrics_cli("--textfile", str(d), *extra)
        assert r.returncode == CONFIG_INVALID and "which others can write" in one_line(r), r.stderr
    assert untouched(victim)


def test_shared_directory_needs_the_option_and_links_stay_refused(scratch, victim):
    """A directory another user owns (node-exporter's collector directory), no sticky bit: exit 6 naming
    --allow-shared-dir, nothing written. With the option: written, a regular root-owned 0644 file (replaced, never
    written through), no temporary left. A link planted there is refused even with the option."""
    d = scratch / "collector"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    r = metrics_cli("--textfile", str(d))
    assert r.returncode == CONFIG_INVALID, r.stderr
    line = one_line(r)
    assert str(d) in line and "--allow-shared-dir" in line and f"uid {NOBODY}" in line
    assert list(d.iterdir()) == []

    r = metrics_cli("--textfile", str(d), "--allow-shared-dir")
    assert r.returncode == 0, r.stderr
    prom = d / "gpuprov.prom"
    st = prom.lstat()
    assert stat.S_ISREG(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
    assert prom.read_text() == "gpuprov_test 1\n" and [p.name for p in d.iterdir()] == ["gpuprov.prom"]

    prom.unlink()
    as_nobody("ln", "-s", str(victim), str(prom))
    r = metrics_cli("--textfile", str(d), "--allow-shared-dir")
    assert r.returncode == CONFIG_INVALID and "symlink another user could have planted" in one_line(r)
    assert untouched(victim)


def test_a_directory_where_the_file_is_expected(scratch):
    d = scratch / "textfile"
    (d / "gpuprov.prom").mkdir(parents=True)
    r = metrics_cli("--textfile", str(d))
    assert r.returncode == CONFIG_INVALID and "is not a regular file" in one_line(r)
    assert (d / "gpuprov.prom").is_dir()


def test_streamed_output_refuses_a_planted_link(scratch, victim):
    """`bundle create --output X.tar.gz` streams its tar through the same path (write_file with a writer): a link
    nobody planted at X is refused and the root-only file keeps its bytes; a fresh name gets a whole tar."""
    import tarfile

    from provision.errors import UntrustedPath
    from provision.fsutil import write_file

    d = scratch / "out"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    (scratch / "payload").write_text("x")

    def pack(fh):
        with tarfile.open(fileobj=fh, mode="w:gz") as tar:
            tar.add(scratch / "payload", arcname="payload")

    as_nobody("ln", "-s", str(victim), str(d / "bundle.tar.gz"))
    with pytest.raises(UntrustedPath):
        write_file(d / "bundle.tar.gz", pack, backup=False)
    assert untouched(victim)
    write_file(d / "fresh.tar.gz", pack, backup=False)
    assert tarfile.open(d / "fresh.tar.gz").getnames() == ["payload"]


def test_operators_own_link_is_still_followed(tmp_path):
    """Round one's rule holds with trust: root's link in root's directories is edited through, the link stays."""
    from provision.fsutil import write_file

    (tmp_path / "srv").mkdir()
    (tmp_path / "srv/daemon.json").write_text("{}\n")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/daemon.json").symlink_to("../srv/daemon.json")
    write_file(tmp_path / "etc/daemon.json", "{\"a\": 1}\n", backup=False)
    assert (tmp_path / "etc/daemon.json").is_symlink() and (tmp_path / "srv/daemon.json").read_text() == "{\"a\": 1}\n"


# --- 10: state is root's, whatever the umask ---------------------------------------------------------------------

def test_directories_get_explicit_modes_under_umask_000(tmp_path):
    """umask 000 (seen: state directories 0777): every directory gpuprov makes is 0755 — the output tree of `k8s
    manifests`, the host lock's, and the runtime's state (the discovery cache's directories) — and the files 0644."""
    env = {"GPUPROV_LOCK_DIR": str(tmp_path / "lock/a/b"), "GPUPROV_RUNTIME_CONFIG": str(tmp_path / "runtime.json")}
    (tmp_path / "runtime.json").write_text(json.dumps({"share_state": str(tmp_path / "share.json")}))
    out = tmp_path / "m/n/o"
    code = ("import os, sys\nos.umask(0)\nfrom provision.cli import main\nrc = main(['k8s', 'manifests', '--output', "
            f"{str(out)!r}])\nfrom provision.hostlock import host_lock\nwith host_lock('umask test'):\n    pass\n"
            "from provision.inject import discover\nfrom tests.inject_helpers import settings_dict as settings\n"
            "from pathlib import Path\n"
            f"s = settings(Path({str(tmp_path)!r}))\n"
            f"discover.refresh(s['driver_root'], {str(tmp_path / 'state/runtime/discovery.json')!r}, s['proc_root'], "
            "s['dev_root'])\nsys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    made = [tmp_path / p for p in ("m", "m/n", "m/n/o", "lock", "lock/a", "lock/a/b", "state", "state/runtime")]
    assert {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == \
        {str(p.relative_to(tmp_path)): "0o755" for p in made}
    files = [out / "runtimeclass.yaml", tmp_path / "state/runtime/discovery.json"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in files] == [0o644, 0o644]


def _tampered_cache(scratch: Path, victim: Path) -> tuple[dict, str]:
    """The runtime's discovery cache, written by the runtime, then rewritten by another user so that libcuda.so.1's
    source is a root-only file (the issue's attack); returns the settings and the cache path."""
    from provision.inject import discover
    from tests.inject_helpers import settings_dict as settings

    s = settings(scratch)
    state = scratch / "state"
    s["cache"] = str(state / "discovery.json")
    disc = discover.refresh(s["driver_root"], s["cache"], s["proc_root"], s["dev_root"])
    real = next(lib.path for lib in disc.libraries["compute"] if lib.soname == "libcuda.so.1")
    text = Path(s["cache"]).read_text().replace(json.dumps(real), json.dumps(str(victim)))
    assert str(victim) in text
    tmp = scratch / "forged.json"
    tmp.write_text(text)
    tmp.chmod(0o644)
    return s, str(tmp)


def test_discovery_cache_another_user_rewrote_is_a_miss(scratch, victim):
    """The cache's directory left writable by everyone (as umask 000 made it): nobody replaces discovery.json with
    one that mounts a root-only file as libcuda.so.1. The runtime treats it as a miss (it discovers again) and no
    GPU container gets the root-only file; the cache is written again, root's."""
    from provision.inject import discover, modify

    s, forged = _tampered_cache(scratch, victim)
    state = Path(s["cache"]).parent
    state.chmod(0o777)
    as_nobody("cp", forged, str(state / ".new"))
    as_nobody("mv", "-f", str(state / ".new"), s["cache"])
    assert Path(s["cache"]).stat().st_uid == NOBODY
    assert discover.load_cached(s["cache"], s["proc_root"]) is None
    from provision.inject.settings import Settings

    disc = modify.load_discovery(Settings.from_dict(s))
    assert str(victim) not in json.dumps(disc.to_dict())

    # A root-owned cache made writable by others (0666): a miss as well; once made root's 0644 again, a hit.
    state.chmod(0o755)
    Path(s["cache"]).unlink(missing_ok=True)
    discover.refresh(s["driver_root"], s["cache"], s["proc_root"], s["dev_root"])
    os.chmod(s["cache"], 0o666)
    assert discover.load_cached(s["cache"], s["proc_root"]) is None
    os.chmod(s["cache"], 0o644)
    assert discover.load_cached(s["cache"], s["proc_root"]) is not None


def test_share_state_another_user_wrote_is_refused(scratch):
    """share.json in a directory others can write, naming a live daemon: the runtime refuses GPU containers in one
    line instead of taking the pipe directory and limits from it; the CLI refuses it, exit 6."""
    from provision.errors import GpuprovError, Refused
    from provision.inject.modify import load_share_state
    from provision.share import mps
    from provision.share.state import MpsState

    run = scratch / "run"
    run.mkdir(mode=0o777)
    run.chmod(0o777)
    state = MpsState(control="/bin/true", pipe_dir=str(scratch / "pipes"), log_dir=str(scratch / "log"), gpus=(0,),
                     max_clients=None, default_memory=None, default_compute=None, max_memory=None,
                     uid=0).started("background process", os.getpid())
    path = run / "share.json"
    (scratch / "forged").write_text(state.to_json())
    as_nobody("cp", str(scratch / "forged"), str(path))
    with pytest.raises(Refused, match=r"GPU sharing state .*share.json refused"):
        load_share_state(str(path))
    with pytest.raises(GpuprovError) as exc:
        mps.load_state(str(path))
    assert exc.value.exit_code == CONFIG_INVALID and "can be written by everyone" in str(exc.value)

    run.chmod(0o755)  # the directory root's again, the file still nobody's: refused too
    with pytest.raises(Refused):
        load_share_state(str(path))
    os.chown(path, 0, 0)
    assert load_share_state(str(path)) == state


def test_bootstrap_state_others_can_write_is_refused(tmp_path, monkeypatch):
    from provision.errors import GpuprovError
    from provision.plan import resume

    p = tmp_path / "state.json"
    p.write_text(json.dumps({"reboot_required": True, "boot_id": "x", "reason": "test"}))
    monkeypatch.setattr(resume, "STATE_FILE", p)
    p.chmod(0o644)
    assert resume.read_state().reason == "test"
    p.chmod(0o666)
    with pytest.raises(GpuprovError) as exc:
        resume.read_state()
    assert exc.value.exit_code == CONFIG_INVALID and str(p) in str(exc.value)


def test_probe_cache_others_can_write_is_a_miss(tmp_path, monkeypatch):
    from provision.probe import cache

    monkeypatch.setenv("GPUPROV_CACHE_DIR", str(tmp_path / "cache"))
    cache.store("x.json", {"a": 1})
    assert cache.load("x.json") == {"a": 1}
    os.chown(tmp_path / "cache/x.json", NOBODY, NOBODY)
    assert cache.load("x.json") == {}


# --- 11: an operator's edit during gpuprov's edit is never lost --------------------------------------------------

def _operator_saves(p: Path, key: str, *, rename: bool) -> None:
    """The operator's own save: a new key in daemon.json, written in place or by rename (as editors do)."""
    doc = json.loads(p.read_text())
    doc[key] = True
    text = json.dumps(doc, indent=4) + "\n"
    if rename:
        tmp = p.with_name(".daemon.json.swp")
        tmp.write_text(text)
        os.replace(tmp, p)
    else:
        with open(p, "r+") as fh:
            fh.write(text)
            fh.truncate()


def _configure(p: Path):
    from provision.engines.configure import configure

    return configure("docker", config=str(p), runtime_path=RT, restart=False)


@pytest.mark.parametrize("rename", [False, True], ids=["in-place", "rename"])
def test_save_between_read_and_rename_is_merged_again(tmp_path, monkeypatch, rename):
    """The operator saves daemon.json after the adapter read it (its plan) and before the rename: the write path sees
    the change (inode, size, mtime, hash), reads and merges again; both the operator's key and the runtime are in."""
    from provision.engines.docker import DockerEngine

    p = tmp_path / "daemon.json"
    p.write_bytes(user_daemon_json())
    real, calls = DockerEngine.plan, []

    def plan_then_operator_saves(self, *a, **kw):
        plan = real(self, *a, **kw)
        calls.append(1)
        if len(calls) == 1:
            _operator_saves(p, "operator-key", rename=rename)
        return plan

    monkeypatch.setattr(DockerEngine, "plan", plan_then_operator_saves)
    res = _configure(p)
    doc = json.loads(p.read_text())
    assert doc.get("operator-key") is True and doc["runtimes"]["nvidia"]["path"] == RT
    assert doc["runtimes"]["kata"] and len(calls) == 2 and res.changed


def test_save_while_the_new_file_is_staged_is_merged_again(tmp_path, monkeypatch):
    """The slow part of a write (fsync of the backup and of the staged file) is where a save lands in practice: the
    compare just before the rename catches it."""
    p = tmp_path / "daemon.json"
    p.write_bytes(user_daemon_json())
    real_fsync, saved = os.fsync, []

    def fsync_then_operator_saves(fd):
        real_fsync(fd)
        if not saved:
            saved.append(1)
            _operator_saves(p, "operator-key", rename=True)

    monkeypatch.setattr(os, "fsync", fsync_then_operator_saves)
    _configure(p)
    doc = json.loads(p.read_text())
    assert saved and doc.get("operator-key") is True and doc["runtimes"]["nvidia"]["path"] == RT


def test_a_file_that_keeps_changing_is_exit_14(tmp_path, monkeypatch):
    """The operator saves after every read: after a few tries, exit 14 in one line naming the file; the file is the
    operator's last save, with nothing of gpuprov's, and no backup or temporary file is left."""
    from provision.engines.docker import DockerEngine
    from provision.errors import GpuprovError

    p = tmp_path / "daemon.json"
    p.write_bytes(user_daemon_json())
    real, n = DockerEngine.plan, []

    def plan_then_operator_saves(self, *a, **kw):
        plan = real(self, *a, **kw)
        n.append(1)
        _operator_saves(p, f"operator-{len(n)}", rename=True)
        return plan

    monkeypatch.setattr(DockerEngine, "plan", plan_then_operator_saves)
    with pytest.raises(GpuprovError) as exc:
        _configure(p)
    assert exc.value.exit_code == CONFLICT and str(p) in str(exc.value) and "\n" not in str(exc.value)
    doc = json.loads(p.read_text())
    assert "nvidia" not in doc["runtimes"] and doc.get(f"operator-{len(n)}") is True and len(n) >= 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["daemon.json"]


def test_edit_file_merges_again_on_a_change(tmp_path):
    """The API for other callers: edit_file(path, merge) re-runs merge on what the operator saved meanwhile."""
    from provision.fsutil import edit_file

    p = tmp_path / "conf"
    p.write_text("a\n")
    seen = []

    def merge(text):
        seen.append(text)
        if len(seen) == 1:
            p.write_text("a\nb-by-operator\n")  # saved while gpuprov merges
        return text + "gpuprov\n"

    edit_file(p, merge, backup=False)
    assert seen == ["a\n", "a\nb-by-operator\n"] and p.read_text() == "a\nb-by-operator\ngpuprov\n"


def test_the_parent_is_opened_in_one_call_only_where_the_way_is_private(scratch, monkeypatch):
    """write_file opens the directory holding the file in one call (12 fewer system calls for a container's
    config.json on every GPU start) only where every directory on the way is root's and not writable by others;
    where another user owns a directory on the way, the name-by-name walk as before (and the write still lands)."""
    from provision import fsutil

    walks: list[str] = []
    real = fsutil._open_dir
    monkeypatch.setattr(fsutil, "_open_dir", lambda path, *a, **k: walks.append(path) or real(path, *a, **k))
    mine = scratch / "bundle"
    mine.mkdir()
    fsutil.write_file(mine / "config.json", "{}", backup=False, durable=False)
    fsutil.write_file(mine / "config.json", "{}\n", backup=False, durable=False)
    assert walks == [] and (mine / "config.json").read_text() == "{}\n"
    theirs = scratch / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    fsutil.write_file(theirs / "f.prom", "x", backup=False, shared_dir_ok=True)
    assert walks == [str(theirs)] and (theirs / "f.prom").read_text() == "x"
    fsutil.write_file(mine / "new" / "deeper.json", "{}", backup=False)  # missing directories: made by the walk
    assert walks[-1] == str(mine / "new") and (mine / "new/deeper.json").read_text() == "{}"

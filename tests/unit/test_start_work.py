"""A GPU start's work grows with what the container asks for, not with how deep the driver's and the image's
directories are (issue 41): each start walks a directory once for all its files (modify.Start's memos), and the
memos answer exactly as a fresh walk does (links, `..`, absolute targets, the step and link bounds)."""
from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import modify
from tests.conftest import H200
from tests.inject_helpers import gpu_bundle, settings

PATHS = ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/usr/bin/nvidia-smi",
         "/lib/x86_64-linux-gnu/libc.so.6", "/abs/deeper/file", "/rel/file", "/up/../usr/lib/x", "/loop/x",
         "/loop2/x", "/missing/dir/file", "/file/under/a/file", "/usr/lib/../lib/./x86_64-linux-gnu/x", "/", "/etc",
         "/long0/f", "/long0/g", "/usr/lib/x86_64-linux-gnu/deeper", "/usr/lib/x86_64-linux-gnu/deeper/x",
         "/usr/bin/present", "/usr/bin/present/x", "/usr/bin/..", "/usr/bin/.", "/usr//bin/absent", "/abs/absent",
         "/missing/a/../../rel/present", "/file/x/../y", "/missing/deeper/still")


def _image(root: Path) -> Path:
    """A rootfs with the links images have (usr-merge, absolute and relative, climbing, loops, chains)."""
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/bin").mkdir()
    (root / "etc").mkdir()
    (root / "file").write_text("")
    (root / "usr/bin/present").write_text("")  # a present last name in a directory walked before: no shortcut
    os.symlink("usr/lib", root / "lib")  # usr-merge
    os.symlink("/usr/lib/x86_64-linux-gnu", root / "abs")  # absolute: inside the rootfs, never the host's
    os.symlink("../../../../..", root / "usr/lib/x86_64-linux-gnu/deeper")  # climbs no higher than the rootfs
    os.symlink("usr/bin", root / "rel")
    os.symlink("up2", root / "up")
    os.symlink("/etc/../usr", root / "up2")
    os.symlink("loop", root / "loop")
    os.symlink("loop2b", root / "loop2")
    os.symlink("/loop2", root / "loop2b")
    (root / "d").mkdir()
    for i in range(8):  # a chain of links whose walk nears the step bound once, then once more per file below it
        os.symlink("/" + "d/" * 14 + "../" * 14 + f"long{i + 1}", root / f"long{i}")
    (root / "long8").mkdir()
    return root


def _answer(root: Path, path: str, memo: dict | None) -> str:
    try:
        return modify.scoped_resolve(str(root), path, memo)
    except Refused as exc:
        return f"refused: {exc}"


def test_a_starts_memo_answers_as_a_fresh_walk(tmp_path):
    root = _image(tmp_path / "rootfs")
    fresh = {p: _answer(root, p, None) for p in PATHS}
    assert fresh["/abs/deeper/file"] == "/file" and fresh["/up/../usr/lib/x"] == "/usr/lib/x"
    assert fresh["/loop/x"].startswith("refused") and fresh["/loop2/x"].startswith("refused")
    # below an absent name nothing is looked up, until a `..` climbs back to what exists (and its links count again)
    assert fresh["/missing/a/../../rel/present"] == "/usr/bin/present" and fresh["/file/x/../y"] == "/file/y"
    assert fresh["/missing/deeper/still"] == "/missing/deeper/still"
    for seed in range(20):  # any order of lookups within one start, one memo
        order = list(PATHS) * 2
        random.Random(seed).shuffle(order)
        memo: dict = {}
        assert {p: _answer(root, p, memo) for p in order} == fresh


def test_the_step_bound_counts_the_directories_walked_before(tmp_path, monkeypatch):
    """A path whose directory took most of MAX_STEPS to resolve is refused when its own components pass the bound,
    the memo or not: resuming from a directory resumes its count."""
    root = tmp_path / "rootfs"
    (root / "d").mkdir(parents=True)
    os.symlink("/" + "d/" * 125 + "../" * 125 + "t", root / "far")  # 251 steps to reach /t
    (root / "t").mkdir()
    deep = "/far/" + "/".join(["x"] * 10)
    with pytest.raises(Refused, match="more than 256 steps"):
        modify.scoped_resolve(str(root), deep)
    memo: dict = {}
    assert modify.scoped_resolve(str(root), "/far/a", memo) == "/t/a"
    with pytest.raises(Refused, match="more than 256 steps"):
        modify.scoped_resolve(str(root), deep, memo)


def _verdicts(paths: list[str], rootfs_real: str) -> dict[str, bool]:
    """One start's answers (a fresh `seen`, the warm editor's SOURCE_DIRS as the starts before it left them)."""
    seen: dict = {}
    return {p: modify._safe_source(p, rootfs_real, seen) for p in paths}


def _fresh(paths: list[str], rootfs_real: str, monkeypatch) -> dict[str, bool]:
    with monkeypatch.context() as m:
        m.setattr(modify, "SOURCE_DIRS", {})
        return _verdicts(paths, rootfs_real)


def _tick() -> None:
    """Past the filesystem's ctime tick (a jiffy: 10 ms at HZ=100), so the next change moves the directory's ctime."""
    time.sleep(0.012)


def test_source_verdicts_follow_their_directory(tmp_path, monkeypatch):
    """The warm editor's answers about the driver's host files are the answers of a fresh look after every change a
    file can go through (replaced by a link, removed, made, a directory or a socket in its place, its directory
    swapped for a link into the container's rootfs): each change moves its directory's stamp."""
    monkeypatch.setattr(modify, "SOURCE_DIRS", {})
    monkeypatch.setattr(modify, "STILL_NS", -(1 << 62))  # every directory counts as still: the memo always taken
    host, rootfs = tmp_path / "host", tmp_path / "rootfs"
    (host / "lib").mkdir(parents=True)
    (rootfs / "evil").mkdir(parents=True)
    (rootfs / "evil/libcuda.so.1").write_text("")
    for name in ("libcuda.so.1", "libnvidia-ml.so.1", "gone.so"):
        (host / "lib" / name).write_text("")
    paths = [f"{host}/lib/{n}" for n in ("libcuda.so.1", "libnvidia-ml.so.1", "gone.so", "new.so", "dir", "sock")]
    real_root = os.path.realpath(rootfs)

    def same() -> None:
        for _ in range(2):  # the start that (re)reads the directory, then one answered from the memo
            assert _verdicts(paths, real_root) == _fresh(paths, real_root, monkeypatch)

    same()
    assert _verdicts(paths, real_root)[paths[0]] and not _verdicts(paths, real_root)[paths[3]]
    changes = [
        lambda: (os.unlink(paths[1]), os.symlink("/etc/shadow", paths[1])),
        lambda: os.unlink(paths[2]),
        lambda: (host / "lib/new.so").write_text(""),
        lambda: (host / "lib/dir").mkdir(),
        lambda: socket.socket(socket.AF_UNIX).bind(paths[5]),
        lambda: os.replace(host / "lib", host / "lib.old"),
        lambda: os.symlink(rootfs / "evil", host / "lib"),  # the same names, now inside the container's rootfs
    ]
    for change in changes:
        _tick()
        change()
        same()
    assert not any(_verdicts(paths, real_root).values())  # all inside the rootfs now: none may be bound


def test_a_directory_changed_lately_is_read_again(tmp_path, monkeypatch):
    """A directory whose ctime is within STILL_NS of now is not kept: the next start lstats its files again (a change
    in the same ctime tick as the one before would not move its stamp)."""
    monkeypatch.setattr(modify, "SOURCE_DIRS", {})
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/libcuda.so.1").write_text("")
    src = f"{tmp_path}/lib/libcuda.so.1"
    calls: list[str] = []
    real = os.lstat
    monkeypatch.setattr(modify.os, "lstat", lambda p, *a, **k: calls.append(os.fspath(p)) or real(p, *a, **k))
    for _ in range(3):
        assert _verdicts([src], "/nonexistent-rootfs")[src]
    assert calls.count(src) == 3 and f"{tmp_path}/lib" not in modify.SOURCE_DIRS
    monkeypatch.setattr(modify, "STILL_NS", -(1 << 62))
    for _ in range(3):
        assert _verdicts([src], "/nonexistent-rootfs")[src]
    assert calls.count(src) == 4  # read once more, then kept


def test_a_way_others_can_change_is_looked_at_every_start(tmp_path, monkeypatch):
    """Where a non-root user could change the way to the driver's directory (a directory on it others can write, a
    link there), nothing is kept: retargeting the link between two looks inside one start, then back, leaves no
    answer from the other directory behind (the stamp of the directory itself would not have moved)."""
    monkeypatch.setattr(modify, "SOURCE_DIRS", {})
    monkeypatch.setattr(modify, "STILL_NS", -(1 << 62))
    base = tmp_path / "shared"
    for d in ("good/lib", "evil/lib", "rootfs"):
        (base / d).mkdir(parents=True)
    base.chmod(0o777)  # others may rename or relink what is in it (no sticky bit)
    (base / "good/lib/liba.so").write_text("")
    os.symlink("/etc/shadow", base / "good/lib/libx.so")  # the real directory: libx.so is a link
    (base / "evil/lib/libx.so").write_text("")  # the decoy: a regular file
    drv = base / "drv"
    os.symlink(base / "good", drv)
    real_root = os.path.realpath(base / "rootfs")
    seen: dict = {}
    assert modify._safe_source(f"{drv}/lib/liba.so", real_root, seen)
    os.unlink(drv)
    os.symlink(base / "evil", drv)  # flipped within the start
    modify._safe_source(f"{drv}/lib/libx.so", real_root, seen)
    os.unlink(drv)
    os.symlink(base / "good", drv)  # and back
    for _ in range(2):
        assert not modify._safe_source(f"{drv}/lib/libx.so", real_root, {})
    assert not modify.SOURCE_DIRS
    assert not modify._safe_source("lib/liba.so", real_root, {})  # relative: never (it would depend on the cwd)


def test_a_warm_start_stats_each_source_directory_once(tmp_path, monkeypatch):
    """After the first GPU start, a start looks at the driver's host files with one stat per directory they lie in,
    and lstats none of them (before: an lstat per file, 35 for `all`, and the walk of each new directory's parents)."""
    monkeypatch.setattr(modify, "SOURCE_DIRS", {})
    monkeypatch.setattr(modify, "STILL_NS", -(1 << 62))  # the fixture driver's directories count as still
    st = settings(tmp_path)
    assert modify.modify_bundle(str(gpu_bundle(tmp_path, "first", ["NVIDIA_DRIVER_CAPABILITIES=all"])), st)
    b = gpu_bundle(tmp_path, "second", ["NVIDIA_DRIVER_CAPABILITIES=all"])
    lstats: list[str] = []
    stats: list[str] = []
    real_lstat, real_stat = os.lstat, os.stat
    monkeypatch.setattr(modify.os, "lstat", lambda p, *a, **k: lstats.append(os.fspath(p)) or real_lstat(p, *a, **k))
    def stat_(p, *a, **k):  # the source checks' own (discovery's host key stats the library directories too)
        if sys._getframe(1).f_code is modify._source_dir.__code__:
            stats.append(os.fspath(p))
        return real_stat(p, *a, **k)

    monkeypatch.setattr(modify.os, "stat", stat_)
    assert modify.modify_bundle(str(b), st)
    sources = {m["source"] for m in json.loads((b / "config.json").read_text())["mounts"]
               if m["source"].startswith(str(H200))}
    dirs = {os.path.dirname(p) for p in sources}
    assert len(sources) >= 20 and not sources & set(lstats), sorted(sources & set(lstats))
    assert sorted(stats) == sorted(dirs)


def test_a_starts_lookups_grow_with_its_files_not_their_depth(tmp_path, monkeypatch):
    """lstat calls inside the image per GPU start: one per file mounted, plus each directory on the way once (before:
    every directory again for every file, 5 calls a library)."""
    b = gpu_bundle(tmp_path, "b", ["NVIDIA_DRIVER_CAPABILITIES=all"])
    calls: list[str] = []
    real = os.lstat
    rootfs = str(b / "rootfs")
    monkeypatch.setattr(modify.os, "lstat", lambda p, *a, **k: calls.append(os.fspath(p)) or real(p, *a, **k))
    assert modify.modify_bundle(str(b), settings(tmp_path))
    mounts = json.loads((b / "config.json").read_text())["mounts"]
    in_image = [c for c in calls if c.startswith(rootfs)]
    dirs = {os.path.dirname(m["destination"]) for m in mounts}
    depth = sum(d.count("/") for d in dirs)
    assert len(mounts) >= 20 and len(in_image) <= len(mounts) + depth + 8, (len(in_image), len(mounts), depth)


def test_the_driver_mounts_memo_follows_discovery_and_the_request(tmp_path):
    """The warm editor's one cross-start memo (edits.driver_mounts_for) answers as driver_mounts does for the
    discovery it is given: another discovery (the driver changed: a new Discovery) or another capability set,
    library directory or firmware need is never served an earlier answer."""
    import dataclasses

    from provision.inject import edits

    disc = modify.load_discovery(settings(tmp_path))
    lib = disc.libraries["compute"][0]
    moved = dataclasses.replace(lib, path=lib.path + ".moved")
    other = dataclasses.replace(disc, libraries={**disc.libraries, "compute": (moved, *disc.libraries["compute"][1:])})
    asks = [(d, caps, libdir, fw) for d in (disc, other, disc) for caps in (["utility"], ["compute", "utility"],
            list(edits.CAPABILITIES)) for libdir in (edits.DEBIAN_LIBDIR, edits.RHEL_LIBDIR) for fw in (True, False)]
    for d, caps, libdir, fw in asks + asks[::-1]:
        assert edits.driver_mounts_for(d, caps, libdir, fw) == tuple(
            edits.driver_mounts(d, caps, libdir=libdir, with_firmware=fw)), (caps, libdir, fw)
    assert moved.path in {m.source for m in edits.driver_mounts_for(other, ["compute"], edits.DEBIAN_LIBDIR, True)}
    assert moved.path not in {m.source for m in edits.driver_mounts_for(disc, ["compute"], edits.DEBIAN_LIBDIR, True)}


def test_each_image_is_resolved_by_its_own_start(tmp_path):
    """Starts of different images in one warm process: each one's destinations are resolved inside its own rootfs
    (its library directory, its links), whatever the start before it saw."""
    st = settings(tmp_path)
    plain = gpu_bundle(tmp_path, "plain")
    linked = gpu_bundle(tmp_path, "linked")
    (linked / "rootfs/usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    os.symlink("/opt/own", linked / "rootfs/usr/lib/x86_64-linux-gnu/libcuda.so.1")  # the image's own link
    rhel = gpu_bundle(tmp_path, "rhel")
    (rhel / "rootfs/etc/debian_version").unlink()
    (rhel / "rootfs/usr/lib64").mkdir(parents=True)

    def cuda_dest(b) -> str:
        modify.modify_bundle(str(b), st)
        mounts = json.loads((b / "config.json").read_text())["mounts"]
        return next(m["destination"] for m in mounts if m["source"].rsplit("/", 1)[-1].startswith("libcuda.so."))

    assert cuda_dest(plain) == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert cuda_dest(linked) == "/opt/own"
    assert cuda_dest(rhel) == "/usr/lib64/libcuda.so.1"
    fresh = gpu_bundle(tmp_path, "plain2")
    assert cuda_dest(fresh) == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"


def test_a_warm_start_reads_through_raw_descriptors(tmp_path, monkeypatch):
    """A warm GPU start reads config.json and checks the discovery cache with os.open/os.read: no Python file
    object, whose making costs an fstat, an ioctl and an lseek or two per file (9 system calls of a default start's
    117 on 24a58d7, counted with strace on the warm editor; the editor after an idle moment pays most per call).
    The cache's trust checks are open_trusted's (fsutil.open_trusted_fd)."""
    import builtins
    import io

    from provision.inject import discover

    st = settings(tmp_path)
    assert modify.modify_bundle(str(gpu_bundle(tmp_path, "first")), st)  # the first start builds the cache
    assert modify.modify_bundle(str(gpu_bundle(tmp_path, "second")), st)  # the second parses it (raw reads too)
    b = gpu_bundle(tmp_path, "third")
    made: list[str] = []
    real_open, real_fdopen = builtins.open, os.fdopen
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: made.append(str(f)) or real_open(f, *a, **k))
    monkeypatch.setattr(io, "open", builtins.open)
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: made.append(f"fd {fd}") or real_fdopen(fd, *a, **k))
    parsed = discover._parsed
    assert modify.modify_bundle(str(b), st)
    assert made == [], made
    assert discover._parsed is parsed, "the warm start used the parsed cache"
    assert "/dev/nvidia0" in {d["path"] for d in json.loads((b / "config.json").read_text())["linux"]["devices"]}

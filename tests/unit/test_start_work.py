"""A GPU start's work grows with what the container asks for, not with how deep the driver's and the image's
directories are (issue 41): each start walks a directory once for all its files (modify.Start's memos), and the
memos answer exactly as a fresh walk does (links, `..`, absolute targets, the step and link bounds)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import modify
from tests.inject_helpers import gpu_bundle, settings

PATHS = ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/usr/bin/nvidia-smi",
         "/lib/x86_64-linux-gnu/libc.so.6", "/abs/deeper/file", "/rel/file", "/up/../usr/lib/x", "/loop/x",
         "/loop2/x", "/missing/dir/file", "/file/under/a/file", "/usr/lib/../lib/./x86_64-linux-gnu/x", "/", "/etc",
         "/long0/f", "/long0/g")


def _image(root: Path) -> Path:
    """A rootfs with the links images have (usr-merge, absolute and relative, climbing, loops, chains)."""
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/bin").mkdir()
    (root / "etc").mkdir()
    (root / "file").write_text("")
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


def test_real_dirs_are_realpath(tmp_path):
    (tmp_path / "a/b/c").mkdir(parents=True)
    os.symlink("a/b", tmp_path / "l")
    os.symlink(str(tmp_path / "l/c"), tmp_path / "a/abs")
    memo: dict = {}
    for d in ("a/b/c", "l/c", "a/abs", "l", "a/missing/x", "a/b/../b/c", "l/../b"):
        path = f"{tmp_path}/{d}"
        assert modify._real_dir(path, memo) == os.path.realpath(path), d
    assert modify._real_dir("/", memo) == "/" and modify._real_dir("", memo) == "/"


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

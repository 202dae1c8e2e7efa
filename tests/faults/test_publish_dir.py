"""driver-volume's writes through fsutil: a version directory appears whole or not at all (a killed run's staging
directory is cleared by the next), and `current` is switched by one rename, never missing in between."""
from __future__ import annotations

import os

import pytest

from provision.errors import UntrustedPath
from provision.fsutil import link_or_copy, point_link, publish_dir


def test_a_failed_fill_leaves_nothing_and_a_leftover_is_cleared(tmp_path):
    base = tmp_path / "volumes"
    src = tmp_path / "libfoo.so.1"
    src.write_text("lib")

    def broken(staging):
        link_or_copy(src, staging / "lib64" / "libfoo.so.1")
        raise KeyboardInterrupt  # killed mid-fill

    with pytest.raises(KeyboardInterrupt):
        publish_dir(base / "550.1", broken)
    assert sorted(os.listdir(base)) == []
    (base / ".550.1.tmp" / "junk").mkdir(parents=True)  # what a SIGKILL leaves behind
    assert publish_dir(base / "550.1", lambda d: link_or_copy(src, d / "lib64" / "libfoo.so.1")) is True
    assert sorted(os.listdir(base)) == ["550.1"] and os.listdir(base / "550.1") == ["lib64"]
    assert os.path.samefile(base / "550.1/lib64/libfoo.so.1", src)  # a hard link, not a copy
    assert publish_dir(base / "550.1", lambda d: pytest.fail("filled again")) is False


def test_current_is_switched_atomically_and_only_when_it_changes(tmp_path):
    cur = tmp_path / "current"
    assert point_link(cur, "550.1") is True and os.readlink(cur) == "550.1"
    inode = os.lstat(cur).st_ino
    assert point_link(cur, "550.1") is False and os.lstat(cur).st_ino == inode
    (tmp_path / ".current.tmp").symlink_to("stale")  # a killed run's leftover
    assert point_link(cur, "560.2") is True and os.readlink(cur) == "560.2"
    assert sorted(os.listdir(tmp_path)) == ["current"]


def test_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedPath):
        publish_dir(shared / "550.1", lambda d: None)
    with pytest.raises(UntrustedPath):
        point_link(shared / "current", "550.1")
    assert os.listdir(shared) == []

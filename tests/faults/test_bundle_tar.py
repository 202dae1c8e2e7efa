"""A .tar.gz bundle is never unpacked as root into a reachable place: hostile members (traversal, absolute paths,
setuid, links leading out, devices, FIFOs, duplicates, members outside gpuprov-bundle/) are refused with exit 8
before anything of theirs is written, a bundle that fails verification after unpacking is removed, and what is
unpacked lives in a 0700 directory with normalised modes and no owner from the archive."""
from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from provision.bundle import install
from tests.bundles import assert_refused_nothing_left, listing, make_signer, member, small_bundle, tar_of
from tests.conftest import needs, run_cli


def verify(archive, *args):
    return run_cli("bundle", "verify", str(archive), *args, timeout=120)


HOSTILE = {
    "traversal": (member("gpuprov-bundle/../../escaped", data=b"x"), "leading out of the bundle"),
    "traversal-deep": (member("gpuprov-bundle/repo/../../../escaped", data=b"x"), "leading out of the bundle"),
    "absolute": (member("/tmp/gpuprov-escaped", data=b"x"), "absolute path"),
    "setuid": (member("gpuprov-bundle/repo/su", data=b"#!/bin/sh\n", mode=0o4755), "setuid"),
    "setgid": (member("gpuprov-bundle/repo/sg", data=b"#!/bin/sh\n", mode=0o2755), "setuid/setgid"),
    "symlink-out": (member("gpuprov-bundle/repo/shadow", tarfile.SYMTYPE, linkname="/etc/shadow"), "a link"),
    "symlink-rel": (member("gpuprov-bundle/repo/up", tarfile.SYMTYPE, linkname="../../.."), "a link"),
    "hardlink-out": (member("gpuprov-bundle/repo/passwd", tarfile.LNKTYPE, linkname="/etc/passwd"), "a link"),
    "chardev": (member("gpuprov-bundle/repo/zero", tarfile.CHRTYPE), "device, FIFO"),
    "blockdev": (member("gpuprov-bundle/repo/disk", tarfile.BLKTYPE), "device, FIFO"),
    "fifo": (member("gpuprov-bundle/repo/fifo", tarfile.FIFOTYPE), "device, FIFO"),
    "outside-top": (member("other-dir/file", data=b"x"), "outside gpuprov-bundle/"),
    "duplicate": (member("gpuprov-bundle/install-offline.sh", data=b"#!/bin/sh\nid\n", mode=0o755), "twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_member_refused(tmp_path, base, case):
    (info, data), why = HOSTILE[case]
    archive = tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz", [(info, data)])
    r = verify(archive)
    assert_refused_nothing_left(r, base, why)
    assert not Path("/tmp/gpuprov-escaped").exists() and not (tmp_path / "escaped").exists()


def test_hostile_member_first_nothing_written(tmp_path, base):
    """A setuid member before anything else: refused before a byte of the bundle is written."""
    archive = tmp_path / "b.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info, data = member("gpuprov-bundle/sh", data=b"#!/bin/sh\n", mode=0o4755)
        tar.addfile(info, io.BytesIO(data))
    assert_refused_nothing_left(verify(archive), base, "setuid")


def test_checksum_failure_after_unpack_removes_everything(tmp_path, base):
    b = small_bundle(tmp_path / "b")
    deb = b / "repo/python3.deb"
    deb.write_bytes(b"t" * deb.stat().st_size)  # same size: caught by the checksum after unpacking, not before
    assert_refused_nothing_left(verify(tar_of(b, tmp_path / "b.tar.gz")), base, "checksum mismatch",
                                "the unpacked copy was removed")


@needs("gpg", "gpgv")
def test_unsigned_tar_with_keyring_removed(tmp_path, base):
    signer = make_signer(tmp_path / "signer")
    archive = tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz")
    assert_refused_nothing_left(verify(archive, "--keyring", str(signer.keyring)), base,
                                "SHA256SUMS.sig is missing")


def test_not_a_tarball(tmp_path, base):
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(b"\x1f\x8b" + os.urandom(500))
    assert_refused_nothing_left(verify(archive), base, "cannot unpack")


def test_truncated_tarball(tmp_path, base):
    archive = tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz")
    archive.write_bytes(archive.read_bytes()[:3000])
    assert_refused_nothing_left(verify(archive), base, "cannot unpack")


def test_good_tar_verifies_and_leaves_nothing(tmp_path, base):
    r = verify(tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz"))
    assert r.returncode == 0 and "bundle OK" in r.stdout, r.stderr
    assert listing(base) == []  # verify alone keeps no copy


def test_unpacked_copy_private_and_normalised(tmp_path, base):
    """Modes and owners from the archive are never applied: 0644/0755, the unpacking user's, in a 0700 place."""
    def odd_modes(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = 1234, 1234, "someone", "someone"
        info.mode = 0o777 if info.isdir() or info.name.endswith(".sh") else 0o666
        return info

    archive = tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz", mode_of=odd_modes)
    opened = install.open_verified(archive)
    try:
        assert opened.result.ok and opened.unpacked
        assert stat.S_IMODE(os.stat(base).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(opened.path.parent).st_mode) == 0o700
        for p in opened.path.rglob("*"):
            st = os.lstat(p)
            assert st.st_uid == os.geteuid() and st.st_gid == os.getegid(), p
            want = 0o755 if p.is_dir() or p.name.endswith(".sh") else 0o644
            assert stat.S_IMODE(st.st_mode) == want, (p, oct(st.st_mode))
    finally:
        opened.discard()
    assert listing(base) == []

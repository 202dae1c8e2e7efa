"""Unpacking a .tar.gz bundle is bounded: a first pass over the headers refuses sparse members (a tiny archive
declaring a 1 TiB file, as GNU tar --sparse writes it in both its formats), members whose size is not the one the
manifest lists, and a total beyond the stated limit (GPUPROV_BUNDLE_MAX_BYTES) or the free space, before a byte is
written: exit 8, nothing left. `bundle verify` and `plan --bundle` are read-only, so each run here is also held to
a 64 MiB file-size limit (RLIMIT_FSIZE): a run that writes the declared size fails differently (File too large)."""
from __future__ import annotations

import resource
import subprocess
import tarfile

import pytest

from provision.bundle import install, unpack
from provision.errors import BundleInvalid
from tests.bundles import assert_refused_nothing_left, listing, member, small_bundle, tar_of
from tests.conftest import needs, run_cli

FSIZE = 64 << 20
TIB = 1 << 40


def small_files():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))


def cli(*args: str, **env: str):
    return run_cli(*args, preexec_fn=small_files, env=env, timeout=120)


@needs("tar")
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_sparse_terabyte_member_refused_writing_nothing(tmp_path, base, fmt):
    tree = tmp_path / "tree/gpuprov-bundle"
    tree.mkdir(parents=True)
    with open(tree / "huge", "wb") as fh:
        fh.truncate(TIB)  # a hole: no block of it is on disk
    archive = tmp_path / "b.tar.gz"
    subprocess.run(["tar", "-C", str(tmp_path / "tree"), "--sparse", f"--format={fmt}", "-czf", str(archive),
                    "gpuprov-bundle/huge"], check=True)
    assert archive.stat().st_size < 400  # the reported attack: a few hundred bytes declaring a terabyte
    r = cli("bundle", "verify", str(archive))
    assert_refused_nothing_left(r, base, "a sparse file", str(TIB))
    assert len(r.stderr.strip().splitlines()) == 1


@needs("tar")
def test_plan_bundle_refuses_sparse_member(tmp_path, base):
    tree = tmp_path / "tree/gpuprov-bundle"
    tree.mkdir(parents=True)
    with open(tree / "huge", "wb") as fh:
        fh.truncate(TIB)
    archive = tmp_path / "b.tar.gz"
    subprocess.run(["tar", "-C", str(tmp_path / "tree"), "--sparse", "-czf", str(archive), "gpuprov-bundle/huge"],
                   check=True)
    r = cli("bootstrap", "--bundle", str(archive), "--dry-run")
    assert r.returncode == 8 and "a sparse file" in r.stderr, (r.returncode, r.stderr)
    assert listing(base) == []


def test_member_larger_than_the_manifest_says(tmp_path, base):
    """A 100 MiB member of zeros (a few hundred KiB compressed) where the manifest lists 4 KiB: refused from its
    header, before its data is read."""
    b = small_bundle(tmp_path / "b")
    deb = b / "repo/python3.deb"
    big = tmp_path / "big.deb"
    with open(big, "wb") as fh:
        fh.truncate(100 << 20)
    archive = tmp_path / "b.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(b, arcname="gpuprov-bundle", filter=lambda i: None if i.name.endswith("python3.deb") else i)
        tar.add(big, arcname="gpuprov-bundle/repo/python3.deb")
    r = cli("bundle", "verify", str(archive))
    assert_refused_nothing_left(r, base, "repo/python3.deb", f"declares {100 << 20} bytes",
                                f"the manifest says {deb.stat().st_size}")


def test_member_not_in_the_manifest(tmp_path, base):
    archive = tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz",
                     [member("gpuprov-bundle/repo/extra.deb", data=b"x" * 1000)])
    assert_refused_nothing_left(cli("bundle", "verify", str(archive)), base, "repo/extra.deb",
                                "not in the manifest")


def test_total_over_the_stated_limit(tmp_path, base):
    b = small_bundle(tmp_path / "b")
    archive = tar_of(b, tmp_path / "b.tar.gz")
    r = cli("bundle", "verify", str(archive), GPUPROV_BUNDLE_MAX_BYTES="6000")
    assert_refused_nothing_left(r, base, "unpacks to more than 6000 bytes", "GPUPROV_BUNDLE_MAX_BYTES")
    assert cli("bundle", "verify", str(archive)).returncode == 0  # the same archive, the default limit


def test_total_over_the_free_space(tmp_path, base, monkeypatch):
    """The free space where it would be unpacked (a full disk is not made here: the measure is replaced)."""
    archive = tar_of(small_bundle(tmp_path / "b"), tmp_path / "b.tar.gz")
    monkeypatch.setattr(unpack, "free_bytes", lambda path: unpack.SPACE_MARGIN + 5000)
    with pytest.raises(BundleInvalid, match="free space under"):
        install.open_verified(archive, base=base)
    assert listing(base) == []

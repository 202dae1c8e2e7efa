"""`bundle create --resume` with the real apt (issue 28 item 13): a create that failed after its download keeps the
packages in OUTPUT.partial; the next `--resume` run fetches none of them again (the very same file), fetches again
one that is not whole (a different size), and ends in a bundle `bundle verify` accepts, OUTPUT.partial gone. The
resume's rules (refused for another bundle, named without --resume, a .tar.gz) are tests/unit/test_bundle_create.py's.
Packages: `hello` and `less` (small, no dependencies outside a minimal root) stand in for the engine's."""
from __future__ import annotations

import pytest

from provision.bundle import aptrepo
from provision.bundle import create as cr
from provision.bundle.install import open_verified
from provision.decide.targets import parse_target
from provision.errors import StepFailed
from tests.conftest import needs
from tests.integration.hosts import ensure_image

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]


def test_resume_fetches_only_what_is_not_there(tmp_path, monkeypatch):
    # the clean Debian 12 root the host tests share (debootstrap minbase, as `bundle create` builds its own)
    monkeypatch.setattr(cr, "_image", lambda target: ensure_image())
    monkeypatch.setattr(cr, "apt_packages", lambda opt: {"engine": ["hello", "less"]})
    real_index = aptrepo.write_flat_repo

    def index_fails(repo):
        raise StepFailed("indexing failed (the test's failure after the download)")
    monkeypatch.setattr(cr.aptrepo, "write_flat_repo", index_fails)
    out = tmp_path / "b"
    opt = cr.CreateOptions(parse_target("debian-12"), ("engine",), out, resume=True)
    with pytest.raises(StepFailed):
        cr.create(opt)
    repo = tmp_path / "b.partial/repo"
    hello, less = (next(repo.glob(f"{p}_*.deb")) for p in ("hello", "less"))
    before = hello.stat()
    whole = less.read_bytes()
    less.write_bytes(whole[: len(whole) // 2])  # a package that is not whole
    monkeypatch.setattr(cr.aptrepo, "write_flat_repo", real_index)
    res = cr.create(opt)
    assert res["output"] == str(out) and not (tmp_path / "b.partial").exists()
    hello, less = out / "repo" / hello.name, out / "repo" / less.name
    after = hello.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not fetched again
    assert less.read_bytes() == whole  # fetched again, whole
    (tmp_path / "unpack").mkdir()
    opened = open_verified(out, None, base=tmp_path / "unpack")
    assert opened.result.ok and {"repo/" + hello.name, "repo/" + less.name} <= \
        {f["path"] for f in opened.result.manifest["files"]}
    opened.discard()

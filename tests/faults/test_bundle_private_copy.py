"""No window between verify and install: `gpuprov bundle install DIR` (and `bootstrap --bundle DIR`) copies the
bundle's regular files into a fresh root-owned 0700 directory, verifies that copy, and installs from it. Another
user who can write DIR (here: owned by nobody, mode 0777) and swaps a package right after verification changes
nothing that is installed. The install itself is stopped at its boundary (the plan it would apply is captured, not
applied to this machine)."""
from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
import types
from pathlib import Path

import pytest

from provision.bundle import install, manifest
from provision.commands import bundle as bundle_cmd
from provision.errors import BundleInvalid
from tests.bundles import listing, small_bundle
from tests.conftest import have_docker
from tests.faults.conftest import root_only

DEB = "repo/python3.deb"


@pytest.fixture
def installs(monkeypatch):
    """`bundle install` up to the plan it would apply: the preflight against this machine's release is left out
    (the bundle's target is Debian 12 whatever runs the tests), and the repository it would install from is kept."""
    seen: list[str] = []
    monkeypatch.setattr(install, "preflight", lambda *a, **k: None)
    monkeypatch.setattr(bundle_cmd, "detect_host", lambda *a, **k: None)
    monkeypatch.setattr(bundle_cmd, "build_plan", lambda report, opt: seen.append(opt.bundle) or [])
    monkeypatch.setattr(bundle_cmd.ap, "apply_plan",
                        lambda steps, **kw: types.SimpleNamespace(changed=0, outcomes=[], to_dict=lambda: {}, log=None))
    return seen


def world_writable(bundle: Path) -> Path:
    nobody = pwd.getpwnam("nobody")
    for p in [bundle, *bundle.rglob("*")]:
        os.chown(p, nobody.pw_uid, nobody.pw_gid)
        p.chmod(0o777 if p.is_dir() else 0o666)
    return bundle


@root_only
def test_package_swapped_after_verification_is_not_installed(tmp_path, base, installs, monkeypatch):
    src = world_writable(small_bundle(tmp_path / "b"))
    good = (src / DEB).read_bytes()
    real_verify = manifest.verify

    def verify_then_swap(root, keyring=None):
        res = real_verify(root, keyring)
        (src / DEB).write_bytes(b"!<arch>\nevil\n")  # the other user, right after verification
        return res

    monkeypatch.setattr(manifest, "verify", verify_then_swap)
    bundle_cmd.install_cmd(path=src, keyring=None, json_out=True, no_validate=True)
    repo = Path(installs[0])
    assert not repo.is_relative_to(src) and repo.is_relative_to(base)
    assert (repo.parent / DEB).read_bytes() == good  # what was verified is what apt is pointed at
    assert manifest.verify(repo.parent).ok
    for p in [repo.parent.parent, base]:  # root's own, closed to everyone else
        st = os.stat(p)
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700, p
    for p in repo.parent.rglob("*"):
        st = os.lstat(p)
        assert st.st_uid == os.geteuid() and not st.st_mode & 0o022, p


@root_only
def test_bootstrap_bundle_installs_from_the_copy(tmp_path, base, monkeypatch):
    """bootstrap --bundle DIR (a real run) takes the same path: the repository it plans with is the copy's."""
    src = world_writable(small_bundle(tmp_path / "b"))
    monkeypatch.setattr(install, "preflight", lambda *a, **k: None)
    checked, _ = install.check_bundle(src, private=True)
    assert checked.is_relative_to(base) and checked == install.kept_path(base, src)
    assert (checked / DEB).read_bytes() == (src / DEB).read_bytes()


def test_link_in_bundle_refused_before_copying(tmp_path, base, installs):
    src = small_bundle(tmp_path / "b")
    (src / "repo/passwd").symlink_to("/etc/passwd")
    with pytest.raises(BundleInvalid, match="repo/passwd: a link"):
        bundle_cmd.install_cmd(path=src, keyring=None, json_out=True, no_validate=True)
    assert installs == [] and listing(base) == []


def test_copy_bounded_by_the_limit(tmp_path, base, installs, monkeypatch):
    src = small_bundle(tmp_path / "b")
    monkeypatch.setenv("GPUPROV_BUNDLE_MAX_BYTES", "6000")
    with pytest.raises(BundleInvalid, match="GPUPROV_BUNDLE_MAX_BYTES"):
        bundle_cmd.install_cmd(path=src, keyring=None, json_out=True, no_validate=True)
    assert installs == [] and listing(base) == []


def test_verify_and_plan_stay_read_only(tmp_path, base):
    """`bundle verify` and a dry run read a directory where it is: no copy is made."""
    src = small_bundle(tmp_path / "b")
    opened = install.open_verified(src)
    assert opened.result.ok and opened.path == src.resolve() and not base.exists()


@pytest.mark.skipif(not have_docker(), reason="needs a Docker engine (install-offline.sh runs in a Debian 12 host)")
def test_install_offline_script_installs_from_its_private_copy(tmp_path):
    """The offline script checks and installs from its own copy too: the apt source it writes names the copy (in a
    new 0700 directory of root's), not the bundle another user may write, and the copy is gone afterwards. (The
    small bundle's packages are placeholders: apt then fails, after the source was written.)"""
    from tests.integration.hosts import ensure_image

    src = world_writable(small_bundle(tmp_path / "b"))
    script = ("bash /b/install-offline.sh >/dev/null 2>&1; echo rc=$?; cat /var/lib/gpuprov/bundle-apt/bundle.list; "
              "ls -d /tmp/gpuprov-offline-* 2>/dev/null | wc -l")
    p = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{src}:/b", ensure_image(), "bash", "-c",
                        script], capture_output=True, text=True, timeout=300)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 3, (p.stdout, p.stderr)
    assert lines[0] != "rc=8", lines  # every check passed
    assert re.fullmatch(r"deb \[trusted=yes\] file:/tmp/gpuprov-offline-\w{6}/bundle/repo \./", lines[1]), lines
    assert lines[2] == "0"  # the copy removed on exit

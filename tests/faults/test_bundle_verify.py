"""`gpuprov bundle verify` fails closed (exit 8): a signature that is required (a keyring given, or a manifest
naming signing keys) and missing or bad; SHA256SUMS naming paths outside the bundle, the same path twice, or
malformed lines; files the checksums do not cover; links, FIFOs and setuid files in the bundle. Signatures are
real: a gpg key made here, checked with gpgv."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from provision.bundle import manifest
from tests.bundles import GPG_ENV, make_signer, rewrite_sums, small_bundle
from tests.conftest import needs, run_cli

pytestmark = needs("gpg", "gpgv")
WHEEL = "wheels/gpuprov-0-py3-none-any.whl"


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    return make_signer(tmp_path_factory.mktemp("signer"))


@pytest.fixture
def signed(tmp_path, signer):
    b = small_bundle(tmp_path / "signed")
    signer.sign(b)
    return b


def verify(bundle, *args) -> subprocess.CompletedProcess:
    return run_cli("bundle", "verify", str(bundle), *args, timeout=120)


def refused(r, *words):
    assert r.returncode == 8, (r.returncode, r.stdout, r.stderr)
    assert all(w in r.stderr for w in words), r.stderr
    assert "Traceback" not in r.stderr


def swap_wheel(bundle) -> None:
    """A package replaced (say, a gpuprov wheel that runs the attacker's code)."""
    (bundle / WHEEL).write_bytes(b"PK\x03\x04" + b"evil" * 1000)


def test_good_bundles_verify(tmp_path, signed, signer):
    r = verify(small_bundle(tmp_path / "plain"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"ok": True, "signed": False, "problems": [],
                                                           "target": json.loads(r.stdout)["target"]}, r.stderr
    r = verify(signed, "--keyring", str(signer.keyring), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["signed"] is True, r.stderr


def test_swapped_package_signature_deleted_with_keyring(signed, signer):
    """The reported attack: swap a package, regenerate the checksums, delete the signature."""
    swap_wheel(signed)
    rewrite_sums(signed, drop_keys=True)
    (signed / "SHA256SUMS.sig").unlink()
    refused(verify(signed, "--keyring", str(signer.keyring)), "SHA256SUMS.sig is missing", "--keyring was given")


def test_signature_deleted_manifest_says_signed(signed):
    swap_wheel(signed)
    rewrite_sums(signed)  # manifest still names the signing key
    (signed / "SHA256SUMS.sig").unlink()
    refused(verify(signed), "SHA256SUMS.sig is missing", "manifest names signing keys")


def test_swapped_package_signature_kept(signed, signer):
    swap_wheel(signed)
    rewrite_sums(signed)
    refused(verify(signed, "--keyring", str(signer.keyring)), "signature of SHA256SUMS does not verify")


def test_signed_by_another_key(tmp_path, signed, signer):
    """The attacker re-signs with a key of their own: the operator's keyring does not hold it."""
    swap_wheel(signed)
    other = make_signer(tmp_path / "attacker", "attacker@gpuprov.invalid")
    other.sign(signed)
    assert subprocess.run(["gpgv", "--keyring", str(other.keyring), str(signed / "SHA256SUMS.sig"),
                           str(signed / "SHA256SUMS")], capture_output=True, env=GPG_ENV).returncode == 0
    refused(verify(signed, "--keyring", str(signer.keyring)), "does not verify")


def test_garbage_signature(signed, signer):
    (signed / "SHA256SUMS.sig").write_bytes(os.urandom(200))
    refused(verify(signed, "--keyring", str(signer.keyring)), "does not verify")


def test_signature_is_a_link(signed, signer, tmp_path):
    """A signature must be the bundle's own file, not a link to one made for something else."""
    real = tmp_path / "elsewhere.sig"
    (signed / "SHA256SUMS.sig").rename(real)
    (signed / "SHA256SUMS.sig").symlink_to(real)
    refused(verify(signed, "--keyring", str(signer.keyring)), "SHA256SUMS.sig: a link")


def test_missing_keyring_file_is_usage_error(signed, tmp_path):
    r = verify(signed, "--keyring", str(tmp_path / "nope.gpg"))
    assert r.returncode == 2 and "no such file" in r.stderr, r.stderr


def add_line(bundle, line: str) -> None:
    with open(bundle / "SHA256SUMS", "a") as fh:
        fh.write(line + "\n")


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside", "repo/../../outside", "./manifest.json",
                                  "repo//Packages"])
def test_foreign_paths_in_sums(tmp_path, name):
    """A path outside the bundle with its right checksum (the host's own file gets hashed otherwise)."""
    b = small_bundle(tmp_path / "b")
    (tmp_path / "outside").write_text("host file\n")
    target = name if name.startswith("/") else str(tmp_path / "b" / name)
    digest = manifest.sha256(target) if os.path.exists(target) else "0" * 64
    add_line(b, f"{digest}  {name}")
    refused(verify(b), "SHA256SUMS line")


def test_duplicate_line_in_sums(tmp_path):
    b = small_bundle(tmp_path / "b")
    line = next(ln for ln in (b / "SHA256SUMS").read_text().splitlines() if ln.endswith(WHEEL))
    add_line(b, line)
    refused(verify(b), f"{WHEEL} listed twice")


def test_malformed_line_in_sums(tmp_path):
    b = small_bundle(tmp_path / "b")
    add_line(b, "this is not a checksum line")
    refused(verify(b), "SHA256SUMS line", "not `<sha256>  <path>`")


def test_sums_listing_its_signature(tmp_path):
    b = small_bundle(tmp_path / "b")
    add_line(b, f"{'0' * 64}  SHA256SUMS.sig")
    refused(verify(b), "cannot list itself")


def test_unlisted_file(tmp_path):
    """A file the checksums do not cover (a wheel pip would pick up from --find-links) is refused."""
    b = small_bundle(tmp_path / "b")
    (b / "wheels/evil-1-py3-none-any.whl").write_bytes(b"PK")
    refused(verify(b), "evil-1-py3-none-any.whl: not listed in SHA256SUMS")


def test_link_leading_out(tmp_path):
    """A listed file that is a link to a host file, with the host file's checksum everywhere."""
    b = small_bundle(tmp_path / "b")
    (b / WHEEL).unlink()
    (b / WHEEL).symlink_to("/etc/passwd")
    rewrite_sums(b)
    refused(verify(b), f"{WHEEL}: a link")


def test_directory_link_leading_out(tmp_path):
    b = small_bundle(tmp_path / "b")
    (tmp_path / "host").mkdir()
    (tmp_path / "host/x.whl").write_bytes(b"PK")
    (b / "wheels/more").symlink_to(tmp_path / "host")
    add_line(b, f"{manifest.sha256(tmp_path / 'host/x.whl')}  wheels/more/x.whl")
    refused(verify(b), "wheels/more: a link")


def test_fifo_in_bundle(tmp_path):
    b = small_bundle(tmp_path / "b")
    os.mkfifo(b / "repo/fifo")
    refused(verify(b), "repo/fifo: not a regular file")


def test_setuid_file_in_bundle(tmp_path):
    b = small_bundle(tmp_path / "b")
    (b / "install-offline.sh").chmod(0o4755)
    refused(verify(b), "install-offline.sh: setuid/setgid")


def test_bootstrap_bundle_keyring(signed, signer):
    """bootstrap --bundle takes the keyring too (checked before anything, so --dry-run is enough to show it)."""
    swap_wheel(signed)
    rewrite_sums(signed, drop_keys=True)
    (signed / "SHA256SUMS.sig").unlink()
    r = run_cli("bootstrap", "--bundle", str(signed), "--bundle-keyring", str(signer.keyring), "--dry-run",
                timeout=120)
    refused(r, "SHA256SUMS.sig is missing")

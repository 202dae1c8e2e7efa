"""Offline bundles for real: build a Debian 12 bundle (engine + runtime) here, then install it in a fresh Debian 12
host started with --network none; tampered, incomplete and wrong-release bundles are refused."""
from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from provision.bundle import manifest
from tests.bundles import link_copy, make_signer
from tests.conftest import needs, run_cli
from tests.integration.hosts import Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]


@pytest.fixture(scope="module")
def bundle(debian12_bundle):
    return debian12_bundle


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    return make_signer(tmp_path_factory.mktemp("signer"))


def copy_of(bundle: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(bundle, dst)
    return dst


def test_verify_ok(bundle):
    r = run_cli("bundle", "verify", str(bundle), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    man = json.loads((bundle / "manifest.json").read_text())
    assert man["target"]["name"] == "debian-12" and "docker.io" in man["components"]["engine"]
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in man["files"])


def test_altered_package_refused(bundle, tmp_path):
    b = copy_of(bundle, tmp_path, "altered")
    deb = sorted((b / "repo").glob("docker.io_*.deb"))[0]
    data = bytearray(deb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    deb.write_bytes(bytes(data))
    r = run_cli("bundle", "verify", str(b))
    assert r.returncode == 8 and "checksum mismatch" in r.stderr
    r = run_cli("bundle", "install", str(b))
    assert r.returncode == 8 and "checksum mismatch" in r.stderr


@needs("gpg", "gpgv")
def test_signed_bundle(bundle, tmp_path, signer):
    b = link_copy(bundle, tmp_path / "signed")
    signer.sign(b)
    res = manifest.verify(b, str(signer.keyring))
    assert res.ok and res.signed, res.problems
    r = run_cli("bundle", "verify", str(b), "--keyring", str(signer.keyring), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["signed"], r.stderr
    (b / "SHA256SUMS").write_text((b / "SHA256SUMS").read_text() + "\n")  # any change breaks the signature
    res = manifest.verify(b, str(signer.keyring))
    assert not res.ok and any("signature" in p for p in res.problems)


@needs("gpg", "gpgv")
def test_offline_install_in_network_none_host(bundle, tmp_path, signer):
    missing = copy_of(bundle, tmp_path, "missing")
    # an incomplete (but self-consistent) bundle: docker.io dropped from the repository and every index
    for deb in (missing / "repo").glob("docker.io_*.deb"):
        deb.unlink()
    from provision.bundle import aptrepo

    aptrepo.write_flat_repo(missing / "repo")
    man = json.loads((missing / "manifest.json").read_text())
    manifest.write_manifest(missing, man["target"], man["components"])
    eleven = copy_of(bundle, tmp_path, "eleven")
    man11 = json.loads((eleven / "manifest.json").read_text())
    manifest.write_manifest(eleven, {**man11["target"], "version": "11", "codename": "bullseye",
                                     "name": "debian-11"}, man11["components"])

    # the install itself: the bundle signed, checked with the host's own gpgv against the signer's key
    signed = link_copy(bundle, tmp_path / "signed")
    signer.sign(signed)
    keys = tmp_path / "keys"
    keys.mkdir()
    shutil.copy(signer.keyring, keys / "signer.gpg")
    # and the same bundle as a .tar.gz, for `gpuprov bundle install` (unpacked into a private directory)
    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "bundle.tar.gz", "w:gz", compresslevel=1) as tar:
        tar.add(signed, arcname="gpuprov-bundle")

    h = Host(network="none", wheelhouse=False,
             volumes={bundle: "/bundle", missing: "/bundle-missing", eleven: "/bundle-11", signed: "/bundle-signed",
                      keys: "/keys", tars: "/tars"})
    try:
        # prove the network is really off: only loopback, and apt cannot reach its archive
        assert h.exec("ls /sys/class/net").stdout.split() == ["lo"]
        upd = h.exec("apt-get update 2>&1")
        assert upd.returncode != 0 or "Err:" in upd.stdout or "Failed" in upd.stdout, upd.stdout
        before = h.exec("cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | sha256sum").stdout

        r = h.exec("bash /bundle-missing/install-offline.sh")
        assert r.returncode == 8 and "missing from bundle" in r.stderr, r.stdout + r.stderr
        assert h.exec("dpkg -s docker.io").returncode != 0

        r = h.exec("gpuprov bundle install /bundle-11")
        assert r.returncode == 9 and "this bundle is for debian-11" in r.stderr, r.stderr

        r = h.exec("bash /bundle-signed/install-offline.sh --keyring /keys/signer.gpg --json")
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        steps = {s["id"]: s for s in res["steps"]}
        assert steps["engine.packages"]["status"] == "changed" and "gpuprov-validate-ok" in steps["validate"]["detail"]
        assert h.exec("dpkg-query -W -f '${Status}' docker.io").stdout == "install ok installed"
        assert "nvidia" in json.loads(h.exec("docker info --format '{{json .Runtimes}}'").stdout)

        again = json.loads(h.exec("bash /bundle/install-offline.sh --json").stdout)  # unsigned: accepted as such
        assert again["changed"] == 0, again
        r = h.exec("gpuprov bundle install /tars/bundle.tar.gz --keyring /keys/signer.gpg --json")
        assert r.returncode == 0 and json.loads(r.stdout)["changed"] == 0, r.stdout + r.stderr
        # what was installed from is root's alone: the base and each private copy's directory are 0700, one copy per
        # bundle content (the signed directory and its .tar.gz share one; the unsigned directory has its own)
        assert h.exec("stat -c %a /var/lib/gpuprov/bundles /var/lib/gpuprov/bundles/*").stdout.split() == [
            "700", "700", "700"]
        after = h.exec("cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | sha256sum").stdout
        assert before == after  # the host's own repository configuration is as it was
    finally:
        h.remove()


def test_el_bundle_plan():
    r = run_cli("bundle", "plan", "--target", "rocky-9", "--json")
    doc = json.loads(r.stdout)
    assert doc["build"][0].startswith("dnf download --resolve --alldeps --releasever=9 --destdir")
    assert doc["build"][1].startswith("createrepo_c ")
    assert "--disablerepo=*" in doc["install"][0] and "module_hotfixes=true" in doc["install"][0]

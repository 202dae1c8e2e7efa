"""Bundles for the fault tests: small ones in the exact layout `gpuprov bundle create` writes (manifest.json and
SHA256SUMS by the product's own manifest.write_manifest, install-offline.sh the product's own), a real gpg
signer made in the test, and the tampering an attacker would do (swap a file, rewrite the checksums, drop the
signature)."""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from provision.bundle import manifest
from tests.conftest import run_cli

TARGET = {"os_id": "debian", "version": "12", "codename": "bookworm", "arch": "amd64", "kernel": None,
          "name": "debian-12"}
COMPONENTS = {"runtime": {"python3": "3.11.2-1+b1"}}
SCRIPT = Path(manifest.__file__).with_name("install-offline.sh")
GPG_ENV = {"PATH": "/usr/bin:/bin"}
# Every gpg home a test made: gpg (and `gpuprov bundle create --sign-key` with GNUPGHOME) starts an agent in it on the
# first signature and leaves it running. tests/conftest.py's autouse fixture calls stop_agents() after each test.
AGENT_HOMES: list[Path] = []


def stop_agents() -> None:
    """Stop the agents of every home made so far (a session-scoped signer's agent restarts when it signs again)."""
    for home in AGENT_HOMES:
        if home.is_dir():
            subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], capture_output=True,
                           env={**GPG_ENV, "GNUPGHOME": str(home)}, timeout=30)


def listing(d: Path) -> list[str]:
    return sorted(str(p) for p in d.rglob("*")) if d.exists() else []


def assert_refused_nothing_left(r, base: Path, *words):
    """Exit 8 with every word in its message, and nothing unpacked left under `base`, not even an empty directory."""
    assert r.returncode == 8, (r.returncode, r.stdout, r.stderr)
    assert all(w in r.stderr for w in words), r.stderr
    assert "Traceback" not in r.stderr
    assert listing(base) == [], listing(base)


def small_bundle(root: Path, keys: list[dict] | None = None) -> Path:
    """A bundle directory: install-offline.sh, a repo index and a wheel (contents are bytes, not packages)."""
    (root / "repo").mkdir(parents=True)
    (root / "wheels").mkdir()
    (root / "install-offline.sh").write_text(SCRIPT.read_text())
    (root / "install-offline.sh").chmod(0o755)
    (root / "repo/Packages").write_text("Package: python3\nVersion: 3.11.2-1+b1\nFilename: ./python3.deb\n")
    (root / "repo/python3.deb").write_bytes(b"!<arch>\n" + os.urandom(4096))
    (root / "wheels/gpuprov-0-py3-none-any.whl").write_bytes(b"PK\x03\x04" + os.urandom(4096))
    manifest.write_manifest(root, TARGET, COMPONENTS, keys)
    return root


def rewrite_sums(root: Path, drop_keys: bool = False) -> None:
    """What an attacker does after changing files: manifest and SHA256SUMS made to match the files again (the
    manifest's `keys` kept, or dropped to pass as unsigned)."""
    man = json.loads((root / "manifest.json").read_text())
    manifest.write_manifest(root, man["target"], man["components"], [] if drop_keys else man.get("keys"))


@dataclass
class Signer:
    home: Path
    keyring: Path
    fingerprint: str

    def sign(self, bundle: Path, *, at: str | None = None, sig_expire: str | None = None) -> None:
        """Sign as `gpuprov bundle create --sign-key` does: the manifest names the key, SHA256SUMS signed. `at` (gpg's
        --faked-system-time, e.g. 20200101T120000) signs in the past; `sig_expire` gives the signature an expiry."""
        man = json.loads((bundle / "manifest.json").read_text())
        manifest.write_manifest(bundle, man["target"], man["components"], [{"fingerprint": self.fingerprint}])
        if at is None and sig_expire is None:
            manifest.sign(bundle, self.fingerprint, str(self.home))
            return
        subprocess.run(["gpg", "--batch", "--yes", *(["--faked-system-time", at] if at else []),
                        *(["--default-sig-expire", sig_expire] if sig_expire else []), "--local-user",
                        self.fingerprint, "--detach-sign", "-o", str(bundle / "SHA256SUMS.sig"),
                        str(bundle / "SHA256SUMS")], check=True, capture_output=True,
                       env={**GPG_ENV, "GNUPGHOME": str(self.home)})

    def revoke(self) -> None:
        """Revoke the key with the revocation certificate gpg made with it, and re-export the keyring (an operator's
        keyring that holds the revocation, as after `gpg --import REVOCATION` and `gpg --export`)."""
        env = {**GPG_ENV, "GNUPGHOME": str(self.home)}
        cert = (self.home / "openpgp-revocs.d" / f"{self.fingerprint}.rev").read_text()
        subprocess.run(["gpg", "--batch", "--import"], input=cert.replace(":-----BEGIN", "-----BEGIN"), text=True,
                       check=True, capture_output=True, env=env)
        subprocess.run(["gpg", "--batch", "--yes", "--export", "-o", str(self.keyring), self.fingerprint], check=True,
                       capture_output=True, env=env)


def make_signer(base: Path, email: str = "bundles@gpuprov.invalid", *, at: str | None = None,
                expire: str = "never") -> Signer:
    """A real gpg key (ed25519, signing) in its own home, and its exported public keyring. `at`: made at that time
    (--faked-system-time), so that with `expire` (1d) it is an expired key today."""
    home = base / "gnupg"
    home.mkdir(mode=0o700, parents=True)
    env = {**GPG_ENV, "GNUPGHOME": str(home)}
    AGENT_HOMES.append(home)  # gpg starts an agent per home and leaves it running: stop_agents() after each test
    subprocess.run(["gpg", "--batch", "--passphrase", "", *(["--faked-system-time", at] if at else []),
                    "--quick-gen-key", email, "ed25519", "sign", expire], check=True, capture_output=True, env=env)
    out = subprocess.run(["gpg", "--batch", "--with-colons", "--fingerprint", email], capture_output=True,
                         text=True, check=True, env=env).stdout
    fpr = next(ln.split(":")[9] for ln in out.splitlines() if ln.startswith("fpr:"))
    keyring = base / "signer.gpg"
    subprocess.run(["gpg", "--batch", "--export", "-o", str(keyring), fpr], check=True, capture_output=True, env=env)
    return Signer(home, keyring, fpr)


def tar_of(bundle: Path, out: Path, extra: list[tuple[tarfile.TarInfo, bytes | None]] = (),
           mode_of=None) -> Path:
    """`bundle` as gpuprov-bundle/ in a .tar.gz (as `bundle create` packs it), plus hand-made hostile members."""
    with tarfile.open(out, "w:gz") as tar:
        tar.add(bundle, arcname="gpuprov-bundle", filter=mode_of)
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = b"", mode: int = 0o644,
           linkname: str = "", uid: int = 0) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid = kind, mode, linkname, uid
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 5
    if kind == tarfile.REGTYPE:
        info.size = len(data or b"")
    else:
        data = None
    return info, data


def link_copy(bundle: Path, dst: Path) -> Path:
    """A copy of a (large) bundle made of hard links; the files that get rewritten are made independent first
    (manifest.json, SHA256SUMS and its signature are rewritten in place by the product's own writers)."""
    shutil.copytree(bundle, dst, copy_function=os.link)
    for name in ("manifest.json", "SHA256SUMS", "SHA256SUMS.sig"):
        detach(dst / name)
    return dst


def detach(path: Path) -> None:
    if path.exists():
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)


def trap_wheel(like: Path, marker: str) -> bytes:
    """A wheel with the same name and version as `like` whose `gpuprov` command only writes `marker`: installed
    and run, it proves the bundle's code ran."""
    name, version = like.name.split("-")[:2]
    dist = f"{name}-{version}.dist-info"
    files = {
        "gpuprov_trap.py": f"import pathlib\n\ndef main():\n    pathlib.Path({marker!r}).write_text('ran')\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpuprov-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[console_scripts]\ngpuprov = gpuprov_trap:main\n",
    }
    record = "".join(f"{n},sha256={_b64sha(d.encode())},{len(d.encode())}\n" for n, d in files.items())
    files[f"{dist}/RECORD"] = record + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return buf.getvalue()


def _b64sha(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_debian12(out: Path) -> Path:
    """The real Debian 12 bundle (engine + runtime) the integration tests share: built once per session."""
    r = run_cli("bundle", "create", "--target", "debian-12", "--components", "engine,runtime", "--output",
                str(out), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    print(f"\nbundle: {res['packages']} packages, {res['bytes'] / 1e6:.1f} MB, built in {res['seconds']} s")
    assert "[1/4]" in r.stderr and "[4/4]" in r.stderr  # progress on stderr, JSON on stdout
    return out

"""manifest.json + SHA256SUMS: what a bundle holds, checked before anything from it is used."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from provision.errors import BUNDLE_INVALID, GpuprovError

SCHEMA = "gpuprov.bundle/v1"
META = ("manifest.json", "SHA256SUMS", "SHA256SUMS.sig")


class BundleInvalid(GpuprovError):
    exit_code = BUNDLE_INVALID


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_list(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in META)


def write_manifest(root: Path, target: dict, components: dict, keys: list[dict] | None = None) -> dict:
    from provision import __version__

    files = [{"path": p.relative_to(root).as_posix(), "sha256": sha256(p), "size": p.stat().st_size}
             for p in file_list(root)]
    doc = {"schema": SCHEMA, "gpuprov": __version__, "target": target, "components": components,
           "keys": keys or [], "files": files}
    (root / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    sums = [f"{f['sha256']}  {f['path']}" for f in files] + [f"{sha256(root / 'manifest.json')}  manifest.json"]
    (root / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return doc


def sign(root: Path, key: str, homedir: str | None = None) -> str:
    """Detached signature of SHA256SUMS with the operator's key; returns the key's fingerprint."""
    env = {**os.environ, **({"GNUPGHOME": homedir} if homedir else {})}
    subprocess.run(["gpg", "--batch", "--yes", "--local-user", key, "--detach-sign", "-o",
                    str(root / "SHA256SUMS.sig"), str(root / "SHA256SUMS")], check=True, capture_output=True, env=env)
    out = subprocess.run(["gpg", "--batch", "--with-colons", "--fingerprint", key], capture_output=True, text=True,
                         env=env).stdout
    return next((ln.split(":")[9] for ln in out.splitlines() if ln.startswith("fpr:")), "")


@dataclass
class VerifyResult:
    ok: bool
    manifest: dict | None
    problems: list[str] = field(default_factory=list)
    signed: bool = False

    def to_dict(self) -> dict:
        return {"ok": self.ok, "signed": self.signed, "problems": self.problems,
                "target": (self.manifest or {}).get("target")}


def verify(root: Path, keyring: str | None = None) -> VerifyResult:
    """Checksums of every file, the signature when present, and the manifest against the files and repo index."""
    problems: list[str] = []
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        sums_text = (root / "SHA256SUMS").read_text()
    except (OSError, ValueError) as exc:
        return VerifyResult(False, None, [f"not a gpuprov bundle ({exc})"])
    if manifest.get("schema") != SCHEMA:
        problems.append(f"unknown manifest schema {manifest.get('schema')!r}")
    sums = {}
    for line in sums_text.splitlines():
        digest, _, name = line.partition("  ")
        if name:
            sums[name] = digest
    signed = (root / "SHA256SUMS.sig").exists()
    if signed:
        cmd = ["gpgv"] + (["--keyring", keyring] if keyring else []) + [str(root / "SHA256SUMS.sig"),
                                                                         str(root / "SHA256SUMS")]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            problems.append("signature of SHA256SUMS does not verify" + (" (pass --keyring)" if not keyring else ""))
    for name, digest in sums.items():
        p = root / name
        if not p.is_file():
            problems.append(f"{name}: missing from bundle")
        elif sha256(p) != digest:
            problems.append(f"{name}: checksum mismatch")
    listed = {f["path"]: f for f in manifest.get("files", [])}
    on_disk = {p.relative_to(root).as_posix() for p in file_list(root)}
    for name in sorted(on_disk - set(listed)):
        problems.append(f"{name}: not in the manifest")
    for name, f in listed.items():
        if name not in sums:
            problems.append(f"{name}: in the manifest but not in SHA256SUMS")
        elif f["sha256"] != sums[name]:
            problems.append(f"{name}: manifest and SHA256SUMS disagree")
    return VerifyResult(not problems, manifest, problems, signed)

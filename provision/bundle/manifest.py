"""manifest.json + SHA256SUMS: what a bundle holds, checked before anything from it is used."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from provision import __version__, effects
from provision.errors import UsageError

SCHEMA = "gpuprov.bundle/v1"
META = ("manifest.json", "SHA256SUMS", "SHA256SUMS.sig")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_list(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in META)


def write_manifest(root: Path, target: dict, components: dict, keys: list[dict] | None = None) -> dict:
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
    effects.run(["gpg", "--batch", "--yes", "--local-user", key, "--detach-sign", "-o", str(root / "SHA256SUMS.sig"),
                 str(root / "SHA256SUMS")], env=env)
    out = effects.run(["gpg", "--batch", "--with-colons", "--fingerprint", key], check=False, env=env,
                      timeout=60).stdout
    return next((ln.split(":")[9] for ln in out.splitlines() if ln.startswith("fpr:")), "")


@dataclass
class VerifyResult:
    ok: bool
    manifest: dict | None
    problems: list[str] = field(default_factory=list)
    signed: bool = False  # SHA256SUMS.sig verified

    def to_dict(self) -> dict:
        return {"ok": self.ok, "signed": self.signed, "problems": self.problems,
                "target": (self.manifest or {}).get("target")}


# `sha256sum` output, text or binary mode; anything else in SHA256SUMS is refused, not skipped.
SUMS_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


def path_problem(name: str) -> str | None:
    """Why `name` cannot be a file of the bundle: only plain relative paths inside it (no absolute path, no `..`,
    no `.` or empty component, no backslash or control character) are allowed."""
    if name.startswith("/"):
        return "an absolute path (outside the bundle)"
    parts = name.split("/")
    if ".." in parts:
        return "a path leading out of the bundle (..)"
    if any(p in ("", ".") for p in parts) or "\\" in name or any(ord(c) < 32 or c == "\x7f" for c in name):
        return "not a plain relative path"
    return None


def parse_sums(text: str) -> tuple[dict[str, str], list[str]]:
    """SHA256SUMS -> {path: digest} and the problems: every line well-formed, every path inside the bundle, each
    path exactly once, the signature files themselves never listed."""
    sums: dict[str, str] = {}
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        m = SUMS_LINE.fullmatch(line)
        if not m:
            problems.append(f"SHA256SUMS line {n}: not `<sha256>  <path>`")
            continue
        digest, name = m.groups()
        why = path_problem(name) or ("the checksum list cannot list itself" if name in META[1:] else None)
        if why:
            problems.append(f"SHA256SUMS line {n}: {name!r} is {why}" if not why.startswith("the ") else
                            f"SHA256SUMS line {n}: {why}")
        elif name in sums:
            problems.append(f"SHA256SUMS line {n}: {name} listed twice")
        else:
            sums[name] = digest
    return sums, problems


def walk(root: Path) -> tuple[set[str], list[str]]:
    """Every regular file under `root` (relative paths, links never followed) and the problems: a bundle holds
    only directories and regular files, none setuid or setgid."""
    files: set[str] = set()
    problems: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                problems.append(f"{rel}: a link (a bundle holds no links)")
            elif stat.S_ISDIR(st.st_mode):
                continue
            elif not stat.S_ISREG(st.st_mode):
                problems.append(f"{rel}: not a regular file (device, FIFO or socket)")
            elif st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                problems.append(f"{rel}: setuid/setgid")
            else:
                files.add(rel)
    return files, problems


def _read_regular(path: Path) -> str:
    """A bundle's own metadata file, never through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        return fh.read(64 << 20).decode()


def check_signature(root: Path, keyring: str | None, required: bool) -> tuple[bool, list[str]]:
    """(signature verified, problems). With a keyring, or a manifest naming signing keys, an absent signature is
    a failure, never "unsigned". gpgv checks against the keyring alone (or root's trustedkeys.kbx without one)."""
    sig = root / "SHA256SUMS.sig"
    if not os.path.lexists(sig):
        if required:
            why = "--keyring was given" if keyring else "its manifest names signing keys"
            return False, [f"SHA256SUMS.sig is missing but the bundle must be signed ({why}): refusing"]
        return False, []
    if not shutil.which("gpgv"):
        return False, ["SHA256SUMS.sig cannot be checked: gpgv is not installed (apt-get install gpgv)"]
    cmd = ["gpgv", "--status-fd", "1"] + (["--keyring", keyring] if keyring else []) + [str(sig),
                                                                                          str(root / "SHA256SUMS")]
    p = effects.try_run(cmd, env={**os.environ, "LC_ALL": "C"}, timeout=60)
    if p is None:
        return False, ["SHA256SUMS.sig cannot be checked: gpgv did not run or did not finish within 60 s"]
    why = status_problem(p.stdout) or (None if p.returncode == 0 else "does not verify")
    if why:
        return False, [f"signature of SHA256SUMS {why}" + (f" against {keyring}" if keyring else
                                                             " (pass --keyring with the signer's key)")]
    return True, []


# gpg's machine-readable status lines that refuse a signature whatever gpgv's exit status (0 for the first two):
# a good signature by a key that has expired or been revoked is no longer the signer's word (REFERENCE.md §10).
REFUSED_STATUS = {"EXPKEYSIG": "was made by an expired key", "REVKEYSIG": "was made by a revoked key",
                  "EXPSIG": "has expired", "BADSIG": "does not verify", "ERRSIG": "does not verify",
                  "NO_PUBKEY": "does not verify"}


def status_problem(status: str) -> str | None:
    """Why gpgv's `--status-fd` output does not show a valid signature (None: it does). Valid = a VALIDSIG and none
    of REFUSED_STATUS; install-offline.sh reads the same lines the same way."""
    words = [ln.split()[1:] for ln in status.splitlines() if ln.startswith("[GNUPG:] ")]
    for w in words:
        if w and w[0] in REFUSED_STATUS:
            why = REFUSED_STATUS[w[0]]
            return why if why == "does not verify" or len(w) < 2 else f"{why} (key {w[1]})"
    return None if any(w[:1] == ["VALIDSIG"] for w in words) else "does not verify"


def verify(root: Path, keyring: str | None = None) -> VerifyResult:
    """Fail closed: the signature (required with a keyring or when the manifest names keys), a strict
    SHA256SUMS naming every file of the bundle exactly once and nothing outside it, each file's checksum, and
    the manifest against SHA256SUMS. Proven by tests/faults/test_bundle_verify.py."""
    if keyring is not None:
        keyring = os.path.abspath(keyring)  # gpgv looks a bare name up in its home directory, not here
        if not os.path.isfile(keyring):
            raise UsageError(f"--keyring {keyring}: no such file (export the signer's key with "
                             "`gpg --export KEY > FILE`)")
    try:
        manifest = json.loads(_read_regular(root / "manifest.json"))
        sums_text = _read_regular(root / "SHA256SUMS")
    except (OSError, ValueError) as exc:
        return VerifyResult(False, None, [f"not a gpuprov bundle ({exc})"])
    if not isinstance(manifest, dict):
        return VerifyResult(False, None, ["not a gpuprov bundle (manifest.json is not an object)"])
    problems: list[str] = []
    if manifest.get("schema") != SCHEMA:
        problems.append(f"unknown manifest schema {manifest.get('schema')!r}")
    signed, sig_problems = check_signature(root, keyring, required=keyring is not None or bool(manifest.get("keys")))
    problems += sig_problems
    sums, sum_problems = parse_sums(sums_text)
    problems += sum_problems
    on_disk, walk_problems = walk(root)
    problems += walk_problems
    for name in sorted(on_disk - set(sums) - set(META[1:])):
        problems.append(f"{name}: not listed in SHA256SUMS (an unlisted file is never used)")
    for name, digest in sums.items():
        if name not in on_disk:
            problems.append(f"{name}: missing from bundle")
        elif sha256(root / name) != digest:
            problems.append(f"{name}: checksum mismatch")
    if "manifest.json" not in sums:
        problems.append("manifest.json: not listed in SHA256SUMS")
    files = manifest.get("files") if isinstance(manifest.get("files"), list) else []
    listed = {f.get("path"): f for f in files if isinstance(f, dict)}
    for name in sorted(set(sums) - set(listed) - {"manifest.json"}):
        problems.append(f"{name}: not in the manifest")
    for name, f in listed.items():
        if name not in sums:
            problems.append(f"{name}: in the manifest but not in SHA256SUMS")
        elif f.get("sha256") != sums[name]:
            problems.append(f"{name}: manifest and SHA256SUMS disagree")
    return VerifyResult(not problems, manifest, problems, signed)

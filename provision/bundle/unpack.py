"""Unpacking a .tar.gz bundle as root without trusting it: members are checked before anything is written
(only regular files and directories under gpuprov-bundle/, no absolute or `..` path, no link, device or FIFO, no
setuid/setgid/sticky bit, no name twice), written by this code itself (never tarfile.extract: no owner, mode or
link from the archive is ever applied) into a fresh 0700 directory under a 0700 root-only base, with modes
normalised (0644, or 0755 when the member is executable) and owned by the user running gpuprov. Any failure
removes the whole directory. Proven by tests/faults/test_bundle_tar.py.

tarfile's filter='data' (Python 3.12, backported to 3.11.4) is close but not this: it strips a leading `/` and
clears setuid bits instead of refusing, allows links inside the destination, and lets a later member replace an
earlier one; a bundle `gpuprov bundle create` wrote has none of these, so any of them means tampering."""
from __future__ import annotations

import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from pathlib import Path

from provision.bundle.manifest import path_problem
from provision.errors import BundleInvalid
from provision.fsutil import make_dirs

TOP = "gpuprov-bundle"  # the one top-level directory `gpuprov bundle create` writes


def member_name(m: tarfile.TarInfo) -> str:
    """The member's path as written by `tar` ("./" prefix and a directory's trailing "/" dropped)."""
    name = m.name.removeprefix("./")
    return name.rstrip("/") if m.isdir() else name


def member_problem(m: tarfile.TarInfo) -> str | None:
    name = member_name(m)
    why = path_problem(name)
    if why:
        return why
    if name.split("/")[0] != TOP:
        return f"outside {TOP}/"
    if m.issym() or m.islnk():
        return f"a link (to {m.linkname!r}); a bundle holds no links"
    if not (m.isreg() or m.isdir()):
        return "a device, FIFO or other special file"
    if m.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
        return f"setuid/setgid/sticky (mode {m.mode:04o})"
    return None


def private_base(base: Path) -> Path:
    """`base` as a real directory (not a link) with mode 0700, created if need be."""
    make_dirs(base, 0o700)  # explicit modes, whatever the umask (the directories above it 0755)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise BundleInvalid(f"{base}: not a directory owned by this user; remove it (bundles are unpacked there)")
    os.chmod(base, 0o700)
    return base


def unpack(archive: Path, base: Path) -> Path:
    """The bundle directory unpacked from `archive` into a new private directory under `base` (removed, with all
    it holds, on any failure). Raises BundleInvalid (exit 8)."""
    work = Path(tempfile.mkdtemp(prefix="unpack-", dir=private_base(base)))
    try:
        seen: set[str] = set()
        with tarfile.open(archive, "r|*") as tar:  # streamed: one pass, members in archive order
            for m in tar:
                why = member_problem(m)
                if why:
                    raise BundleInvalid(f"{archive}: member {m.name!r} is {why}: refusing the bundle (nothing of "
                                        "it was kept)")
                rel = member_name(m)
                if rel in seen:
                    raise BundleInvalid(f"{archive}: member {rel!r} appears twice: refusing the bundle")
                seen.add(rel)
                dest = work / rel
                if m.isdir():
                    dest.mkdir(mode=0o755, parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                mode = 0o755 if m.mode & 0o111 else 0o644
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
                with os.fdopen(fd, "wb") as out:
                    os.fchmod(out.fileno(), mode)  # not the umask's, not the archive's
                    src = tar.extractfile(m)
                    assert src is not None  # a regular member always has data
                    shutil.copyfileobj(src, out, 1 << 20)
        top = work / TOP
        if not (top / "manifest.json").is_file():
            raise BundleInvalid(f"{archive}: no {TOP}/manifest.json: not a bundle from `gpuprov bundle create`")
        return top
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise BundleInvalid(f"{archive}: cannot unpack ({exc}): refusing the bundle (nothing of it was kept)"
                            ) from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise

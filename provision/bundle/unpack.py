"""Unpacking a .tar.gz bundle as root without trusting it: members are checked before anything is written
(only regular files and directories under gpuprov-bundle/, no absolute or `..` path, no link, device or FIFO, no
setuid/setgid/sticky bit, no name twice), written by this code itself (never tarfile.extract: no owner, mode or
link from the archive is ever applied) into a fresh 0700 directory under a 0700 root-only base, with modes
normalised (0644, or 0755 when the member is executable) and owned by the user running gpuprov. Any failure
removes the whole directory. Proven by tests/faults/test_bundle_tar.py.

tarfile's filter='data' (Python 3.12, backported to 3.11.4) is close but not this: it strips a leading `/` and
clears setuid bits instead of refusing, allows links inside the destination, and lets a later member replace an
earlier one; a bundle `gpuprov bundle create` wrote has none of these, so any of them means tampering.

Unpacking is bounded: a first pass reads the headers only (and manifest.json, itself bounded) and refuses sparse
members (a 205-byte archive can declare a 1 TiB one), a member whose size is not the one the manifest lists, and a
total beyond MAX_BYTES (64 GiB; GPUPROV_BUNDLE_MAX_BYTES) or beyond the free space where it would be unpacked; only
then is anything written, and the second pass takes exactly the members the first one saw. Proven by
tests/faults/test_bundle_unpack_bounds.py.

A bundle *directory* that is about to be installed is copied the same way (copy_dir): its regular files, within the
same bounds, into a fresh 0700 directory, so that what is verified is what is installed even when other users can
write the original (tests/faults/test_bundle_private_copy.py)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from pathlib import Path

from provision.bundle.manifest import META, path_problem, walk
from provision.errors import BundleInvalid
from provision.fsutil import make_dirs

TOP = "gpuprov-bundle"  # the one top-level directory `gpuprov bundle create` writes
# The most a bundle may unpack to (a driver bundle is about 300 MB): the stated limit, GPUPROV_BUNDLE_MAX_BYTES moves it.
MAX_BYTES = 64 << 30
META_MAX = 64 << 20  # manifest.json, SHA256SUMS, SHA256SUMS.sig: what manifest.verify reads of them at most
SPACE_MARGIN = 1 << 20  # left free on the file system after unpacking (a bundle never fills it)


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
    if m.issparse() or m.type == tarfile.GNUTYPE_SPARSE or any(k.startswith("GNU.sparse.") for k in m.pax_headers):
        return f"a sparse file (declaring {m.size} bytes); a bundle holds none"
    return None


def max_bytes() -> int:
    try:
        return int(os.environ.get("GPUPROV_BUNDLE_MAX_BYTES") or MAX_BYTES)
    except ValueError:
        return MAX_BYTES


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


Seen = tuple[str, bytes, int]  # a member as the first pass saw it: name, type, size


def survey(archive: Path, base: Path) -> list[Seen]:
    """The first pass: every member's header checked (member_problem, no name twice), the running total against the
    limit and the free space under `base`, and, at the end, every file's size against the manifest's. Reads only
    manifest.json's data; writes nothing. Raises BundleInvalid."""
    seen: list[Seen] = []
    names: set[str] = set()
    total, limit, free = 0, max_bytes(), free_bytes(base) - SPACE_MARGIN
    man = None
    with tarfile.open(archive, "r|*") as tar:
        for m in tar:
            why = member_problem(m)
            if why:
                raise BundleInvalid(f"{archive}: member {m.name!r} is {why}: refusing the bundle (nothing of it was "
                                    "kept)")
            rel = member_name(m)
            if rel in names:
                raise BundleInvalid(f"{archive}: member {rel!r} appears twice: refusing the bundle")
            names.add(rel)
            seen.append((rel, m.type, m.size))
            total += m.size if m.isreg() else 0
            if total > min(limit, free):
                raise BundleInvalid(f"{archive}: unpacks to more than {min(limit, free)} bytes (the limit is {limit}"
                                    f", GPUPROV_BUNDLE_MAX_BYTES; free space under {base}: {max(free, 0)}): refusing "
                                    "the bundle (nothing of it was written)")
            if m.isreg() and rel.partition("/")[2] in META and m.size > META_MAX:
                raise BundleInvalid(f"{archive}: {rel} declares {m.size} bytes: not a gpuprov bundle's")
            if m.isreg() and rel == f"{TOP}/manifest.json":
                src = tar.extractfile(m)
                assert src is not None
                man = src.read(META_MAX)
    _check_sizes(archive, seen, man)
    return seen


def _check_sizes(archive: Path, seen: list[Seen], man: bytes | None) -> None:
    """Every file member but the checksum files is listed in the manifest with its very size."""
    try:
        files = json.loads(man or b"")["files"]
        sizes = {f["path"]: f["size"] for f in files}
    except (ValueError, KeyError, TypeError):
        raise BundleInvalid(f"{archive}: no readable {TOP}/manifest.json with a file list: not a bundle from "
                            "`gpuprov bundle create` (nothing of it was written)") from None
    for rel, kind, size in seen:
        inner = rel.partition("/")[2]
        if kind not in tarfile.REGULAR_TYPES or inner in META:
            continue
        if inner not in sizes:
            raise BundleInvalid(f"{archive}: member {rel!r} is not in the manifest: refusing the bundle (nothing of "
                                "it was written)")
        if sizes[inner] != size:
            raise BundleInvalid(f"{archive}: member {rel!r} declares {size} bytes but the manifest says "
                                f"{sizes[inner]}: refusing the bundle (nothing of it was written)")


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
    private_base(base)
    try:
        seen = survey(archive, base)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise BundleInvalid(f"{archive}: cannot unpack ({exc}): refusing the bundle (nothing of it was kept)"
                            ) from None
    work = Path(tempfile.mkdtemp(prefix="unpack-", dir=base))
    try:
        with tarfile.open(archive, "r|*") as tar:  # streamed, members in archive order: the ones survey() saw
            for i, m in enumerate(tar):
                rel = member_name(m)
                if i >= len(seen) or seen[i] != (rel, m.type, m.size) or member_problem(m):
                    raise BundleInvalid(f"{archive}: changed while it was read (member {m.name!r}): refusing the "
                                        "bundle (nothing of it was kept)")
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


def copy_dir(src: Path, base: Path) -> Path:
    """A private copy of the bundle directory `src` under `base` (as unpack(): a new 0700 directory, modes
    normalised, owned by the user running gpuprov), for verifying and installing from a place no one else can write.
    Only regular files are copied (a link, FIFO, device or setuid file refuses the bundle), never through a link,
    the total within the limit and the free space. Raises BundleInvalid (exit 8), leaving nothing."""
    files, problems = walk(src)
    if problems:
        raise BundleInvalid(f"{src}: {problems[0]}: refusing the bundle (nothing of it was copied)")
    private_base(base)
    budget = min(max_bytes(), free_bytes(base) - SPACE_MARGIN)
    work = Path(tempfile.mkdtemp(prefix="copy-", dir=base))
    try:
        for rel in sorted(files):
            budget -= _copy_file(src / rel, work / TOP / rel, budget)
            if budget < 0:
                raise BundleInvalid(f"{src}: more than the limit ({max_bytes()} bytes, GPUPROV_BUNDLE_MAX_BYTES) or "
                                    f"the free space under {base}: refusing the bundle (nothing of it was kept)")
        return work / TOP
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise BundleInvalid(f"{src}: cannot copy ({exc}): refusing the bundle (nothing of it was kept)") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _copy_file(src: Path, dest: Path, budget: int) -> int:
    """Copy one regular file (never a link, FIFO or device: opened O_NOFOLLOW|O_NONBLOCK, then checked), at most
    `budget` + 1 bytes of it; returns the bytes copied."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as inp:
        st = os.fstat(inp.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            raise BundleInvalid(f"{src}: not a plain regular file (it changed while it was copied): refusing the "
                                "bundle")
        dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        mode = 0o755 if st.st_mode & 0o111 else 0o644
        out_fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(out_fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            copied = 0
            while copied <= budget:
                chunk = inp.read(min(1 << 20, budget + 1 - copied))
                if not chunk:
                    break
                out.write(chunk)
                copied += len(chunk)
    return copied

"""CUDA forward compatibility without a hook: an image that carries NVIDIA's compat libraries (`cuda-compat-*`, in
/usr/local/cuda/compat) newer than the host's driver gets them mounted at the SONAMEs where the runtime would mount
the host's (the same bind mounts, so no ld.so.conf file and no ldconfig run in the container).

The rules are NVIDIA's (nvidia-container-toolkit, cmd/nvidia-cdi-hook/cudacompat; docs/REFERENCE.md says more):
exactly one `libcuda.so.*.*` in the compat directory; with its `.note.cuda.fwd_compatibility` ELF note, the host
driver's major must be in the note's `Driver` list and the compat version newer than the host's; without the note,
the compat major must be greater than the host's. gpuprov adds NVIDIA's hardware rule, which the hook leaves to the
user: every selected GPU is a data-centre GPU (forward compatibility is not supported on GeForce/TITAN, Quadro/NVS
or workstation RTX boards). Otherwise the container gets the host's libraries, as before.

`find` reads the image (inroot: every file opened inside the rootfs, no link leads out, only regular files count);
`decide` is pure; `stage` hands runc gpuprov's own copy of each file used, never a path in the image."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import time

from provision import fsutil
from provision.errors import GpuprovError
from provision.inject import inroot
from provision.inject.capabilities import CUDA_COMPAT_DIR as COMPAT_DIR
from provision.inject.records import Record, fields

# The compat package's libraries that replace the host driver's (same names, the compat driver's version).
COMPAT_LIBS = ("libcuda", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libcudadebugger")
NOTE = ".note.cuda.fwd_compatibility"
NOT_DATACENTRE = ("geforce", "titan", "quadro", "nvs")


class CompatLibs(Record):
    """The image's compat libraries: driver version (of libcuda.so.<version>), the note's CUDA version and driver
    branches (None: no note), {library name: its path in the image} and {that path: the file's identity when read
    (device, inode, size, mtime)}: `stage` copies exactly the files that were read."""
    __slots__ = ()
    FIELDS = ("version", "cuda", "drivers", "files", "ids")
    version, cuda, drivers, files, ids = fields(*FIELDS)

    def __new__(cls, version: str, cuda: str | None, drivers: tuple[int, ...] | None, files: dict[str, str],
                ids: dict[str, tuple] | None = None) -> CompatLibs:
        return tuple.__new__(cls, (version, cuda, drivers, files, ids or {}))


def _nums(v: str) -> tuple[int, ...] | None:
    parts = v.split(".")
    return tuple(int(p) for p in parts) if all(p.isascii() and p.isdigit() for p in parts) else None


def fwd_note(path: str | int) -> dict | None:
    """The JSON of a 64-bit ELF's `.note.cuda.fwd_compatibility` note from "NVIDIA Corporation" (None: none).
    `path`: a file, or an fd of one (left open)."""
    import struct  # lazy: 0.3 ms (-X importtime -I -S, as discover.elf_soname); images with compat libraries only

    from provision.inject import elf  # lazy: 0.15 ms (-X importtime -I -S, min of 5); only when an ELF is read

    try:
        with open(path, "rb", closefd=not isinstance(path, int)) as fh:
            found = elf.sections(fh)
            if found is None:
                return None
            secs, shstrndx = found
            names = secs[shstrndx]
            fh.seek(names[4])
            strs = fh.read(min(names[5], 1 << 20))
            for sec in secs:
                if sec[1] != 7 or strs[sec[0]:strs.index(b"\0", sec[0])].decode() != NOTE:  # SHT_NOTE
                    continue
                fh.seek(sec[4])
                data = fh.read(min(sec[5], 1 << 16))
                namesz, descsz, _ = struct.unpack_from("<III", data, 0)
                align = max(sec[8], 1)
                off = 12 + (namesz + align - 1) // align * align
                if data[12:12 + namesz].strip(b"\0") != b"NVIDIA Corporation":  # trimmed as NVIDIA's hook does
                    return None
                doc = json.loads(data[off:off + descsz].strip(b"\0"))
                return doc if isinstance(doc, dict) else None
    except (OSError, struct.error, ValueError, IndexError, UnicodeDecodeError):
        return None
    return None


def find(rootfs: str) -> CompatLibs | None:
    """The compat libraries the image at `rootfs` carries (None: none, or not exactly one libcuda.so.*.*), each file
    opened inside the rootfs (inroot: no link leads out, only regular files count)."""
    try:
        dfd = inroot.open_in_root(rootfs, COMPAT_DIR, directory=True)
    except OSError:
        return None
    try:
        names = os.listdir(dfd)
        cuda = [n for n in names if n.startswith("libcuda.so.") and n.count(".") >= 3]
        if len(cuda) != 1 or _nums(cuda[0][len("libcuda.so."):]) is None:
            return None
        version = cuda[0][len("libcuda.so."):]
        files, ids, note = {}, {}, None
        for lib in COMPAT_LIBS:
            try:
                fd = inroot.open_at(dfd, f"{lib}.so.{version}")
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                path = f"{COMPAT_DIR}/{lib}.so.{version}"
                files[lib], ids[path] = path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                if lib == "libcuda":
                    note = fwd_note(fd) or {}
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    if note is None:  # libcuda.so.<version> is not a regular file
        return None
    drivers = note.get("Driver")
    drivers = tuple(x for x in drivers if type(x) is int) if isinstance(drivers, list) else None
    cv = note.get("CUDA Version")
    return CompatLibs(version, cv if isinstance(cv, str) and _nums(cv) else None, drivers, files, ids)


class Unusable(Exception):
    """The image's compat libraries cannot be used safely (the container then gets the host's, with a warning)."""


# The copies runc is handed (`stage`): runc resolves a mount's source again when it mounts it, inside the container's
# mount namespace after the engine's /proc and volumes are in place, so a source inside the rootfs can be redirected
# by the image or a volume (a link through /proc/self/root, a link in an emptyDir) to any host file. A copy in a
# root-only directory of gpuprov's cannot. Named by content (sha256), so every container of an image shares one copy.
STORE = "compat"  # beside the discovery cache (/var/lib/gpuprov/runtime/compat); uninstall removes it with the state
MAX_FILE = 512 << 20  # a compat library is 10-100 MB (CUDA 12/13's cuda-compat); a larger "library" is not copied
MAX_KEPT = 16  # copies kept; the oldest used go first (a running container keeps its mount of a removed copy)
FREE_MARGIN = 1 << 30  # a copy never leaves less than this free on the state's filesystem
_staged: dict[tuple, str] = {}  # the warm editor's: image file identity -> its copy (restarts of one container)


def store_dir(cache: str) -> str:
    return os.path.join(os.path.dirname(cache), STORE)


def stage(rootfs: str, libs: CompatLibs, used: set[str], store: str) -> dict[str, str]:
    """{path in the image: gpuprov's copy of it} for each path of `used` (values of libs.files). Each file is opened
    inside the rootfs again and must be the one `find` read; the copy is made (or found) in `store`, root's. Raises
    Unusable naming why."""
    try:
        sfd = fsutil.open_private_dir(store)
    except (OSError, GpuprovError) as exc:  # read-only, or a directory on the way others can write (UntrustedPath)
        raise Unusable(f"no private copy can be kept in {store}: {exc}") from None
    try:
        out = {}
        for path in sorted(used):
            try:
                fd = inroot.open_in_root(rootfs, path)
            except OSError as exc:
                raise Unusable(f"{path}: {exc.strerror or exc}") from None
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != libs.ids.get(path):
                    raise Unusable(f"{path} changed while the container was being created")
                if st.st_size > MAX_FILE:
                    raise Unusable(f"{path} is {st.st_size >> 20} MiB, more than a compat library ({MAX_FILE >> 20})")
                out[path] = _copy(fd, st, sfd, store, os.path.basename(path))
            finally:
                os.close(fd)
        return out
    finally:
        os.close(sfd)


def _copy(fd: int, st: os.stat_result, sfd: int, store: str, base: str) -> str:
    """The path of the copy of `fd`'s content in the store, made when there is none (written under a temporary
    name, then renamed: a killed copy is never taken for a whole one)."""
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _staged.get(ident)
    if known is not None and _whole(sfd, os.path.basename(known), st.st_size):
        return known
    digest = hashlib.sha256()
    for chunk in _chunks(fd):
        digest.update(chunk)
    name = f"{digest.hexdigest()}-{base}"
    if not _whole(sfd, name, st.st_size):
        try:
            free = os.statvfs(store)
            if free.f_bavail * free.f_frsize < st.st_size + FREE_MARGIN:
                raise Unusable(f"{store} has less than {(st.st_size + FREE_MARGIN) >> 20} MiB free for a copy")
            _write(fd, sfd, name, digest.hexdigest())
            _prune(sfd, keep=name)
        except OSError as exc:
            raise Unusable(f"cannot keep a copy in {store}: {exc.strerror or exc}") from None
    if len(_staged) >= MAX_KEPT * 4:
        _staged.clear()
    _staged[ident] = f"{store}/{name}"
    return _staged[ident]


def _chunks(fd: int):
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        yield chunk


def _whole(sfd: int, name: str, size: int) -> bool:
    """The store holds a complete copy by that name (root's regular file of that size; its use marks it recent)."""
    try:
        st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid in (0, os.geteuid()) and st.st_size == size):
            return False
        os.utime(name, dir_fd=sfd, follow_symlinks=False)
        return True
    except OSError:
        return False


def _write(fd: int, sfd: int, name: str, want: str) -> None:
    """Copy `fd` to `name` in the store: read again and hashed as written, renamed into place only when it is the
    content named (the image's file cannot change under a running create; this proves it)."""
    tmp = f".tmp-{os.getpid()}-{name}"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=sfd)
    try:
        digest = hashlib.sha256()
        for chunk in _chunks(fd):
            digest.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
        if digest.hexdigest() != want:
            raise OSError(0, "the image's file changed while it was copied")
        os.fchmod(out, 0o644)  # the umask never decides: the container's user reads it
        os.fsync(out)  # a copy named by its content must be whole after a power loss too
        os.rename(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
    except BaseException:
        os.unlink(tmp, dir_fd=sfd)
        raise
    finally:
        os.close(out)


def _prune(sfd: int, keep: str) -> None:
    """At most MAX_KEPT copies: the least recently used go (with any temporary file a killed copy left)."""
    entries = []
    for name in os.listdir(sfd):
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        except OSError:
            continue
        if name.startswith(".tmp-") and st.st_mtime < time.time() - 3600:  # not a copy still being written
            os.unlink(name, dir_fd=sfd)
        elif not name.startswith(".tmp-") and name != keep:
            entries.append((st.st_mtime_ns, name))
    for _, name in sorted(entries)[:max(0, len(entries) + 1 - MAX_KEPT)]:
        os.unlink(name, dir_fd=sfd)


def datacentre(model: str | None) -> bool:
    """A data-centre GPU by its name (Tesla, A100, H100, H200, L40S, B200…, RTX … Server Edition): not GeForce,
    TITAN, Quadro, NVS or a workstation RTX. An unknown name is not one (compat then stays off)."""
    m = (model or "").lower()
    return bool(m) and not any(x in m for x in NOT_DATACENTRE) and ("rtx" not in m or "server" in m)


def decide(compat: CompatLibs | None, host_version: str | None, models: list[str | None]) -> str | None:
    """None when the container gets the host's libraries; else why the compat ones are used (NVIDIA's rules above,
    and every selected GPU a data-centre one)."""
    host = _nums(host_version or "")
    mine = _nums(compat.version) if compat is not None else None
    if not host or not mine or not models or not all(datacentre(m) for m in models):
        return None
    if compat.drivers is not None:  # the library says which driver branches it supports
        if host[0] in compat.drivers and mine > host:
            return f"compat {compat.version} supports driver branch {host[0]}"
        return None
    return f"compat {compat.version} is a newer branch than the host's {host_version}" if mine[0] > host[0] else None

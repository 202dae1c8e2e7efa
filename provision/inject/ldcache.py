"""An image's /etc/ld.so.cache, read (never written, never run): which file its loader takes for a SONAME.

glibc's loader looks a library up in ld.so.cache before it searches any directory, so an image whose cache names
its own libcuda.so.1 (a CUDA compat package, a vendored copy in /opt) loads that copy, whatever gpuprov mounts at
the SONAME in the default directory (nvidia-container-toolkit#176, #289). modify.override_image_cache mounts the
host's library over each file the cache names for a driver SONAME.

The format is glibc's "new" one (elf/cache.c, sysdeps/generic/dl-cache.h), written alone since glibc 2.32 and after
the old one before: a 48-byte header (magic "glibc-ld.so.cache" "1.1", nlibs, len_strings, …) and nlibs 24-byte
entries (flags, key, value, osversion, hwcap), key and value being offsets of NUL-ended strings from the header.
Import-light (os, stat, struct lazily): the start path loads it; a cache that names no driver library costs one
bounded read and a few substring scans."""
from __future__ import annotations

import os
import stat

from provision.inject.capabilities import LIBRARIES

CACHE = "/etc/ld.so.cache"
MAGIC = b"glibc-ld.so.cache1.1"
HEADER, ENTRY = 48, 24
FLAG_X8664 = 0x0303  # FLAG_ELF_LIBC6 | FLAG_X8664_LIB64: a 64-bit x86 library (the only ones gpuprov mounts)
MARKERS = (b"libcuda", b"libnv", b"_nvidia")  # every driver library's name has one (tests/faults/test_field_runtime.py)
DRIVER_LIBRARIES = frozenset(lib for libs in LIBRARIES.values() for lib in libs)
MAX_CACHE = 16 << 20  # a cache larger than this is not one a loader would map either: ignored


def read_cache(path: str) -> bytes:
    """The cache file's bytes (b"" when there is none, or it is not a regular file: a FIFO an image planted there
    is never read; O_NONBLOCK so that opening one does not wait for a writer)."""
    return _open_cache(path, None)[1]


def _open_cache(path: str, seen: dict | None) -> tuple[tuple | None, bytes]:
    """(identity, bytes) of the cache at `path`; the bytes are not read (b"") when `seen` already knows the identity
    (inode, size, mtime, ctime: the same image layer's file in every container of that image)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None, b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE:
            return None, b""
        ident = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen is not None and ident in seen:
            return ident, b""
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return ident, b"".join(chunks)
    except OSError:
        return None, b""
    finally:
        os.close(fd)


def entries(data: bytes) -> list[tuple[str, str]]:
    """(SONAME, path) for each 64-bit x86 library in the cache, in the cache's (the loader's) order; [] for
    anything that is not a well-formed cache (offsets out of bounds are skipped, never trusted)."""
    import struct  # lazy: 0.3 ms (-X importtime -I -S), only for an image whose cache names a driver library

    base = data.find(MAGIC)
    if base < 0 or len(data) < base + HEADER:
        return []
    nlibs, = struct.unpack_from("<I", data, base + 20)
    if base + HEADER + nlibs * ENTRY > len(data):
        return []
    out = []
    for i in range(nlibs):
        flags, key, value = struct.unpack_from("<iII", data, base + HEADER + i * ENTRY)
        if flags != FLAG_X8664:
            continue
        k, v = _string(data, base + key), _string(data, base + value)
        if k and v:
            out.append((k, v))
    return out


def _string(data: bytes, at: int) -> str | None:
    end = data.find(b"\0", at)
    if at >= len(data) or end < 0:
        return None
    try:
        return data[at:end].decode()
    except UnicodeDecodeError:
        return None


# The warm editor's answers per cache file identity (_open_cache): containers of one image share the file of its
# layer, so only the first start of an image reads and scans its cache (~100 us for 35 kB here), the next ones pay an
# fstat. A wrong hit could only cost an override mount, which is still resolved inside that container's rootfs.
_seen: dict[tuple, list[tuple[str, str]]] = {}
SEEN_MAX = 256


def driver_entries(path: str) -> list[tuple[str, str]]:
    """The (SONAME, absolute path) entries of the cache at `path` for what may be a driver library (a marker in its
    SONAME); the caller keeps those it mounts. Do not change the list: it is the one remembered for the file."""
    ident, data = _open_cache(path, _seen)
    if ident is None:
        return []
    if ident not in _seen:
        if len(_seen) >= SEEN_MAX:
            _seen.clear()
        _seen[ident] = _driver_entries(data)
    return _seen[ident]


def _driver_entries(data: bytes) -> list[tuple[str, str]]:
    """Every entry whose SONAME has a marker. Only the strings around the markers are looked at first (glibc's
    ldconfig stores a key as the tail of its path): a cache that names no driver library (nearly every image) costs
    three substring scans, and the entries are parsed only when a driver SONAME is really there."""
    named = set()
    for m in MARKERS:
        at = data.find(m)
        while at >= 0:
            start, end = data.rfind(b"\0", 0, at) + 1, data.find(b"\0", at)
            named.add(data[start:end if end >= 0 else len(data)].rpartition(b"/")[2])  # a key may be a path's tail
            at = data.find(m, max(at + 1, end))
    if not named:
        return []
    return [(k, v) for k, v in entries(data) if k.encode() in named and v.startswith("/") and _driver_name(k)]


def _driver_name(soname: str) -> bool:
    """A library of the driver (capabilities.LIBRARIES, or an EGL platform library discovery adds), not one of the
    CUDA toolkit's that a CUDA image registers (libcudart, libnvvm, libnvrtc…)."""
    base = soname.partition(".so")[0]
    return base in DRIVER_LIBRARIES or base.startswith("libnvidia-egl-")

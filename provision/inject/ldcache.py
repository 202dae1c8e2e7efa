"""An image's /etc/ld.so.cache, read (never written, never run): which file its loader takes for a SONAME.

glibc's loader looks a library up in ld.so.cache before it searches any directory, so an image whose cache names
its own libcuda.so.1 (a CUDA compat package, a vendored copy in /opt) loads that copy, whatever gpuprov mounts at
the SONAME in the default directory (nvidia-container-toolkit#176, #289). modify.override_image_cache mounts the
host's library over each file the cache names for a driver SONAME.

The format is glibc's "new" one (elf/cache.c, sysdeps/generic/dl-cache.h), written alone since glibc 2.32 and after
the old one before: a 48-byte header (magic "glibc-ld.so.cache" "1.1", nlibs, len_strings, …) and nlibs 24-byte
entries (flags, key, value, osversion, hwcap), key and value being offsets of NUL-ended strings from the header.

The image writes this file, so every step is linear in its size and the size is capped (issue 38 item 3: the scan
was quadratic, 0.4 MB took 3.5 s and held the warm editor, so every other tenant's GPU start, meanwhile): one pass
per marker, one sorted sweep for the strings the entries name, a SONAME longer than NAME_MAX or a path longer than
PATH_MAX is no name. A cache over MAX_CACHE, or naming more driver files than MAX_DRIVER_ENTRIES, refuses the start
in one line.
Import-light (os, stat, struct lazily): the start path loads it; a cache that names no driver library costs one
bounded read and a few substring scans."""
from __future__ import annotations

import os
import stat

from provision.errors import Refused
from provision.inject import inroot
from provision.inject.capabilities import LIBRARIES

CACHE = "/etc/ld.so.cache"
MAGIC = b"glibc-ld.so.cache1.1"
HEADER, ENTRY = 48, 24
FLAG_X8664 = 0x0303  # FLAG_ELF_LIBC6 | FLAG_X8664_LIB64: a 64-bit x86 library (the only ones gpuprov mounts)
MARKERS = (b"libcuda", b"libnv", b"_nvidia")  # every driver library's name has one (tests/faults/test_field_runtime.py)
DRIVER_LIBRARIES = frozenset(lib for libs in LIBRARIES.values() for lib in libs)
NAME_MAX, PATH_MAX = 255, 4096  # a SONAME is a file name, a cached path a path: longer strings are neither
# Real caches measured (docs/PROOFS.md, issue 38 item 3): 4-9 kB in Debian, Ubuntu and EL images, 35 kB with a CUDA 13
# toolkit, 34 kB on an H100 host with the driver in two directories (~60 bytes a library): 1 MiB is ~16 000
# libraries, and the worst cache of that size costs a few ms to scan.
MAX_CACHE = 1 << 20
# The same H100 host's cache names 96 driver files (each SONAME, its .so link and versioned name, in two
# directories); each one named costs the start a lookup inside the image and a mount.
MAX_DRIVER_ENTRIES = 512


def read_cache(rootfs: str) -> bytes:
    """The bytes of the image's cache (b"" when there is none, or it is not a regular file: a FIFO or device node an
    image planted there is never opened). Raises Refused past MAX_CACHE."""
    return _open_cache(rootfs, None)[1]


def _open_cache(rootfs: str, seen: dict | None) -> tuple[tuple | None, bytes]:
    """(identity, bytes) of the image's cache, opened inside its rootfs (inroot: no link leads out, only a regular
    file is opened); the bytes are not read (b"") when `seen` already knows the identity (inode, size, mtime,
    ctime: the same image layer's file in every container of that image)."""
    try:
        fd = inroot.open_in_root(rootfs, CACHE)
    except OSError:
        return None, b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, b""
        if st.st_size > MAX_CACHE:
            # Refused, not ignored: skipping it would let the image's own driver copies win unseen
            raise Refused(f"the image's {CACHE} is {st.st_size} bytes, more than the {MAX_CACHE} gpuprov reads "
                          f"(real caches are tens of kB): rebuild it with ldconfig in the image, or remove it")
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


def _offsets(data: bytes) -> list[tuple[int, int]]:
    """(key, value) offsets in `data` of each 64-bit x86 entry, in the cache's (the loader's) order; [] for anything
    that is not a well-formed cache (entries past the end)."""
    import struct  # lazy: 0.3 ms (-X importtime -I -S), only for an image whose cache names a driver library

    base = data.find(MAGIC)
    if base < 0 or len(data) < base + HEADER:
        return []
    nlibs, = struct.unpack_from("<I", data, base + 20)
    table = base + HEADER
    if table + nlibs * ENTRY > len(data):
        return []
    return [(base + key, base + value) for flags, key, value, _, _ in
            struct.iter_unpack("<iIIIQ", memoryview(data)[table:table + nlibs * ENTRY]) if flags == FLAG_X8664]


def _strings(data: bytes, offsets, limit: int) -> dict[int, str]:
    """The NUL-ended string at each offset, when it is at most `limit` bytes and UTF-8. One sweep in offset order:
    every entry may name the same long string, or a different place in it, and each byte is searched once."""
    out = {}
    nul = -1  # the first NUL at or after the previous offset: no NUL lies between that offset and it
    for at in sorted(offsets):
        if nul < at:
            nul = data.find(b"\0", at)
            if nul < 0:
                break  # no NUL after here: no string ends, at this offset or any later one
        if nul - at <= limit:
            try:
                out[at] = data[at:nul].decode()
            except UnicodeDecodeError:
                pass
    return out


def entries(data: bytes) -> list[tuple[str, str]]:
    """(SONAME, path) for each 64-bit x86 library in the cache, in the cache's (the loader's) order; [] for
    anything that is not a well-formed cache (offsets out of bounds, overlong or undecodable strings are skipped,
    never trusted)."""
    pairs = _offsets(data)
    keys = _strings(data, {k for k, _ in pairs}, NAME_MAX)
    values = _strings(data, {v for _, v in pairs}, PATH_MAX)
    return [(keys[k], values[v]) for k, v in pairs if keys.get(k) and values.get(v)]


# The warm editor's answers per cache file identity (_open_cache): containers of one image share the file of its
# layer, so only the first start of an image reads and scans its cache (~100 us for 35 kB here), the next ones pay an
# fstat. A wrong hit could only cost an override mount, which is still resolved inside that container's rootfs.
_seen: dict[tuple, list[tuple[str, str]]] = {}
SEEN_MAX = 256


def driver_entries(rootfs: str) -> list[tuple[str, str]]:
    """The (SONAME, absolute path) entries of the image's cache (the image at `rootfs`) for a driver library, each
    pair once; the caller
    keeps those it mounts. Do not change the list: it is the one remembered for the file. Raises Refused for a
    cache past MAX_CACHE or one naming more than MAX_DRIVER_ENTRIES driver files."""
    ident, data = _open_cache(rootfs, _seen)
    if ident is None:
        return []
    found = _seen.get(ident)
    if found is None:
        found = _driver_entries(data)
        if len(_seen) >= SEEN_MAX:
            _seen.clear()
        _seen[ident] = found
    return found


def _driver_entries(data: bytes) -> list[tuple[str, str]]:
    """Every entry whose SONAME is a driver library's. A cache with no marker at all (nearly every image) costs
    three substring scans; otherwise only the driver entries' paths are read."""
    if not any(m in data for m in MARKERS):
        return []
    pairs = _offsets(data)
    drivers = {at: name for at, name in _strings(data, {k for k, _ in pairs}, NAME_MAX).items() if _driver_name(name)}
    ours = dict.fromkeys((k, v) for k, v in pairs if k in drivers)  # dicts: each once, in the cache's order
    values = _strings(data, {v for _, v in ours}, PATH_MAX)
    found = dict.fromkeys((drivers[k], values[v]) for k, v in ours if values.get(v, "").startswith("/"))
    if len(found) > MAX_DRIVER_ENTRIES:
        raise Refused(f"the image's {CACHE} names {len(found)} files for driver libraries, more than the "
                      f"{MAX_DRIVER_ENTRIES} gpuprov overrides (a real one names tens): rebuild it with ldconfig in "
                      f"the image, or remove it")
    return list(found)


def _driver_name(soname: str) -> bool:
    """A library of the driver (capabilities.LIBRARIES, or an EGL platform library discovery adds), not one of the
    CUDA toolkit's that a CUDA image registers (libcudart, libnvvm, libnvrtc…). Never a name with a slash: the loader
    takes that as a path, it never looks it up in the cache."""
    base = soname.partition(".so")[0]
    return (base in DRIVER_LIBRARIES or base.startswith("libnvidia-egl-")) and "/" not in soname

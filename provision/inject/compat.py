"""CUDA forward compatibility without a hook: an image that carries NVIDIA's compat libraries (`cuda-compat-*`, in
/usr/local/cuda/compat) newer than the host's driver gets them mounted at the SONAMEs where the runtime would mount
the host's (the same bind mounts, so no ld.so.conf file and no ldconfig run in the container).

The rules are NVIDIA's (nvidia-container-toolkit, cmd/nvidia-cdi-hook/cudacompat; docs/REFERENCE.md says more):
exactly one `libcuda.so.*.*` in the compat directory; with its `.note.cuda.fwd_compatibility` ELF note, the host
driver's major must be in the note's `Driver` list and the compat version newer than the host's; without the note,
the compat major must be greater than the host's. gpuprov adds NVIDIA's hardware rule, which the hook leaves to the
user: every selected GPU is a data-centre GPU (forward compatibility is not supported on GeForce/TITAN, Quadro/NVS
or workstation RTX boards). Otherwise the container gets the host's libraries, as before.

`find` reads the image (through the runtime's in-rootfs resolver, passed in: symlinks never leave the rootfs, and
only regular files count); `decide` is pure."""
from __future__ import annotations

import json
import os
import stat

from provision.inject.capabilities import CUDA_COMPAT_DIR as COMPAT_DIR
from provision.inject.records import Record, fields

# The compat package's libraries that replace the host driver's (same names, the compat driver's version).
COMPAT_LIBS = ("libcuda", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libcudadebugger")
NOTE = ".note.cuda.fwd_compatibility"
NOT_DATACENTRE = ("geforce", "titan", "quadro", "nvs")


class CompatLibs(Record):
    """The image's compat libraries: driver version (of libcuda.so.<version>), the note's CUDA version and driver
    branches (None: no note), and {library name: host path of the file inside the rootfs}."""
    __slots__ = ()
    FIELDS = ("version", "cuda", "drivers", "files")
    version, cuda, drivers, files = fields(*FIELDS)

    def __new__(cls, version: str, cuda: str | None, drivers: tuple[int, ...] | None, files: dict[str, str]
                ) -> CompatLibs:
        return tuple.__new__(cls, (version, cuda, drivers, files))


def _nums(v: str) -> tuple[int, ...] | None:
    parts = v.split(".")
    return tuple(int(p) for p in parts) if all(p.isascii() and p.isdigit() for p in parts) else None


def fwd_note(path: str) -> dict | None:
    """The JSON of a 64-bit ELF's `.note.cuda.fwd_compatibility` note from "NVIDIA Corporation" (None: none)."""
    import struct  # lazy: 0.3 ms (-X importtime -I -S, as discover.elf_soname); images with compat libraries only

    from provision.inject import elf  # lazy: 0.15 ms (-X importtime -I -S, min of 5); only when an ELF is read

    try:
        with open(path, "rb") as fh:
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


def find(rootfs: str, image_path) -> CompatLibs | None:
    """The compat libraries the image at `rootfs` carries (None: none, or not exactly one libcuda.so.*.*).
    `image_path(rootfs, path)`: the runtime's resolver (modify.image_path), so a link in the image stays in it."""
    d = image_path(rootfs, COMPAT_DIR)
    try:
        names = os.listdir(d) if stat.S_ISDIR(os.lstat(d).st_mode) else []
    except OSError:
        return None

    def regular(p: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(p).st_mode)
        except OSError:
            return False

    cuda = [n for n in names if n.startswith("libcuda.so.") and n.count(".") >= 3 and regular(f"{d}/{n}")]
    if len(cuda) != 1 or _nums(cuda[0][len("libcuda.so."):]) is None:
        return None
    version = cuda[0][len("libcuda.so."):]
    files = {lib: f"{d}/{lib}.so.{version}" for lib in COMPAT_LIBS if regular(f"{d}/{lib}.so.{version}")}
    note = fwd_note(files["libcuda"]) or {}
    drivers = note.get("Driver")
    drivers = tuple(x for x in drivers if type(x) is int) if isinstance(drivers, list) else None
    cv = note.get("CUDA Version")
    return CompatLibs(version, cv if isinstance(cv, str) and _nums(cv) else None, drivers, files)


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

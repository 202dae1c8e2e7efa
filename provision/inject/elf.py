"""The section headers of a 64-bit little-endian ELF file, read bounded: one parser for discover.elf_soname (a
driver library's DT_SONAME) and compat.fwd_note (NVIDIA's forward-compatibility note in an image's libcuda)."""
from __future__ import annotations

import struct  # the callers import this module lazily (discovery's rebuild, images with compat libraries only)

MAX_SECTIONS = 4096  # a real driver library has a few dozen; a planted file must not make us read 4 GiB of headers


def sections(fh) -> tuple[list[tuple], int] | None:
    """(each section header as (name, type, flags, addr, offset, size, link, info, addralign, entsize), the index of
    the section names' table) of the ELF64 little-endian file open in `fh`; None for any other file. struct.error
    or OSError when the file is cut short."""
    head = fh.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
    if shnum > MAX_SECTIONS or shentsize < 64:
        return None
    fh.seek(shoff)
    raw = fh.read(shentsize * shnum)
    return [struct.unpack_from("<IIQQQQIIQQ", raw, i * shentsize) for i in range(shnum)], shstrndx

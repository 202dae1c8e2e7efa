"""Reading files under a host root (`--root`), never through globals.

A `--root` tree may hold anything (a capture, a mounted disk, a hostile tree): every read here opens the file
read-only and non-blocking, reads only regular files, and stops after a bound, so a FIFO, a device node or a huge
file can never hang or swamp detection (tests/faults/test_detect_root.py)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

# Every file detection reads (os-release, sysfs attributes, /proc/modules, engine configs) is far below this.
MAX_READ = 4 << 20


class NotRegular(OSError):
    """The path exists but is not a regular file (FIFO, socket, device node, directory)."""


def under(root: Path, path: str) -> Path:
    """`path` (absolute on the host) as seen under `root`."""
    return root / path.lstrip("/")


def read_bytes_bounded(path: Path | str, limit: int = MAX_READ) -> bytes:
    """The first `limit` bytes of a regular file. Raises OSError (NotRegular for FIFOs, devices, directories).
    O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path}: not a regular file")
        chunks, left = [], limit
        while left > 0:  # procfs/sysfs files report size 0 or 4096 whatever they hold: read to EOF, bounded
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text_file(path: Path | str, limit: int = MAX_READ) -> str:
    """read_bytes_bounded, decoded (undecodable bytes replaced). Raises OSError like it."""
    return read_bytes_bounded(path, limit).decode(errors="replace")


def read_text(root: Path, path: str) -> str | None:
    """File content, or None when it does not exist or cannot be read (probes never raise on absence)."""
    try:
        return read_text_file(under(root, path))
    except OSError:
        return None


def read_first_line(root: Path, path: str) -> str | None:
    text = read_text(root, path)
    return text.strip().splitlines()[0].strip() if text and text.strip() else None


def is_live(root: Path) -> bool:
    """True when `root` is this running system's `/` (then commands may be run and uname used)."""
    try:
        return os.path.samefile(root, "/")
    except OSError:
        return False

"""Reading files under a host root (`--root`), never through globals."""
from __future__ import annotations

import os
from pathlib import Path


def under(root: Path, path: str) -> Path:
    """`path` (absolute on the host) as seen under `root`."""
    return root / path.lstrip("/")


def read_text(root: Path, path: str) -> str | None:
    """File content, or None when it does not exist or cannot be read (probes never raise on absence)."""
    try:
        return under(root, path).read_text(errors="replace")
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

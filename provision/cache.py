"""A small on-disk cache for facts that are slow to read but keyed by something cheap to check
(e.g. an engine's `--version`, keyed by the binary's inode, size and mtime). Best effort: a cache that cannot be
read or written is simply not used."""
from __future__ import annotations

import json
import os
from pathlib import Path

from provision.fsutil import atomic_write_text

DEFAULT_DIR = "/var/cache/gpuprov"


def cache_dir() -> Path:
    return Path(os.environ.get("GPUPROV_CACHE_DIR", DEFAULT_DIR))


def file_key(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{path}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def load(name: str) -> dict:
    try:
        return json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}


def store(name: str, data: dict) -> None:
    try:
        atomic_write_text(cache_dir() / name, json.dumps(data, sort_keys=True), mode=0o644, backup=False)
    except OSError:
        pass

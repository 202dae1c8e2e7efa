"""A small on-disk cache for probe results that are slow to get but keyed by something cheap to check (an
engine's `--version`, keyed by the binary's inode, size and mtime). Best effort: a cache that cannot be read or
written is simply not used. Only the probe layer writes it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from provision.fsutil import read_trusted, write_file

DEFAULT_DIR = "/var/cache/gpuprov"


def cache_dir() -> Path:
    return Path(os.environ.get("GPUPROV_CACHE_DIR", DEFAULT_DIR))


class FileKey(NamedTuple):
    """What changes when a binary is upgraded: its path, inode, size and mtime."""
    path: str
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> FileKey | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(path, st.st_ino, st.st_size, st.st_mtime_ns)

    def to_json(self) -> dict:
        return {"path": self.path, "ino": self.ino, "size": self.size, "mtime_ns": self.mtime_ns}


def load(name: str) -> dict:
    """The cache's content, or {} (a miss) when it is absent, garbled, or not root's alone (fsutil.open_trusted)."""
    try:
        return json.loads(read_trusted(cache_dir() / name) or b"{}")
    except (OSError, ValueError):
        return {}


def store(name: str, data: dict) -> None:
    try:
        write_file(cache_dir() / name, json.dumps(data, sort_keys=True), mode=0o644, keep_mode=False, backup=False,
                   durable=False)
    except OSError:
        pass

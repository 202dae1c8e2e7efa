"""File effects: atomic writes with backups, so a user's file is either the old one or the new one, never half."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path


def atomic_write_text(path: Path, text: str, *, mode: int | None = None, backup: bool = True) -> Path | None:
    """Write `text` to `path` atomically (temp file in the same directory, fsync, rename). Keeps the old file's
    mode and owner. With `backup`, the previous content is kept as `<path>.gpuprov-<timestamp>.bak`; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bak = None
    st = None
    try:
        st = path.stat()
    except FileNotFoundError:
        pass
    if backup and st is not None:
        bak = path.with_name(f"{path.name}.gpuprov-{time.strftime('%Y%m%d%H%M%S')}.bak")
        shutil.copy2(path, bak)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if st is not None:
            os.chmod(tmp, st.st_mode & 0o7777)
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except PermissionError:
                pass
        elif mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return bak

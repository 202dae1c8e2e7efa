"""What the suite's parallel workers share, and build once (issue 37): images, the wheelhouse, stand-in archives,
unpacked packages, the kubelet, DKMS builds. Each is cached by its inputs (its name or directory carries a hash of
them); `once(name)` makes the second worker that wants the same thing wait for the first to finish it, then use it,
instead of building it again beside it or removing a half-made copy the first is still writing.

The lock is an flock on a file under CACHE/locks: released by the kernel when its holder dies (a killed run leaves
nothing locked), shared by every process on the machine that builds into the same cache, the host containers'
own builds included (the DKMS build cache: tests/integration/dkms_make_cache.py)."""
from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE = Path(os.environ.get("GPUPROV_TEST_CACHE", "/var/cache/gpuprov-tests"))


@contextmanager
def once(name: str) -> Iterator[None]:
    """Hold the machine-wide build lock called NAME (any text: an image name, a cache directory) while the body
    checks whether the thing exists and builds it if not."""
    locks = CACHE / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:200] + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

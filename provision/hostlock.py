"""One lock for the whole host: every gpuprov command that changes the host holds it, so two runs (an operator and
Ansible, two terminals, a retry loop) never interleave their read-merge-write of the same files.

    from provision.hostlock import host_lock

    with host_lock("bundle install"):
        ...                      # change the host

or, on a typer command, `@changes_host("share enable")`. A second run waits (saying so on stderr, naming the holder);
with `gpuprov --no-wait …` (or GPUPROV_NO_WAIT=1) it fails at once with HostBusy (exit 11). The lock is flock(2) on
`/run/gpuprov/host.lock` (or `/var/lib/gpuprov/host.lock` where /run is unusable): the kernel drops it when the
holder exits, however it exits, so a crashed or killed run never leaves the host locked. Re-entrant within one
process (bootstrap's engine step calls the same code as `engine configure`).
"""
from __future__ import annotations

import fcntl
import functools
import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from provision.errors import HostBusy, WriteFailed
from provision.fsutil import make_dirs

LOCK_DIRS = ("/run/gpuprov", "/var/lib/gpuprov")
LOCK_NAME = "host.lock"
RECORD = 128  # bytes of "PID what" kept in the lock file

_depth = 0  # > 0 while this process holds the lock
_no_wait = os.environ.get("GPUPROV_NO_WAIT", "") not in ("", "0")


def set_no_wait(value: bool) -> None:
    """`gpuprov --no-wait`: fail fast (exit 11) instead of waiting for another run."""
    global _no_wait
    _no_wait = value


def lock_dirs() -> tuple[str, ...]:
    # GPUPROV_LOCK_DIR: tests that must not contend with a real gpuprov run on the same machine.
    extra = os.environ.get("GPUPROV_LOCK_DIR")
    return (extra, *LOCK_DIRS) if extra else LOCK_DIRS


def _open() -> tuple[int, str]:
    errors = []
    for d in lock_dirs():
        path = os.path.join(d, LOCK_NAME)
        try:
            make_dirs(d, 0o755)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600), path
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
    raise WriteFailed(f"cannot create the host lock ({'; '.join(errors)}); run as root on a writable /run or "
                      "/var/lib")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, RECORD, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    pid, _, what = text.partition(" ")
    return f"pid {pid}: gpuprov {what}" if pid else "another gpuprov run"


@contextmanager
def host_lock(what: str, *, wait: bool | None = None) -> Iterator[None]:
    """Hold the host lock for the block. `what` names this run for whoever waits ("engine configure docker")."""
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    fd, path = _open()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not (not _no_wait if wait is None else wait):
                raise HostBusy(f"the host is busy ({holder}; lock {path}); wait for it to finish, or run again "
                               "without --no-wait to wait") from None
            print(f"gpuprov: waiting for {holder} to finish (lock {path})…", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        # Who holds it, for whoever waits. A fixed-size record, never a truncation: ext4 flushes a file truncated to
        # zero when it is closed (auto_da_alloc), which made the lock cost ~4 ms instead of ~10 µs.
        os.pwrite(fd, f"{os.getpid()} {what}"[:RECORD - 1].ljust(RECORD - 1).encode() + b"\n", 0)
        _depth = 1
        yield
    finally:
        _depth = 0
        os.close(fd)  # releases the flock


def changes_host(what: str) -> Callable:
    """Decorator for a command function: run it under the host lock (typer still sees the function's signature)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with host_lock(what):
                return fn(*args, **kwargs)
        return inner
    return wrap

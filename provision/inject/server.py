"""A warm editor for the compiled front-end: the same edits as modify_main.py, without a Python start-up per
container. The front-end connects to a root-only unix socket; when nothing (trusted) answers it runs the editor
directly, which then leaves this server behind (detached, minimal environment) for the next containers.

- One editor at a time: a server holds an exclusive flock on `<socket>.lock` (which names its pid) for its whole
  life; one that cannot take it exits at once, so any number of concurrent cold starts leaves exactly one.
- Never dies on a request: every request gets one line back, `RC\\tMESSAGE`; a bad one (garbage, too long, a bundle
  whose config.json has wrong types, a hostile env value, a client that hangs up) gets a one-line refusal and the
  server goes on serving. A client whose whole request has not come within CLIENT_TIMEOUT_S is dropped.
- Serves only from a directory that is root's alone (the front-end checks the same before it trusts the socket).
- Exits after IDLE_SECONDS without requests, or as soon as gpuprov's runtime code on disk changes (an upgrade).
- One container's start never holds another's (issue 38 item 3): a request still being edited after HAND_OFF_CPU_S
  of CPU or HAND_OFF_WALL_S of waiting (an image built to make its own start slow) is handed off: the editor forks,
  this process finishes that request and exits, the child serves on with the same warm state (_Server.hand_off).
- Run from an editor copy (inject/install.py: install_editor) that is no longer `current`, it answers no request
  (the front-end then edits directly, with its own copy) and exits within POLL_S, idle or not."""
from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import stat
import struct
import sys
import time

from provision.fsutil import make_dirs
from provision.inject.shim import run_create_edits

IDLE_SECONDS = 600
POLL_S = 2.0  # how often an idle editor looks whether an upgrade replaced its copy
CLIENT_TIMEOUT_S = 1.0  # for the whole request: the front-end sends it at once; a silent or dripping client holds up nobody
MAX_REQUEST = 16384  # shim.c's request buffer is 12400 bytes
# shim.c reads the reply into 4096 bytes, its newline included; a longer line is taken for a hang-up. Clipped to
# this, a reply also fits an empty socket buffer at once, so its one write never blocks on a client that does not read.
MAX_REPLY = 4000
BACKLOG = 1024  # many concurrent starts queue here instead of falling back to a Python start-up each
DEFAULT_SOCKET = "/run/gpuprov/runtime-editor.sock"
# A GPU edit costs ~1.3 ms of CPU here, the heaviest honest one (the first container of an image with a 100 MB CUDA
# compat libcuda: read, sha256, copy) ~120 ms, ~350 ms without SHA instructions: past 0.5 s of CPU a request is an
# image's doing (CPU time: a busy host does not hand off an ordinary request, whose warm state would go with it). The
# wall-time bound catches a request that waits instead, inside the front-end's REPLY_TIMEOUT_S (3 s), after which
# every start queued behind it would edit directly.
HAND_OFF_CPU_S = 0.5
HAND_OFF_WALL_S = 2.0
# Each hand-off runs the next server inside the signal handler, over the frames of the request it left (they must
# not unwind: their cleanups would undo files the finishing process still writes); past this depth the editor
# retires instead, and the next cold start leaves a fresh one.
MAX_HAND_OFFS = 8


def socket_path() -> str:
    # Mirrors shim.c: tests that point GPUPROV_RUNTIME_CONFIG elsewhere get their own server.
    cfg = os.environ.get("GPUPROV_RUNTIME_CONFIG")
    return f"{cfg}.sock" if cfg else DEFAULT_SOCKET


def lock_path(sock: str) -> str:
    return f"{sock}.lock"


def _code_stamp() -> float:
    """The newest mtime among the files the editor runs (inject/sources.py): a change means gpuprov was upgraded."""
    # only the forked server needs it, not the cold create that leaves the server behind
    from provision.inject.sources import source_files  # lazy: 0.4 ms (-X importtime -I -S, min of 15)

    return max(p.stat().st_mtime for p in source_files())


# The editor's root: PREFIX/lib/gpuprov-runtime/<digest> for an editor copy, else the package's parent directory.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _in_copy() -> bool:
    """Whether this editor runs from an editor copy (inject/install.py: install_editor; `current` beside it)."""
    return os.path.islink(os.path.join(os.path.dirname(_ROOT), "current"))


def _upgrade_stamp() -> float | None:
    """What run() compares after each request to notice an upgrade: _code_stamp() (one stat per source file, ~90 us
    here, paid before the next request of a burst is accepted) for an editor run from the package itself; None for
    an editor copy, whose files never change (its directory is named by their hash: an upgrade is a new copy, which
    `current` then names, and _copy_replaced, one readlink before each request, sees that)."""
    return None if _in_copy() else _code_stamp()


def _copy_replaced() -> bool:
    """Whether this editor runs from an editor copy that `current` no longer names (gpuprov was upgraded). The copy
    is PREFIX/lib/gpuprov-runtime/<digest>/provision/inject/server.py; run from the package itself: never."""
    try:
        return os.readlink(os.path.join(os.path.dirname(_ROOT), "current")) != os.path.basename(_ROOT)
    except OSError:
        return False


def _private_dir(path: str) -> bool:
    """The socket's directory must be ours and writable by nobody else (created 0755: /run/gpuprov also holds the
    MPS pipe directory, which a non-root MPS daemon must be able to reach)."""
    d = os.path.dirname(path) or "."
    try:
        make_dirs(d, 0o755)
        st = os.stat(d)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def take_lock(sock: str) -> int | None:
    """The one-editor lock: an fd holding an exclusive flock (with our pid written in), or None when another editor
    has it. The fd is inherited across fork, so taking it before detaching leaves no window."""
    try:
        fd = os.open(lock_path(sock), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _write_pid(fd: int) -> None:
    """`PID START COMM`: who holds the lock, with its start time (clock ticks after boot) and name, so that whoever
    signals it (uninstall) can tell this editor from a later process that got the same pid (share/state.py's
    proc_identity reads the same two fields)."""
    # only the forked server writes it; the editor has loaded dataclasses already
    from provision.share.state import proc_identity  # lazy: 2 ms (-X importtime -I -S)

    ident = proc_identity(os.getpid())
    os.ftruncate(fd, 0)
    os.pwrite(fd, (f"{os.getpid()} {ident[1]} {ident[0]}" if ident else str(os.getpid())).encode() + b"\n", 0)


def handle(data: bytes) -> str:
    """One request line -> one reply line. Never raises: whatever goes wrong becomes a one-line refusal (rc 1)."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return "1\tgpuprov-runtime: refused a request to the GPU editor: not UTF-8\n"
    parts = text.rstrip("\n").split("\t")
    if len(parts) != 3 or not parts[0].startswith("/") or "\0" in text or "\n" in text.rstrip("\n"):
        return "1\tgpuprov-runtime: refused a malformed request to the GPU editor\n"
    lines: list[str] = []  # what the front-end prints on its stderr: the refusal, warnings that had no log file
    try:
        rc = run_create_edits(parts[0], parts[1] or None, parts[2] or None, lines.append)
    except Exception as exc:  # noqa: BLE001 - the server outlives any request (run_create_edits reports its own)
        rc, lines = 1, [f"gpuprov-runtime: the GPU editor failed on this request: {type(exc).__name__}: {exc}"]
    msg = " ".join(" ".join(lines).split())  # one line, whatever the messages held
    room = MAX_REPLY - 5  # the rc (at most 3 digits), its tab and the newline
    if len(msg) > room // 4 and len(msg.encode()) > room:  # a refusal quoting a huge env value (4 bytes a char at most)
        msg = msg.encode()[:room - 3].decode(errors="ignore") + "..."
    return f"{rc}\t{msg}\n"


OVERSIZED = b"1\tgpuprov-runtime: refused an oversized request to the GPU editor\n"


def _read_some(fd: int, ready: select.poll, deadline: float, size: int = 8192) -> bytes:
    """Up to `size` bytes from `fd` once it is readable (`ready`: a poll object holding it; poll, not select, which
    refuses a descriptor past 1023), which it must be by `deadline` (time.monotonic): b"" when the client hung up,
    TimeoutError when it said nothing in time. A readable stream socket's read returns at once."""
    left = deadline - time.monotonic()
    if left <= 0 or not ready.poll(left * 1000):
        raise TimeoutError("the client sent nothing")
    return os.read(fd, size)


# Each connection is a bare descriptor (the listening socket's _accept, os.read, os.write), not a socket object with
# Python's timeouts, which cost a poll before every call and an object per connection. Between real starts (seconds
# apart) this code runs cold: an exchange with an editor that answers at once cost 0.239 ms before and 0.184 ms so
# (bench/exchange_bench.py, this 2-core machine, 20 ms between starts, n=400; a C echo server: 0.081 ms).
def _serve_one(fd: int, answer=handle) -> None:
    """One request on the accepted descriptor `fd` (the caller closes it), one line back."""
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    ready = select.poll()
    ready.register(fd, select.POLLIN)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = _read_some(fd, ready, deadline)
            if not chunk:
                return  # hung up before asking: nothing to answer
            data += chunk
            if len(data) > MAX_REQUEST:
                os.write(fd, OVERSIZED)
                conn = socket.socket(fileno=fd)  # this rare path only: the end of our side, so the refusal is whole
                try:
                    conn.shutdown(socket.SHUT_WR)
                finally:
                    conn.detach()  # the caller closes fd
                for _ in range(64):  # drain a little, so the client reads the refusal instead of a reset
                    if not _read_some(fd, ready, deadline, 65536):
                        break
                return
        # One line of at most MAX_REPLY bytes into a socket that holds nothing of ours yet: it fits at once.
        os.write(fd, answer(data).encode())
    except OSError:
        return  # timed out, or hung up before reading the answer: the next client is served as usual


def serve(path: str, lock_fd: int | None = None) -> int:
    """Serve until idle. Returns 0 after serving, 1 when another editor holds the lock or the directory is unsafe."""
    if not _private_dir(path):
        return 1
    if lock_fd is None:
        lock_fd = take_lock(path)
        if lock_fd is None:
            return 1
    _write_pid(lock_fd)
    stamp = _upgrade_stamp()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    old = os.umask(0o077)  # the socket is root's alone: only the engine's runtime may ask for edits
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        srv.bind(tmp)
        os.chmod(tmp, 0o600)  # connecting needs write permission only; nobody else gets any
        st = os.stat(tmp)  # the socket file's own inode (fstat of the socket gives the socket's, never equal)
    finally:
        os.umask(old)
    srv.listen(BACKLOG)
    os.replace(tmp, path)  # atomic: clients never see a half-made socket; a stale or foreign one is replaced
    # accept waits POLL_S at most, in the kernel (EAGAIN: BlockingIOError), then run() looks for idleness or an upgrade
    try:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(POLL_S), int(POLL_S % 1 * 1e6)))
    except OSError:  # a timeval that is not two longs (a 32-bit build with a 64-bit time_t): Python's timeout
        srv.settimeout(POLL_S)
    server = _Server(srv, path, (st.st_dev, st.st_ino), lock_fd, stamp)
    try:
        signal.signal(signal.SIGPROF, server.hand_off)
        signal.signal(signal.SIGALRM, server.hand_off)
    except ValueError:  # not the main thread (only a test does that): requests are served in turn, never handed off
        server.timers = False
    server.run()
    return 0


def _arm(cpu_s: float, wall_s: float) -> None:
    signal.setitimer(signal.ITIMER_PROF, cpu_s)  # the process's CPU time, user and system
    signal.setitimer(signal.ITIMER_REAL, wall_s)


class _Server:
    """The accept loop, and the hand-off of a slow request. The request is never unwound: its cleanups (a temporary
    file removed, a write undone) would race the process that still completes it. The signal handler forks; the parent
    returns into the request, answers it and exits; the child never returns: it drops its copy of that connection and
    serves on from the handler's frame, with every cache the parent had."""

    def __init__(self, srv: socket.socket, path: str, ident: tuple[int, int], lock_fd: int,
                 stamp: float | None):
        self.srv, self.path, self.ident, self.lock_fd, self.stamp = srv, path, ident, lock_fd, stamp
        self.conn: int | None = None  # the connection (a descriptor) whose request is being edited
        self.handed_off = False  # this process only finishes its request now
        self.depth = 0  # hand-offs this process is nested in
        self.timers = True

    def run(self) -> None:
        idle = 0.0
        while True:
            try:
                conn, _ = self.srv._accept()  # a bare descriptor (see _serve_one): what socket.accept wraps
            except (BlockingIOError, TimeoutError):  # POLL_S without a client
                idle += POLL_S
                if idle >= IDLE_SECONDS or _copy_replaced():
                    break
                continue
            except OSError:
                continue
            idle = 0.0
            try:
                if _copy_replaced():
                    break  # unanswered: the front-end edits directly, with the new copy
                _serve_one(conn, lambda data, conn=conn: self.edit(conn, data))
            finally:
                os.close(conn)
            if self.handed_off:
                return  # let go of in hand_off: another process serves the socket, or nobody (retired)
            if self.stamp is not None and _code_stamp() != self.stamp:
                break  # upgraded on disk: let the next container start a fresh server
        self._unlink()
        self.srv.close()
        os.close(self.lock_fd)  # last: a newcomer may take over only once our socket is gone

    def edit(self, conn: int, data: bytes) -> str:
        """handle(), with the hand-off timers armed from its start (left running after it: see below)."""
        if not self.timers:
            return handle(data)
        # Armed before the request is named, and never disarmed after it (two system calls per start): a timer the
        # request before left running fires into hand_off as a no-op while self.conn is None.
        _arm(HAND_OFF_CPU_S, HAND_OFF_WALL_S)
        self.conn = conn
        try:
            return handle(data)
        finally:
            self.conn = None

    def hand_off(self, signum: int, frame: object) -> None:
        if self.conn is None or self.handed_off:
            return  # a timer that fired as the request ended, or the other one after a hand-off
        _arm(0, 0)
        self.handed_off = True
        pid = -1
        if self.depth < MAX_HAND_OFFS:
            try:
                # Forked, not through provision.effects: the child is this process, warm caches and the lock with it;
                # a fresh editor would cost a Python start-up (~45 ms) while the queued starts wait. Timers disarmed.
                pid = os.fork()
            except OSError:
                pid = -1
        if pid == 0:
            self._serve_on()
        if pid < 0:
            # Retired (too deep, or no fork): nobody serves on. The queued front-ends are reset and new ones find no
            # socket: they edit directly, and the first of them leaves a fresh editor behind.
            self._unlink()
        self.srv.close()
        os.close(self.lock_fd)  # the child's copy holds the lock on (flock: one lock per open file, shared by both)

    def _serve_on(self) -> None:
        """In the child: never returns (returning would go on with the request the parent answers)."""
        try:
            os.close(self.conn)
            self.conn, self.handed_off, self.depth = None, False, self.depth + 1
            _write_pid(self.lock_fd)  # whoever stops the editor (uninstall, tests) finds this process
            self.run()
        finally:
            os._exit(0)

    def _unlink(self) -> None:
        """Our socket file, not one a newer editor put there (it cannot: it takes the lock first, we still hold it)."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self.ident:
                os.unlink(self.path)
        except OSError:
            pass


def spawn_detached() -> None:
    """Leave a server behind: take the lock first (losers stop here, no fork at all), then double-fork a server with
    no terminal, stdio on /dev/null and the environment we were given (minimal), holding the inherited lock."""
    path = socket_path()
    if not _private_dir(path):
        return
    lock_fd = take_lock(path)
    if lock_fd is None:
        return
    # Forked, not started through provision.effects: the server is this very process's code, already imported, and it
    # inherits the lock it must hold; a new interpreter would cost a Python start-up (~20 ms) and import subprocess
    # (12-13 ms, -X importtime) on the cold create path that leaves the server behind.
    if os.fork() != 0:
        os.close(lock_fd)  # the grandchild holds the lock now
        return
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(path, lock_fd)
    finally:
        os._exit(0)


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1] if len(sys.argv) > 1 else socket_path()))

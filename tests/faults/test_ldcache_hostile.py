"""Issue 38 item 3: a hostile ld.so.cache is bounded (session 13).

The runtime reads the image's /etc/ld.so.cache on every GPU start (provision/inject/ldcache.py, from
modify.override_image_cache), in the warm editor that serves every tenant's start in turn. The image writes that
file. Each case below failed on main before this change (488315c):
1. a cache without NULs, full of driver-name markers, was scanned in quadratic time (here 0.4 MB: 0.6-0.9 s, 2 MB:
   16-26 s), and so was one whose entries all name one long string (0.4 MB: 1.8-5 s; 2 MB: over 30 s);
2. a cache naming ~30 000 driver files was taken whole (a lookup inside the image for each: 1 s a start);
3. a cache up to 16 MiB was read and scanned, and one past that silently ignored: now one past MAX_CACHE refuses
   the start in one line (exit 10), through the compiled front-end and its warm editor as an engine runs them;
4. while one image's start was slow (made so by its cache and links of its own), every other tenant's start through
   the warm editor waited for it, up to the front-end's 3 s fallback. Now the editor hands a slow request off
   (server.py); test_slow_requests_are_handed_off_until_the_editor_retires drives that loop to its depth bound.
An honest cache, written by the real ldconfig, still gets its override (the guard: passes before and after)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import ldcache
from tests.conftest import REPO, needs
from tests.inject_helpers import (
    compiled_front_end,
    edited,
    editor_pid,
    editors_for,
    fake_runc,
    gpu_bundle,
    runc_calls,
    stop_editors,
    write_settings,
)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, socket ownership)")
REFUSED = 10  # the README's exit code for a refused GPU start
REPLY_TIMEOUT_S = 3  # shim.c's: how long a front-end waits for the warm editor before it edits directly
LIBDIR = "/usr/lib/x86_64-linux-gnu"  # gpu_bundle's image is Debian-like
# The bounds, spelled out here (as tests/faults/conftest.py spells out exit codes) so that these tests run against an
# older gpuprov too, and fail there for what it does, not for a name it lacks.
MAX_CACHE = 1 << 20  # MAX_CACHE
MAX_DRIVER_ENTRIES = 512  # MAX_DRIVER_ENTRIES
MAX_HAND_OFFS = 8  # server.MAX_HAND_OFFS
NAME_MAX, PATH_MAX = 255, 4096
HEADER, ENTRY = 48, 24


# --- caches as an image can write them ---

def cache(pairs: list[tuple[int, int]], strings: bytes, flags: int = 0x0303) -> bytes:
    """A new-format cache: one entry per (key, value), each an offset into `strings`, which follows the entries."""
    at = HEADER + len(pairs) * ENTRY
    head = ldcache.MAGIC + struct.pack("<III", len(pairs), len(strings), 0) + bytes(16)
    return head + b"".join(struct.pack("<iIIIQ", flags, at + k, at + v, 0, 0) for k, v in pairs) + strings


def fill(pattern: bytes, size: int) -> bytes:
    return (pattern * (size // len(pattern) + 1))[:size]


def n_for(size: int, per_entry: int) -> int:
    return (size - HEADER) // (ENTRY + per_entry)


def one_long_string(size: int, ended: bool) -> bytes:
    """Every entry's key and value: the same string of markers, running to the end (or ended by the last byte)."""
    n = n_for(size, 24)
    tail = size - HEADER - n * ENTRY
    return cache([(0, 0)] * n, fill(b"/libcuda.so.1", tail - ended) + b"\0" * ended)


def each_its_own_place(size: int) -> bytes:
    """Every entry names its own offset of one long string of markers (ended): nlibs different strings, each long."""
    n = n_for(size, 24)
    tail = size - HEADER - n * ENTRY
    return cache([(i % (tail - 1), (7 * i) % (tail - 1)) for i in range(n)], fill(b"/libnvidia-ml.so.1", tail - 1)
                 + b"\0")


def driver_keys_long_values(size: int) -> bytes:
    """Every entry a driver SONAME, its path a different place in one long string (longer than any path)."""
    n = n_for(size, 24)
    key = b"libcuda.so.1\0"
    tail = size - HEADER - n * ENTRY - len(key)
    return cache([(0, len(key) + i % (tail - 1)) for i in range(n)], key + fill(b"/opt/libcuda", tail - 1) + b"\0")


def driver_files(count: int, size: int | None = None) -> bytes:
    """`count` different files for libcuda.so.1 (one shared key string); up to `size` bytes with repeats."""
    key, paths = b"libcuda.so.1\0", [b"/o/%06d/libcuda.so.1\0" % i for i in range(count)]
    n = count if size is None else n_for(size - len(key) - sum(map(len, paths)), 0)
    offsets, at = [], len(key)
    for p in paths:
        offsets.append(at)
        at += len(p)
    return cache([(0, offsets[i % count]) for i in range(n)], key + b"".join(paths))


def within(limit: float, fn, *args):
    """(seconds, result) of fn(*args); fails (instead of hanging the suite) once it runs past `limit`."""
    class Late(Exception):
        pass

    def late(signum, frame):
        raise Late

    old = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, limit)
    t = time.perf_counter()
    try:
        result = fn(*args)
    except Late:
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {limit} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return time.perf_counter() - t, result


def growth(fn, small: bytes, large: bytes, runs: int = 9) -> tuple[float, float]:
    """The best CPU time of each (a busy machine preempts the longer run more often, in wall time), measured in turn:
    linear work on 4x the bytes costs about 4x (5x for the entry shapes here, whose working set outgrows the CPU's
    caches), quadratic 16x."""
    def cpu(data: bytes) -> float:
        t = time.thread_time()
        within(10, fn, data)
        return time.thread_time() - t

    a, b = [], []
    for _ in range(runs):
        a.append(cpu(small))
        b.append(cpu(large))
    return min(a), min(b)


def at_start(tmp_path: Path, data: bytes, name: str = "ld.so.cache") -> str:
    """The image as the start reads it: a rootfs with that cache (driver_entries remembers files by identity, so
    each is new)."""
    p = tmp_path / name / "etc/ld.so.cache"
    p.parent.mkdir(parents=True)
    p.write_bytes(data)
    return str(tmp_path / name)


# --- 1. linear work ---

@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
@pytest.mark.parametrize("pattern", [b"libcuda", b"/libnv_nvidia"], ids=["markers", "markers-and-slashes"])
def test_a_cache_of_markers_without_nuls_is_scanned_in_linear_time(tmp_path, pattern):
    secs, got = within(5, ldcache.driver_entries, at_start(tmp_path, fill(pattern, 400_000)))
    assert got == [] and secs < 1.0, f"0.4 MB took {secs:.2f} s"
    secs, got = within(5, ldcache._driver_entries, fill(pattern, 2_000_000))  # the scan itself, past the cap too
    assert got == [] and secs < 1.0, f"2 MB took {secs:.2f} s"
    small, large = growth(ldcache._driver_entries, fill(pattern, 2_000_000), fill(pattern, 8_000_000))
    assert large < 10 * small, f"4x the bytes cost {large / small:.1f}x the time ({small * 1e3:.2f} ms, " \
                               f"{large * 1e3:.2f} ms): not linear"


SHAPES = {
    "one-string-to-the-end": lambda size: one_long_string(size, ended=False),
    "one-string-ended": lambda size: one_long_string(size, ended=True),
    "each-its-own-place": each_its_own_place,
    "driver-keys-long-values": driver_keys_long_values,
}


@pytest.mark.alone
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_entries_naming_one_long_string_cost_linear_time(tmp_path, shape):
    data = SHAPES[shape](1_000_000)  # just under the cap: what the start reads
    assert len(data) <= MAX_CACHE
    secs, got = within(5, ldcache.driver_entries, at_start(tmp_path, data))
    assert secs < 1.0, f"{len(data)} bytes took {secs:.2f} s"
    secs, every = within(5, ldcache.entries, data)
    assert secs < 1.0, f"entries() took {secs:.2f} s"
    # what is taken is a name at most: a SONAME is a file name, a path at most PATH_MAX
    assert all(len(k) <= NAME_MAX and "/" not in k and len(v) <= PATH_MAX for k, v in got), got[:3]
    assert all(len(k) <= NAME_MAX and len(v) <= PATH_MAX for k, v in every)
    small, large = growth(ldcache._driver_entries, SHAPES[shape](250_000), data)
    assert large < 10 * small, f"4x the bytes cost {large / small:.1f}x the time ({small * 1e3:.2f} ms, " \
                               f"{large * 1e3:.2f} ms): not linear"


# --- 2. what a cache may name ---

@pytest.mark.alone
def test_a_cache_naming_more_driver_files_than_any_image_is_refused(tmp_path):
    data = driver_files(MAX_DRIVER_ENTRIES + 1, size=1_000_000)  # ~30 000 entries, each a driver file
    secs, _ = within(5, lambda: pytest.raises(Refused, ldcache.driver_entries, at_start(tmp_path, data)))
    assert secs < 1.0, f"refusing took {secs:.2f} s"
    with pytest.raises(Refused) as exc:
        ldcache._driver_entries(driver_files(MAX_DRIVER_ENTRIES + 1))
    msg = str(exc.value)
    assert "\n" not in msg and f"{MAX_DRIVER_ENTRIES + 1} files" in msg and "ldconfig" in msg, msg
    # up to the bound, each file once however often the cache repeats it
    got = ldcache.driver_entries(at_start(tmp_path, driver_files(MAX_DRIVER_ENTRIES, size=500_000), "c2"))
    assert len(got) == MAX_DRIVER_ENTRIES and len(set(got)) == len(got)


# --- the real runtime path: compiled front-end, its warm editor, a recording runc ---

@pytest.fixture(scope="module")
def front(tmp_path_factory):
    base = tmp_path_factory.mktemp("front")
    return compiled_front_end(base, str(fake_runc(base))), base


class Runtime:
    """gpuprov-runtime with its own runtime.json (so its own warm editor), called as an engine calls it."""

    def __init__(self, front, base: Path):
        self.exe, self.runc_base = front
        self.base = base
        self.settings = write_settings(base, runc=str(self.runc_base / "fake-runc"))
        self.env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GPUPROV_RUNTIME_CONFIG": str(self.settings)}
        self.n = 0

    def argv(self, bundle: Path) -> list[str]:
        self.n += 1
        return [str(self.exe), "--root", "/run/x", "--log", str(self.base / f"log{self.n}.json"), "--log-format",
                "json", "create", "--bundle", str(bundle), f"id{self.n}"]

    def create(self, bundle: Path) -> tuple[subprocess.CompletedProcess, list[dict], float]:
        """(the front-end's result, the runtime's log lines, seconds)."""
        calls = len(runc_calls(self.runc_base))
        argv = self.argv(bundle)
        t = time.monotonic()
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=120)
        secs = time.monotonic() - t
        assert (len(runc_calls(self.runc_base)) > calls) == (r.returncode == 0), (r.returncode, r.stderr)
        log = Path(argv[4])
        return r, [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else [], secs

    def warm(self) -> int:
        r, _, _ = self.create(gpu_bundle(self.base, f"warmup{self.n}"))
        assert r.returncode == 0, r.stderr
        for _ in range(100):
            pid = editor_pid(self.settings)
            if pid and Path(f"{self.settings}.sock").exists():
                return pid
            time.sleep(0.05)
        raise AssertionError("no warm editor was left behind")


@pytest.fixture
def runtime(front, tmp_path):
    made = []

    def make(name: str = "rt") -> Runtime:
        base = tmp_path / name
        base.mkdir()
        rt = Runtime(front, base)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        stop_editors(rt.settings)


def image_with_cache(base: Path, name: str, data: bytes) -> Path:
    b = gpu_bundle(base, name)
    (b / "rootfs/etc/ld.so.cache").write_bytes(data)
    return b


def mounts_at(bundle: Path, dest: str) -> list[dict]:
    return [m for m in json.loads((bundle / "config.json").read_text())["mounts"] if m["destination"] == dest]


# --- 3. the cap, refused in one line ---

@root_only
@pytest.mark.parametrize("editor", ["cold", "warm"])
def test_a_cache_past_the_cap_refuses_the_start_in_one_line(runtime, editor):
    rt = runtime(editor)
    if editor == "warm":
        rt.warm()
    honest = cache([(0, 13)], b"libcuda.so.1\0/opt/v/libcuda.so.1\0")
    over = honest + bytes(MAX_CACHE + 1 - len(honest))  # a valid cache, padded one byte past the cap
    b = image_with_cache(rt.base, "over", over)
    r, log, _ = rt.create(b)
    assert r.returncode == REFUSED, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{MAX_CACHE + 1} bytes" in lines[0] and str(MAX_CACHE) in lines[0], lines[0]
    assert "/etc/ld.so.cache" in lines[0] and "ldconfig" in lines[0], lines[0]  # which file, and what to do
    assert log and log[-1]["level"] == "error" and log[-1]["msg"] in lines[0], log
    assert not edited(b), "a refused start's config is left as it was"
    # at the cap exactly, the same cache is read and its override made
    at_cap = image_with_cache(rt.base, "at-cap", honest + bytes(MAX_CACHE - len(honest)))
    (at_cap / "rootfs/opt/v").mkdir(parents=True)
    (at_cap / "rootfs/opt/v/libcuda.so.1").write_bytes(b"image's own")
    r, _, _ = rt.create(at_cap)
    assert r.returncode == 0 and edited(at_cap), r.stderr
    assert mounts_at(at_cap, "/opt/v/libcuda.so.1"), "the cache at the cap still gets its override"


# --- 4. an honest cache, written by ldconfig ---

@root_only
@needs("gcc", "ldconfig")
def test_an_honest_cache_still_gets_its_override(runtime, tmp_path):
    """The image's own libcuda.so.1 (an ELF with that SONAME) in /opt/vendor/lib, registered by the real ldconfig:
    the host's library is mounted over it, on the cold start, the warm one and a repeat (the remembered answer)."""
    rt = runtime()
    src = tmp_path / "l.c"
    src.write_text('const char *gpuprov_whose(void) { return "image"; }\n')
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)], check=True)
    template = gpu_bundle(tmp_path, "template")
    (template / "rootfs/opt/vendor/lib").mkdir(parents=True)
    shutil.copy(lib, template / "rootfs/opt/vendor/lib/libcuda.so.1")
    (template / "rootfs/etc/ld.so.conf").write_text("/opt/vendor/lib\n")
    subprocess.run(["ldconfig", "-r", str(template / "rootfs"), "-X"], check=True)
    data = (template / "rootfs/etc/ld.so.cache").read_bytes()
    assert ("libcuda.so.1", "/opt/vendor/lib/libcuda.so.1") in ldcache.entries(data)
    for i in range(3):  # cold (the editor run directly), warm, warm again with the same cache file
        b = rt.base / f"honest{i}"
        shutil.copytree(template, b, symlinks=True)
        if i == 2:
            os.unlink(b / "rootfs/etc/ld.so.cache")
            os.link(rt.base / "honest1/rootfs/etc/ld.so.cache", b / "rootfs/etc/ld.so.cache")  # one layer's file
        r, _, _ = rt.create(b)
        assert r.returncode == 0 and edited(b), r.stderr
        ours = mounts_at(b, f"{LIBDIR}/libcuda.so.1")
        over = mounts_at(b, "/opt/vendor/lib/libcuda.so.1")
        assert ours and over and over[0]["source"] == ours[0]["source"] and "ro" in over[0]["options"], over


# --- 5. one tenant's slow start never holds another's ---

def slow_image(base: Path, name: str) -> Path:
    """The slowest start an image can force through its cache: MAX_DRIVER_ENTRIES files for libcuda.so.1, each under
    /l0, a chain of links whose targets walk `a/..` (each walked with an lstat, inside the image) just under
    modify.MAX_STEPS per lookup. Before that bound, 40 links of 800 `a/..` each made such a start take 236 s."""
    from provision.inject.modify import MAX_STEPS

    b = gpu_bundle(base, name)
    root = b / "rootfs"
    (root / "a").mkdir()
    reps = (MAX_STEPS - 10) // 4  # two links of `reps` x a/.. (2 steps each), and the path's own components
    walk = "/".join(["a/.."] * reps)
    os.symlink(f"{walk}/l1", root / "l0")
    os.symlink(f"{walk}/a", root / "l1")
    n = MAX_DRIVER_ENTRIES
    key, paths = b"libcuda.so.1\0", [b"/l0/d%05d/libcuda.so.1\0" % i for i in range(n)]
    offsets, at = [], len(key)
    for p in paths:
        offsets.append(at)
        at += len(p)
    (root / "etc/ld.so.cache").write_bytes(cache([(0, o) for o in offsets], key + b"".join(paths)))
    return b


@root_only
@pytest.mark.alone
def test_the_slowest_start_an_image_can_force_is_bounded_and_holds_no_one(runtime):
    """Another tenant's start, sent while the slowest start an image can force runs in the warm editor, is served by
    the editor (no fallback), and the slow one ends well inside the front-end's 3 s wait."""
    rt = runtime()
    rt.warm()
    slow = slow_image(rt.base, "slow")
    t = time.monotonic()
    hostile = subprocess.Popen(rt.argv(slow), env=rt.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.05)  # the slow start is in the editor now
    r, _, secs = rt.create(gpu_bundle(rt.base, "other"))
    _, err = hostile.communicate(timeout=120)
    slow_secs = time.monotonic() - t
    assert hostile.returncode == 0, err
    assert r.returncode == 0 and "did not answer" not in r.stderr, r.stderr  # served by the warm editor, no fallback
    assert slow_secs < 3, f"the slowest start an image can force took {slow_secs:.2f} s"
    for _ in range(50):  # one editor serves on
        if editors_for(rt.settings) == [editor_pid(rt.settings)]:
            break
        time.sleep(0.1)
    assert editors_for(rt.settings) == [editor_pid(rt.settings)], editors_for(rt.settings)
    b = gpu_bundle(rt.base, "after")
    r, _, _ = rt.create(b)
    assert r.returncode == 0 and edited(b) and "did not answer" not in r.stderr, r.stderr


# The warm editor's own loop, with its edit replaced (b"cpu" burns 0.3 s of CPU, b"wait" sleeps 0.6 s, anything else is
# answered at once, with the pid that answered) and its hand-off bounds lowered, so that many slow requests are quick.
SERVE = """
import os, sys, time
sys.path.insert(0, {repo!r})
from provision.inject import server

server.HAND_OFF_CPU_S, server.HAND_OFF_WALL_S = 0.05, 0.15


def handle(data):
    if data.startswith(b"cpu"):
        t = time.process_time()
        while time.process_time() - t < 0.3:
            pass
    elif data.startswith(b"wait"):
        time.sleep(0.6)
    return f"0\\t{{os.getpid()}}\\n"


server.handle = handle
raise SystemExit(server.serve({sock!r}))
"""


def send(sock: Path, what: bytes) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(20)
    c.connect(str(sock))
    c.sendall(what + b"\t\t\n")
    return c


def answer(c: socket.socket) -> int:
    """The pid that answered."""
    with c:
        out = b""
        while not out.endswith(b"\n"):
            chunk = c.recv(4096)
            assert chunk, f"no answer (got {out!r})"
            out += chunk
    rc, pid = out.decode().split("\t")
    assert rc == "0", out
    return int(pid)


@root_only
@pytest.mark.alone
def test_slow_requests_are_handed_off_until_the_editor_retires(tmp_path):
    """Each slow request (CPU, or waiting) is finished by the process that took it while a fork serves the next ones;
    past MAX_HAND_OFFS forks in a line the editor retires: its socket goes, the front-ends edit directly (and the
    first leaves a fresh editor), the lock is free for it at once, and the slow request is still answered."""
    import sys

    from provision.inject.server import take_lock

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = run / "editor.sock"
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(tmp_path / "runtime.json")}
    code = SERVE.format(repo=str(REPO), sock=str(sock))
    first = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    pids = {first.pid}
    try:
        for _ in range(300):
            if sock.exists():
                break
            time.sleep(0.05)
        serving = answer(send(sock, b"fast"))
        for i in range(MAX_HAND_OFFS):
            t = time.monotonic()
            slow = send(sock, b"cpu" if i % 2 else b"wait")
            fast_pid = answer(send(sock, b"fast"))
            fast = time.monotonic() - t
            slow_pid = answer(slow)
            took = time.monotonic() - t
            pids |= {fast_pid, slow_pid}
            assert slow_pid == serving and fast_pid != serving, (i, serving, slow_pid, fast_pid)
            assert fast < took / 2, f"hand-off {i}: the next request waited {fast:.2f} s behind one of {took:.2f} s"
            serving = fast_pid
        slow = send(sock, b"wait")  # one more: the editor retires instead of forking a ninth time
        for _ in range(100):
            if not sock.exists():
                break
            time.sleep(0.02)
        assert not sock.exists(), "the retiring editor's socket is gone"
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            send(sock, b"fast")  # a front-end then edits directly, at once
        lock = take_lock(str(sock))
        assert lock is not None, "the lock is free for a fresh editor while the slow request finishes"
        os.close(lock)
        assert answer(slow) == serving
    finally:
        for pid in pids | {first.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        first.wait(timeout=10)


def test_one_lookup_in_the_image_walks_a_bounded_number_of_steps(tmp_path, monkeypatch):
    """Each path the image names (an ld.so.cache target among up to 512) is resolved inside the rootfs; 40 links that
    each name a 4 kB path of components made one lookup walk ~80,000 lstat calls, and an image's cache of 512 such
    targets kept its start busy for 236 s. A lookup walks at most modify.MAX_STEPS components, then refuses."""
    from provision.errors import Refused
    from provision.inject import modify

    root = tmp_path / "rootfs"
    (root / "d").mkdir(parents=True)
    for i in range(40):  # l0 -> d/d/.../d/l1 -> ... -> l40 (each link 1361 components)
        os.symlink("/" + "d/" * 680 + "../" * 680 + f"l{i + 1}", root / f"l{i}")  # 3.4 kB, under PATH_MAX
    calls = []
    real = os.lstat
    monkeypatch.setattr(modify.os, "lstat", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    with pytest.raises(Refused, match="more than 256 steps"):
        modify.scoped_resolve(str(root), "/l0/libcuda.so.1")
    assert len(calls) <= modify.MAX_STEPS + 1, len(calls)
    assert modify.scoped_resolve(str(root), "/d/d/../d/libcuda.so.1") == "/d/d/libcuda.so.1"  # an honest path: as before

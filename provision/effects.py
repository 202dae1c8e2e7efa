"""Effects: commands and services. Few, small and boring; everything else is decided before we get here.

Every process gpuprov starts goes through this module (tests/faults/test_one_process_path.py holds that): each has a
timeout, and a command that cannot start, times out or (with check=True) fails is a StepFailed (exit 5) naming the
command and its output's tail, never a traceback. The runtime's hot path (inject/shim.py's exec of runc, the
editor's double fork in inject/server.py) is the one measured exception, commented where it happens."""
from __future__ import annotations

import difflib
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from provision.errors import StepFailed

# No command may hang gpuprov forever. The longest it runs take minutes (apt-get install with a DKMS build of the
# driver, a bundle's package download in a container of the target); probes pass their own seconds.
DEFAULT_TIMEOUT = 3600.0


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    output: str  # stdout then stderr, as a reader of the failure wants them
    stdout: str = ""
    stderr: str = ""


def _decode(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def failed(shown: str, returncode: int, output: str) -> StepFailed:
    """The one message for a command that failed: the command as printed, its exit code, its output's last lines."""
    tail = "\n".join(output.strip().splitlines()[-15:])
    return StepFailed(f"`{shown}` failed with exit code {returncode}:\n{tail}")


def _cannot_start(argv: list[str], exc: OSError) -> StepFailed:
    if isinstance(exc, FileNotFoundError):
        return StepFailed(f"command not found: {argv[0]} (needed for: {shlex.join(argv)})")
    return StepFailed(f"cannot run `{shlex.join(argv)}`: {exc.strerror or exc}")


class Watcher(Protocol):
    """Who sees a command's output while it runs (provision/progress.py: the run's log and the live tail)."""

    def started(self, shown: str) -> None: ...

    def line(self, text: str) -> None: ...  # called from reader threads: must be thread-safe

    def partial(self, text: str) -> None: ...  # the line being written, before its newline (as `line`)

    def ended(self, shown: str, returncode: int | None, seconds: float) -> None: ...


_watcher: Watcher | None = None


def watch(watcher: Watcher | None) -> Watcher | None:
    """Stream every command `run` starts from now on to `watcher` (None: capture only, as probes and detect do);
    the previous watcher. The output is captured all the same: callers see the same CommandResult."""
    global _watcher
    previous, _watcher = _watcher, watcher
    return previous


def run(argv: list[str], *, check: bool = True, env: dict | None = None, timeout: float | None = DEFAULT_TIMEOUT,
        input_text: str | bytes | None = None, private_stdout: bool = False, probe: bool = False) -> CommandResult:
    """Run argv, output captured. `input_text` as bytes feeds binary stdin (e.g. an image tar to `docker import`).
    Cannot start, or still running after `timeout` s (then killed): StepFailed, whatever `check` says.
    While a watcher is set (a plan being applied), each line of output reaches it as it comes; `private_stdout`:
    standard output is not shown to it (a secret written to a file of its own); `probe`: a question asked of the
    host (is the daemon up, is the package installed), not shown to it either (wait loops ask many times)."""
    argv = [str(a) for a in argv]
    if _watcher is not None and not probe:
        return _run_watched(_watcher, argv, check, env, timeout or DEFAULT_TIMEOUT, input_text, private_stdout)
    binary = isinstance(input_text, bytes)
    try:
        p = subprocess.run(argv, capture_output=True, env=env, timeout=timeout or DEFAULT_TIMEOUT, input=input_text,
                           stdin=None if input_text is not None else subprocess.DEVNULL,
                           **({} if binary else {"text": True, "errors": "replace"}))
    except OSError as exc:
        raise _cannot_start(argv, exc) from None
    except subprocess.TimeoutExpired:
        raise StepFailed(f"timed out after {timeout or DEFAULT_TIMEOUT:g} s: {shlex.join(argv)}") from None
    out, err = _decode(p.stdout), _decode(p.stderr)
    res = CommandResult(argv, p.returncode, out + err, out, err)
    if check and p.returncode != 0:
        raise failed(shlex.join(argv), p.returncode, res.output)
    return res


def _run_watched(watcher: Watcher, argv: list[str], check: bool, env: dict | None, timeout: float,
                 input_text: str | bytes | None, private_stdout: bool) -> CommandResult:
    """`run` with each output line passed to `watcher` as it comes (a reader thread per stream, so neither pipe
    fills while the other is read), the same result and the same failures."""
    shown, t0 = shlex.join(argv), time.monotonic()
    try:
        p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise _cannot_start(argv, exc) from None
    watcher.started(shown)
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def read(stream, key: str, show: bool) -> None:
        # read1, not readline: what the pipe holds now, so that a line still being written is seen at once (apt's
        # "Reading package lists...", DKMS's dots while it builds: seconds to minutes before their newline)
        pending, partial = b"", getattr(watcher, "partial", None)
        for raw in iter(lambda: stream.read1(1 << 16), b""):
            chunks[key].append(raw)
            if not show:
                continue
            *whole, pending = (pending + raw).split(b"\n")
            if len(pending) > 1 << 16:  # (a progress bar that never ends its line: shown as lines, bounded)
                whole, pending = [*whole, pending], b""
            for w in whole:
                watcher.line(w.decode(errors="replace").rstrip("\r"))
            if pending and partial:
                partial(pending.decode(errors="replace"))
        if show and pending:
            watcher.line(pending.decode(errors="replace").rstrip("\r"))
        stream.close()

    readers = [threading.Thread(target=read, args=(p.stdout, "out", not private_stdout), daemon=True),
               threading.Thread(target=read, args=(p.stderr, "err", True), daemon=True)]
    for t in readers:
        t.start()
    if input_text is not None:
        threading.Thread(target=_feed, args=(p.stdin, input_text), daemon=True).start()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        watcher.ended(shown, None, time.monotonic() - t0)
        raise StepFailed(f"timed out after {timeout:g} s: {shown}") from None
    for t in readers:  # (a daemon the command started may hold the pipes: as subprocess.run, wait for their end)
        t.join(max(1.0, timeout - (time.monotonic() - t0)))
    watcher.ended(shown, p.returncode, time.monotonic() - t0)
    out, err = (b"".join(chunks[k]).decode(errors="replace") for k in ("out", "err"))
    res = CommandResult(argv, p.returncode, out + err, out, err)
    if check and p.returncode != 0:
        raise failed(shown, p.returncode, res.output)
    return res


def _feed(stdin, data: str | bytes) -> None:
    try:
        stdin.write(data.encode() if isinstance(data, str) else data)
        stdin.close()
    except OSError:  # the command exited without reading it all: its exit status tells
        pass


def try_run(argv: list[str], *, timeout: float, env: dict | None = None, probe: bool = False) -> CommandResult | None:
    """A command whose failure is an answer: the result, or None when the command cannot start or does not finish
    within `timeout` s. `probe`: as run's."""
    try:
        return run(argv, check=False, env=env, timeout=timeout, probe=probe)
    except StepFailed:
        return None


def run_parallel(argvs: dict[str, list[str]], timeout: float) -> dict[str, CommandResult | None]:
    """Several probes at once (each engine binary takes tens of ms to start): name -> result (stderr folded into
    the output), or None for one that cannot start or is still running after `timeout` s (it is killed)."""
    procs: dict[str, subprocess.Popen | None] = {}
    for name, argv in argvs.items():
        try:
            procs[name] = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError:
            procs[name] = None
    deadline = time.monotonic() + timeout
    out: dict[str, CommandResult | None] = {}
    for name, p in procs.items():
        if p is None:
            out[name] = None
            continue
        try:
            # past the deadline, a probe that has finished still gets read (0.1 s), a hung one is killed
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out[name] = None
            continue
        out[name] = CommandResult(list(p.args), p.returncode, text or "", text or "")
    return out


class Started:
    """Commands started together (start_all), read under the one deadline they were started with."""

    def __init__(self, procs: dict[str, subprocess.Popen | None], deadline: float):
        self.procs, self.deadline = procs, deadline
        self.late: list[str] = []  # those still running at the deadline (results())

    def results(self) -> dict[str, CommandResult | None]:
        """name -> result, or None for one that could not start or was still running at the deadline (then also in
        `late`). A late one is killed, its whole session, and never waited for (as run_bounded: a query stuck in the
        kernel, D state, cannot be reaped and must not hold up the caller past the deadline)."""
        out: dict[str, CommandResult | None] = {}
        for name, p in self.procs.items():
            if p is None:
                out[name] = None
                continue
            try:  # past the deadline, one that has finished still gets read (0.1 s)
                text, err = p.communicate(timeout=max(0.1, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                for stream in (p.stdout, p.stderr):
                    stream.close()
                out[name] = None
                self.late.append(name)
                continue
            out[name] = CommandResult(list(p.args), p.returncode, text + err, text, err)
        return out


def start_all(argvs: dict[str, list[str]], timeout: float, env: dict | None = None) -> Started:
    """Start several commands now, each in its own session, without waiting: their answers come from .results(),
    all under one deadline `timeout` s from now, so that N questions to a wedged driver cost one deadline, not N."""
    procs: dict[str, subprocess.Popen | None] = {}
    deadline = time.monotonic() + timeout
    for name, argv in argvs.items():
        try:
            procs[name] = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, env=env, text=True, errors="replace",
                                           start_new_session=True, close_fds=True)
        except OSError:
            procs[name] = None
    return Started(procs, deadline)


def pipe(first: list[str], second: list[str], *, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
    """`first | second`, the bytes streamed between them (e.g. `tar -c` of a whole root into `docker import -`).
    Either one failing, not starting or outlasting `timeout` s is a StepFailed; the result is `second`'s."""
    first, second = [str(a) for a in first], [str(a) for a in second]
    shown = f"{shlex.join(first)} | {shlex.join(second)}"
    try:
        producer = subprocess.Popen(first, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise _cannot_start(first, exc) from None
    try:
        try:
            consumer = subprocess.Popen(second, stdin=producer.stdout, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        except OSError as exc:
            raise _cannot_start(second, exc) from None
        finally:
            producer.stdout.close()  # the consumer holds it now; the producer sees EPIPE if the consumer dies
        try:
            out, err = consumer.communicate(timeout=timeout)
            perr = producer.communicate(timeout=max(1.0, timeout))[1]
        except subprocess.TimeoutExpired:
            consumer.kill()
            consumer.communicate()
            raise StepFailed(f"timed out after {timeout:g} s: {shown}") from None
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    out, err = _decode(out), _decode(err)
    res = CommandResult(second, consumer.returncode, out + err, out, err)
    if producer.returncode != 0:
        raise failed(shlex.join(first), producer.returncode, _decode(perr))
    if consumer.returncode != 0:
        raise failed(shlex.join(second), consumer.returncode, res.output)
    return res


def spawn(argv: list[str], log: str | Path, env: dict | None = None) -> int:
    """A daemon that outlives gpuprov: its own session, stdin from /dev/null, output appended to `log`; its pid.
    Not waited for (the caller waits until the daemon answers, with its own timeout)."""
    argv = [str(a) for a in argv]
    try:
        with open(log, "ab") as fh:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, env=env,
                                 start_new_session=True)
    except OSError as exc:
        raise _cannot_start(argv, exc) from None
    return p.pid


def run_bounded(argv: list[str], timeout: float, env: dict | None = None) -> int | None:
    """A short command whose output nobody reads (`modprobe nvidia-uvm` on a container start): its exit status, or
    None when it did not finish within `timeout` (OSError when it cannot start). A late one is killed, its whole
    session, and never waited for: a modprobe stuck in the kernel (D state) cannot be reaped and must not hold up the
    caller, as subprocess.run's wait after its kill would."""
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=env, start_new_session=True, close_fds=True)
    try:
        return child.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass
        return None


def unified_diff(old: str, new: str, path: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (current)",
                                        f"{path} (gpuprov)"))


def has_systemd() -> bool:
    return Path("/run/systemd/system").is_dir()


def restart_unit(unit: str, check: bool = True) -> CommandResult:
    """`systemctl restart UNIT`, after `systemctl reset-failed UNIT`: gpuprov's own restarts in a row (bootstrap's
    engine config, then containerd's, then an uninstall: dockerd restarts with containerd) can pass a unit's start
    limit (docker.service: 3 starts in 60 s), and systemd then refuses the next start though nothing is wrong.
    reset-failed only clears that count and a failed state; a daemon that cannot start still fails the restart."""
    run(["systemctl", "reset-failed", unit], check=False)
    return run(["systemctl", "restart", unit], check=check)


def wait_for(pred, timeout: float = 30.0, interval: float = 0.3) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def daemon_answers(ready: tuple[str, ...]) -> bool:
    """Whether an engine's client command (its adapter's ready_argv: `docker info`, `ctr version`) succeeds now."""
    r = try_run(list(ready), timeout=10, probe=True)
    return r is not None and r.returncode == 0


def daemon_log(daemon: str) -> str:
    return f"/var/log/gpuprov-{daemon}.log"


def daemon_start_argvs(unit: str, daemon: str, systemd: bool) -> list[tuple[str, ...]]:
    """What starting an engine's daemon runs, in order: systemd's one command; else the SysV script, then the daemon
    itself in the background (the fallback). The plan prints these (plan/steps.StartService)."""
    if systemd:
        return [("systemctl", "enable", "--now", unit)]
    return [(f"/etc/init.d/{unit}", "start"), (daemon,)]


def start_daemon(unit: str, daemon: str, ready: tuple[str, ...], systemd: bool | None = None) -> str:
    """Start an engine's daemon (enabled at boot where systemd runs) and wait until its client answers; how it was
    started. Without systemd (containers, minimal hosts) the SysV script is always tried (a missing one is a failed
    one), and when it fails (a container that cannot raise its ulimits; Debian's containerd ships none) the daemon
    runs in the background, its output in daemon_log(). `ready`: the client command that answers once it is up."""
    systemd = has_systemd() if systemd is None else systemd
    answers = lambda: daemon_answers(ready)  # noqa: E731
    if systemd:
        (start,) = daemon_start_argvs(unit, daemon, True)
        run(list(start))
        how = shlex.join(start)
    else:
        init, bg = daemon_start_argvs(unit, daemon, False)
        r = try_run(list(init), timeout=120)
        if r is not None and r.returncode == 0 and wait_for(answers, 20):
            return shlex.join(init)
        spawn(list(bg), daemon_log(daemon))
        how = f"{shlex.join(bg)} (background; log {daemon_log(daemon)})"
    if not wait_for(answers, 60):
        raise StepFailed(f"{daemon} did not come up after `{how}`; see `journalctl -u {unit}` or the log named there")
    return how


def respawn(pid: int, argv: tuple[str, ...], daemon: str, ready) -> str:
    """Restart a daemon that no unit or init script runs (static binaries started with the operator's own flags,
    e.g. `dockerd --config-file /srv/docker.json`): stop it, start the same executable with the same arguments in
    the background (its output in daemon_log), wait until `ready()`."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        exe = argv[0]
    stop(pid, daemon)
    shown = shlex.join([exe, *argv[1:]])
    spawn([exe, *argv[1:]], daemon_log(daemon))
    if not wait_for(ready, 60):
        raise StepFailed(f"{daemon} did not come up after `{shown}`; see {daemon_log(daemon)}")
    return f"restarted {daemon} as it ran: {shown} (background; log {daemon_log(daemon)})"


def stop(pid: int, daemon: str) -> None:
    """SIGTERM to a daemon, then wait (60 s at most) until it is gone."""
    os.kill(pid, signal.SIGTERM)
    if not wait_for(lambda: not _alive(pid), 60):
        raise StepFailed(f"{daemon} (pid {pid}) did not stop within 60 s; restart it by hand")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def which(name: str) -> str | None:
    return shutil.which(name)

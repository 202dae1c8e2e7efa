"""What a person sees while a plan is applied, and the run's own log (the step runner's side of provision/effects.py).

One `Run` per host-changing run (bootstrap, uninstall, bundle install). While it is open, every command that
effects.run starts streams its output here, line by line:
- the run's log, `<log dir>/runs/<command>-<UTC time>-<pid>.log` (0600, never through a link), gets every command and
  all of its output, and each step's result; the newest KEEP logs of a command are kept (rotation), and the summary
  names the file;
- on a terminal, the step being applied shows a live tail of its command's output (its last TAIL lines, replaced in
  place, the line still being written included: apt's "Reading package lists...", DKMS's dots) and the seconds it
  has taken (rich's Live, loaded only here and only then: detect and the container-start path never load rich,
  tests/unit/test_imports.py and test_editor_start.py);
- piped (not a terminal) each step prints one line when it ends, and a heartbeat line while it runs (the step, its
  seconds so far, the last line of its output) whenever HEARTBEAT seconds passed with nothing printed: under ssh
  pipes or CI a 45 s apt step is never silent; with --json nothing; with -v/--verbose every command and every line
  of its output as it comes (and the heartbeat through a silence).
Each step ends in one line: `[3/7] Install the engine: installed docker.io 20.10.24+dfsg1-1+b3 and 9 dependencies;
nothing removed (31.2s)`, wrapped to WIDTH columns.

A closed pipe never aborts the run (`gpuprov bootstrap --yes 2>&1 | head -1`): the run's streams are guarded
(`guard_streams`), and a write that meets EPIPE points that descriptor at /dev/null and is dropped, so the run goes
on and ends as it would have, its log complete (tests/unit/test_progress.py closes a real pipe early)."""
from __future__ import annotations

import collections
import errno
import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

from provision import effects

KEEP = 20  # run logs kept per command
TAIL = 6  # lines of a command's output shown live
WIDTH = 100  # what the lines a person reads fit in (plans and step results wrap there)
REFRESH = 4  # live redraws a second
HEARTBEAT = 10.0  # seconds without a line printed, piped, before a heartbeat says the step is still at work


def wrap(text: str, indent: str = "      ", width: int = WIDTH) -> list[str]:
    """`text` in lines of at most `width` columns, continued under `indent`; a word longer than a line is kept whole
    (a path or a URL is never cut)."""
    return textwrap.wrap(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False) or [""]


# A shell word as Command.shell() writes it (shlex.join quotes with single quotes, and a quote inside as '"'"'):
# split there and nowhere else
SHELL_WORD = re.compile(r"""(?:'[^']*'|"[^"]*"|[^\s'"])+""")


def wrap_command(line: str, indent: str, width: int = WIDTH) -> list[str]:
    """A printed command (`$ apt-get install …`) in lines of at most `width` columns, broken only between shell
    words and continued with ` \\`, so that what is pasted is still the one command; a word longer than a line
    stays whole."""
    out, cur = [], ""
    for word in SHELL_WORD.findall(line):
        if cur and len(cur) + 1 + len(word) + 2 > width:
            out.append(cur + " \\")
            cur = indent + "    " + word
        else:
            cur = f"{cur} {word}" if cur else indent + word
    return out + [cur]


class SafeStream:
    """A text stream whose writes never raise EPIPE: once the reader is gone (`| head -1`), the descriptor is
    pointed at /dev/null and what follows is dropped (the interpreter's own flush at exit then succeeds too)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.broken = False

    def _closed(self, exc: OSError) -> None:
        if exc.errno != errno.EPIPE:
            raise exc
        self.broken = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._closed(exc)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._closed(exc)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_streams() -> None:
    """stdout and stderr as SafeStreams, for the rest of the process (a host-changing run must never stop at a print)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SafeStream):
            setattr(sys, name, SafeStream(stream))


class RunLog:
    """The run's log file: every command, all of its output, each step's result. A log that cannot be written (a
    full or read-only disk) never stops the run: it is then named as such in the summary."""

    def __init__(self, directory: Path | None, command: str) -> None:
        self.path: Path | None = None
        self._fh = None
        self._lock = threading.Lock()
        if directory is None:
            return
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            path = directory / f"{command}-{stamp}-{os.getpid()}.log"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._fh, self.path = os.fdopen(fd, "w", encoding="utf-8", errors="replace"), path
        except OSError:
            return
        # rotation: the newest KEEP of this command's logs stay (names sort by time)
        for old in sorted(directory.glob(f"{command}-*.log"))[:-KEEP]:
            try:
                old.unlink()
            except OSError:
                pass

    def write(self, line: str) -> None:
        if self._fh is None:
            return
        with self._lock:
            try:
                self._fh.write(line + "\n")
                self._fh.flush()
            except OSError:
                self._fh = None

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None


class Run:
    """One host-changing run: its log, what the screen shows (`mode`: live | plain | verbose | quiet; None: live on
    a terminal, plain otherwise), and the effects watcher that feeds both (effects.watch) while it is open."""

    def __init__(self, command: str, *, log_dir: Path | None = None, mode: str | None = None,
                 stream=None) -> None:
        self.command = command
        self._log_dir = log_dir
        self._stream = stream
        self._mode = mode
        self.log = RunLog(None, command)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        self._partial = ""  # the line being written, before its newline (effects' reader sees it at once)
        self._step: tuple[str, float] | None = None  # the header shown live, and when its step began
        self._live = None
        self._previous = None
        self._said = time.monotonic()  # when a line was last printed (the heartbeat counts from there)
        self._beat: threading.Event | None = None  # set to stop the running step's heartbeat
        self._say_lock = threading.Lock()  # the heartbeat's thread and the run's print whole lines

    # ------------------------------------------------------------ set-up

    @property
    def out(self):
        return self._stream or sys.stderr

    @property
    def mode(self) -> str:
        if self._mode is None:
            try:
                tty = self.out.isatty() and os.environ.get("TERM") != "dumb"
            except (AttributeError, ValueError):
                tty = False
            self._mode = "live" if tty else "plain"
        return self._mode

    def __enter__(self) -> Run:
        guard_streams()
        if self._stream is not None and not isinstance(self._stream, SafeStream):
            self._stream = SafeStream(self._stream)
        self.log = RunLog(self._log_dir, self.command)
        self._previous = effects.watch(self)
        return self

    def __exit__(self, *exc) -> None:
        effects.watch(self._previous)
        self._stop_live()
        self.log.close()

    # ------------------------------------------------------------ effects.Watcher

    def started(self, shown: str) -> None:
        self.log.write(f"$ {shown}")
        self._tail.clear()
        self._partial = ""
        self._tail.append(f"$ {shown}")
        if self.mode == "verbose":
            self._say(f"  $ {shown}")

    def line(self, text: str) -> None:
        self.log.write(f"  {text}")
        self._partial = ""
        if text.strip():
            self._tail.append(text)
        if self.mode == "verbose":
            self._say(f"    {text}")

    def partial(self, text: str) -> None:
        """The line a command is still writing: shown live and by the heartbeat, logged once whole (`line`). A
        progress meter's carriage returns: its last state."""
        self._partial = text.rsplit("\r", 1)[-1]

    def ended(self, shown: str, returncode: int | None, seconds: float) -> None:
        how = "timed out" if returncode is None else f"exit {returncode}"
        self.log.write(f"  ({how}, {seconds:.1f}s)")

    # ------------------------------------------------------------ steps

    def step_started(self, header: str) -> None:
        self.log.write(f"{_now()} {header}")
        self._tail.clear()
        self._partial = ""
        self._step = (header, time.monotonic())
        if self.mode == "verbose":
            self._say(header)
        elif self.mode == "live":
            self._start_live()
        if self.mode in ("plain", "verbose"):
            self._start_heartbeat()

    def step_ended(self, line: str, logged: str | None = None) -> None:
        """The step's one line: in the log (`logged`, when it says more) and, but with --json, on the screen."""
        self._stop_heartbeat()
        self._stop_live()
        self._step = None
        self.log.write(f"{_now()} {logged or line}")
        if self.mode != "quiet":
            self._say("\n".join(wrap(line)))

    def note(self, line: str) -> None:
        """A line for the log only."""
        self.log.write(line)

    def _say(self, text: str, unless: threading.Event | None = None) -> None:
        """Print a line (`unless`: not once that event is set, decided under the lock: a heartbeat never follows
        its step's last line)."""
        with self._say_lock:
            if unless is not None and unless.is_set():
                return
            self._said = time.monotonic()
            try:
                print(text, file=self.out, flush=True)
            except OSError:  # (a stream that is not a SafeStream, and whose reader is gone)
                pass

    def last_line(self) -> str:
        """The running command's last line of output: the one it is still writing, else its last whole one (its
        `$ command` line before it printed any)."""
        return self._partial.strip() or (self._tail[-1].strip() if self._tail else "")

    # ------------------------------------------------------------ the heartbeat (no terminal)

    def _start_heartbeat(self) -> None:
        self._beat = threading.Event()
        threading.Thread(target=self._heartbeat, args=(self._beat, self._step), daemon=True,
                         name="gpuprov-heartbeat").start()

    def _stop_heartbeat(self) -> None:
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.set()

    def _heartbeat(self, stop: threading.Event, step: tuple[str, float] | None) -> None:
        """While the step runs: a line whenever HEARTBEAT seconds passed with nothing printed (the step, its seconds
        so far, the last line of its output, cut to one screen line; the log has all of it)."""
        header, t0 = step or ("", time.monotonic())
        while not stop.wait(max(0.05, self._said + HEARTBEAT - time.monotonic())):
            if time.monotonic() - self._said < HEARTBEAT:
                continue  # (verbose: a line came meanwhile)
            text = f"{header}: running, {time.monotonic() - t0:.0f}s"
            last = self.last_line()
            if last:
                room = WIDTH - len(text) - len("; last: ")
                text += f"; last: {last if len(last) <= room else last[:max(room - 1, 20)] + '…'}"
            self._say(text, unless=stop)

    # ------------------------------------------------------------ the live tail (a terminal)

    def _start_live(self) -> None:
        from rich.console import Console  # lazy: 100-130 ms (-X importtime); only on a terminal, once a run
        from rich.live import Live  # lazy: 0.6 ms more than rich.console (-X importtime); only on a terminal

        console = Console(file=self.out, highlight=False, soft_wrap=False)
        self._live = Live(get_renderable=self._render, console=console, refresh_per_second=REFRESH, transient=True,
                          redirect_stdout=False, redirect_stderr=False)
        try:
            self._live.start()
        except OSError:
            self._live = None

    def _stop_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            try:
                live.stop()
            except OSError:
                pass

    def _render(self):
        from rich.text import Text  # lazy: loaded with rich.console already (0 ms here); only on a terminal

        header, t0 = self._step or ("", time.monotonic())
        text = Text(f"{header}  {time.monotonic() - t0:.0f}s", style="bold", no_wrap=True, overflow="ellipsis")
        for ln in self.tail():
            text.append("\n")
            text.append(Text(f"    {ln}", style="dim", no_wrap=True, overflow="ellipsis"))
        return text

    def tail(self) -> list[str]:
        """The lines shown live now: the last TAIL, the one still being written last."""
        partial = self._partial.strip()
        return (list(self._tail) + [partial])[-TAIL:] if partial else list(self._tail)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")

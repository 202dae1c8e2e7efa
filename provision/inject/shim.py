"""`gpuprov-runtime`: an OCI runtime with runc's command line. Only `create` edits config.json; every other
command is handed to runc at once (exec, same argv). Kept import-light: it runs on every container start.

The compiled front-end (shim.c, shipped in the wheel) does the same hand-over in C and calls the warm editor (or
`python3 -I -S …/modify_main.py`) only when config.json mentions a GPU request. This Python front-end is the fallback
where no compiled one runs; both parse runc's argv the same way (tests/unit/test_runtime_frontends.py)."""
from __future__ import annotations

import json
import os
import sys
import time

from provision.errors import EditFailed, Refused
from provision.inject.settings_file import SettingsInvalid, runc_program

TYPE_CHECKING = False  # not typing's (~3 ms to import): this module runs on every container start
if TYPE_CHECKING:
    from collections.abc import Callable

# runc parses options with Go's flag package: `-x` and `--x` are the same option, a value comes as `--x=v` or as the
# next word. Global options that take a value, and those of create/run (shim.c has the same tables).
GLOBAL_VALUE_OPTS = ("root", "log", "log-format", "criu", "rootless")
CREATE_VALUE_OPTS = ("bundle", "b", "console-socket", "pid-file", "preserve-fds")
# Strings whose presence in config.json means the editor must look (it decides precisely; this only filters).
TRIGGERS = ("NVIDIA_VISIBLE_DEVICES=", "nvidia-container-runtime-hook", "/var/run/nvidia-container-devices/",
            "GPUPROV_GPU_", "ALIYUN_COM_GPU_")


def needs_edit(bundle: str) -> bool:
    """shim.c's needs_edit(): an unreadable config.json is runc's to report."""
    try:
        with open(os.path.join(bundle, "config.json"), "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    return any(t.encode() in data for t in TRIGGERS)


class Invocation:
    """What the front-ends need from runc's argv (without argv[0]). A plain class, not a dataclass: importing
    dataclasses costs 13 ms (python -X importtime), paid by every GPU container start that runs the editor."""
    __slots__ = ("command", "bundle", "log", "log_format")

    def __init__(self, command: str | None, bundle: str = ".", log: str | None = None, log_format: str | None = None):
        self.command, self.bundle, self.log, self.log_format = command, bundle, log, log_format

    def __repr__(self) -> str:
        return f"Invocation({self.command!r}, {self.bundle!r}, {self.log!r}, {self.log_format!r})"


def _opt_name(a: str) -> str | None:
    if not a.startswith("-") or a == "-":
        return None
    return a[2:] if a.startswith("--") else a[1:]


def _match(name: str, table: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(option, inline value) when `name` spells an option of the table, else (None, None)."""
    opt, eq, value = name.partition("=")
    return (opt, value if eq else None) if opt in table else (None, None)


def parse_argv(argv: list[str]) -> Invocation:
    """Exactly shim.c's parse(): global options (with their values) up to the command, then create/run's options
    wherever they appear (runc reorders them), up to a `--`."""
    i, found = 0, {}
    cmd_index = None
    while i < len(argv):
        name = _opt_name(argv[i])
        if name is None:
            cmd_index = i
            break
        if name == "":  # `--` ends the options
            cmd_index = i + 1 if i + 1 < len(argv) else None
            break
        opt, val = _match(name, GLOBAL_VALUE_OPTS)
        if opt:
            if val is None:
                i += 1
                val = argv[i] if i < len(argv) else ""
            found[opt] = val
        i += 1
    if cmd_index is None:
        return Invocation(None)
    bundle = "."
    j = cmd_index + 1
    while j < len(argv):
        name = _opt_name(argv[j])
        if name == "":
            break
        opt, val = _match(name, CREATE_VALUE_OPTS) if name is not None else (None, None)
        if opt:
            if val is None:
                j += 1
                val = argv[j] if j < len(argv) else ""
            if opt in ("bundle", "b"):
                bundle = val
        j += 1
    return Invocation(argv[cmd_index], bundle, found.get("log") or None, found.get("log-format") or None)


def to_stderr(line: str) -> None:
    """A line on stderr, if there is one: a runtime started with it closed (None) or a stderr nobody reads any more
    still ends with its own exit code, and the log file has the line."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(line + "\n")
    except OSError:
        pass


def report_error(msg: str, log: str | None, log_format: str | None, emit: Callable[[str], None] = to_stderr) -> None:
    """Where the engine looks: runc's --log file (containerd shows its last error), written first, and stderr (`emit`:
    the warm editor sends the line back to the front-end, which prints it)."""
    _log(msg, log, log_format, "error")
    emit(f"gpuprov-runtime: {msg}")


def report_warning(msg: str, log: str | None, log_format: str | None, emit: Callable[[str], None] = to_stderr
                   ) -> None:
    """A warning goes to the runtime's log (runc's --log file, as runc's own warnings do); `emit` only without one."""
    if not log or not _log(f"warning: {msg}", log, log_format, "warning"):
        emit(f"gpuprov-runtime: warning: {msg}")


def _log(msg: str, log: str | None, log_format: str | None, level: str) -> bool:
    if not log:
        return False
    line = json.dumps({"level": level, "msg": f"gpuprov-runtime: {msg}",
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) \
        if log_format == "json" else f"gpuprov-runtime: {msg}"
    try:
        with open(log, "a") as fh:
            fh.write(line + "\n")
    except OSError:
        return False
    return True


def create_edits(bundle: str, warn: Callable[[str], None]) -> None:
    """Edit the bundle's config.json for its GPU request (modify.modify_bundle), under runtime.json's settings.
    Raises only Refused, SettingsInvalid (fail closed: no GPU container under a policy the file does not say) or
    EditFailed (anything else: an unreadable bundle, a config.json with wrong types), each with its exit_code."""
    # The Python front-end loads this module for every container start; only GPU creates edit (main's no-GPU path)
    from provision.inject.modify import modify_bundle  # lazy: 18 ms (-X importtime -I -S, min of 30) per no-GPU start
    from provision.inject.settings import load_settings  # lazy: 13.5 ms (its dataclasses, -X importtime), the same

    try:
        modify_bundle(bundle, load_settings(required=True), warn)
    except (Refused, SettingsInvalid):
        raise
    except (OSError, ValueError) as exc:  # unreadable bundle / config: say so in one line, don't start
        raise EditFailed(f"cannot prepare the GPU edits: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - e.g. a config.json with wrong types: one line, never a traceback
        raise EditFailed(f"cannot prepare the GPU edits: {type(exc).__name__}: {exc}") from None


def run_create_edits(bundle: str, log: str | None = None, log_format: str | None = None,
                     emit: Callable[[str], None] = to_stderr) -> int:
    """create_edits, reported where the engine looks (report_error, report_warning); returns the exit status."""
    try:
        create_edits(bundle, lambda msg: report_warning(msg, log, log_format, emit))
    except (Refused, SettingsInvalid, EditFailed) as exc:
        report_error(str(exc), log, log_format, emit)
        return exc.exit_code
    return 0


def main(runc: str | None = None) -> int:
    """`runc`: the low-level runtime this front-end hands over to (an engine's own front-end: Podman's wraps the OCI
    runtime Podman uses); None: runtime.json's `runc`."""
    argv = sys.argv[1:]
    inv = parse_argv(argv)
    if inv.command in ("create", "run") and needs_edit(inv.bundle):  # `run` = create + start
        rc = run_create_edits(os.path.abspath(inv.bundle), inv.log, inv.log_format)
        if rc:
            return rc

    try:
        runc = runc or runc_program()  # only `runc` is checked here; a GPU create above checked every key
    except SettingsInvalid as exc:
        report_error(str(exc), inv.log, inv.log_format)
        return exc.exit_code
    # Not through provision.effects, on purpose: runc must *become* this process (the engine waits on this pid, signals
    # it, reads its exit status), so a child would not do; and the cold create path must not import subprocess, which
    # costs 12-13 ms per GPU container start in the editor's `python -I -S` (median of 21 `-X importtime` runs).
    os.execv(runc, [runc, *argv])
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main())

"""The `gpuprov` command line. Sub-commands live in provision/commands/*; this file wires them and maps the one
domain exception (GpuprovError) to `Error: …` on stderr and a stable exit code (see provision/errors.py).

Typer is the command line; it is imported only where a command needs its parser. The hot command, `gpuprov detect`,
runs without it when its arguments are plain options (`fast_path`): the same function with the same arguments, so
the same output; `gpuprov --help` prints the listing typer would (`listing_text`). Anything else (a command's
--help, an unknown option, a missing value, a value its rule refuses…) goes to typer, with its own messages and exit
codes (tests/unit/test_fast_path.py compares both paths)."""
from __future__ import annotations

import errno
import gc
import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from provision import __version__
from provision.commands import COMMANDS, summary
from provision.errors import DECLINED, INTERNAL, INTERRUPTED, OK, USAGE, GpuprovError
from provision.values import BadValue, check

APP_SETTINGS = dict(
    name="gpuprov",
    help="Turn a Linux host into a working GPU container node: detect, plan, bootstrap, inject, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
ROOT_OPTIONS = {  # the root's options and their help, in `gpuprov --help`'s order (click adds --help)
    "--version": "Print the version and exit.",
    "--no-wait": "If another gpuprov run is changing this host, fail at once (exit 11) instead of waiting for it.",
}


def _typer():
    import typer  # lazy: 38 ms (-X importtime: typer and its click, min of 9), more than detect needs in all

    return typer


def _set_no_wait() -> None:
    from provision.hostlock import set_no_wait  # lazy: 2.6 ms (-X importtime, min of 9); only with --no-wait

    set_no_wait(True)


def _version(value: bool) -> None:
    if value:
        print(f"gpuprov {__version__}")
        raise _typer().Exit()


def new_app():
    """A Typer app with the root's options and no command yet."""
    typer = _typer()
    app = typer.Typer(**APP_SETTINGS)

    def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help=ROOT_OPTIONS["--version"]),
              no_wait: bool = typer.Option(False, "--no-wait", help=ROOT_OPTIONS["--no-wait"])) -> None:
        """gpuprov: GPU container nodes, one host or a fleet."""
        if no_wait:
            _set_no_wait()

    app.callback()(_root)
    return app


# Only the module of the command being run is imported (provision/commands/__init__.py: COMMANDS): each imports what
# its commands need at its top, and all of them together cost about 100 ms more at start-up than `gpuprov --help` or
# `gpuprov detect` need (-X importtime, the sum of the modules' own times, min of 7-9 runs: 148 ms with every command
# module loaded; --help 45 ms, detect 69 ms), which would break detect's 5x a bare start (bench/detect_bench.py).
# No command or an unknown one get the listing from the table alone (`listing`, the same text; `--help` alone gets it
# without typer, `listing_text`).
_app = None
_registered: set[str] = set()


def command_modules(args: list[str]) -> list[str]:
    """The command module `gpuprov ARGS` needs; none when it only lists the commands (help, no or unknown command)."""
    name = next((a for a in args if not a.startswith("-")), None)  # the root's options take no value
    if name in COMMANDS and "--help" not in args[:args.index(name)]:
        return [COMMANDS[name][0]]
    return []


def load_commands(modules: list[str]):
    """The Typer app with the commands of `modules` registered."""
    global _app
    if _app is None:
        _app = new_app()
    for module in modules:
        if module not in _registered:
            importlib.import_module(f"provision.commands.{module}").register(_app)
            _registered.add(module)
    return _app


def click_command(app):
    """The click command typer builds for `app`, every option's metavar and help filled in (commands/helptext.py)."""
    from provision.commands.helptext import name_options  # lazy: 1.5 ms (-X importtime, min of 3); typer runs only

    cmd = _typer().main.get_command(app)
    name_options(cmd)
    return cmd


def listing():
    """An app with the root's options and every command's name and summary, to list them; it runs none."""
    lister = new_app()
    for name in COMMANDS:
        lister.command(name, short_help=summary(name), add_help_option=False, context_settings={
            "ignore_unknown_options": True, "allow_extra_args": True})(_listed_only)
    return lister


def _listed_only() -> None:  # pragma: no cover - the listing's commands are shown, never run
    raise _typer().Exit(INTERNAL)


# The commands that run without typer: each module has `run(**kwargs)`, the typer command's body, and `FAST_OPTIONS`:
# option -> (its parameter, how click takes it: flag, text, path or list, the provision.values rule of its value).
FAST_COMMANDS = ("detect",)


def fast_args(args: list[str], options: dict[str, tuple[str, str, Optional[str]]]) -> Optional[dict]:
    """The keyword arguments typer would pass the command for `args`, for plain options only: a flag, `--opt VALUE` or
    `--opt=VALUE` with a value that is not empty and does not start with '-', a single option once, a list option
    any number of times, every value passing its rule. None for anything else, which typer then parses."""
    kwargs: dict = {}
    rest = iter(args)
    for arg in rest:
        name, eq, value = arg.partition("=")
        if name not in options:
            return None
        param, kind, _ = options[name]
        if kind == "flag":
            if eq:
                return None
            kwargs[param] = True
            continue
        value = value if eq else next(rest, "")
        if not value or value.startswith("-") or (param in kwargs and kind != "list"):
            return None
        if kind == "list":
            kwargs.setdefault(param, []).append(value)
        else:
            kwargs[param] = Path(value) if kind == "path" else value
    try:
        for param, _, rule in options.values():
            if rule:
                check(rule, kwargs.get(param))
    except BadValue:
        return None
    return kwargs


def listing_text() -> str:
    """`gpuprov --help` as typer prints it (click's layout: usage, the app's help, the options and the commands as
    two columns wrapped to the terminal's width, at most 78 and at least 50), without loading typer."""
    import shutil  # lazy: 2.5 ms (-X importtime, min of 9); only --help measures the terminal
    import textwrap  # lazy: 0.8 ms (-X importtime, min of 9); only --help wraps text

    width = max(min(shutil.get_terminal_size().columns, 80) - 2, 50)

    def wrap(text: str, text_width: int, indent: str = "") -> list[str]:
        return textwrap.wrap(text, text_width, initial_indent=indent, subsequent_indent=indent,
                             replace_whitespace=False)

    def section(heading: str, rows: list[tuple[str, str]]) -> list[str]:
        first = min(max(len(name) for name, _ in rows), 30) + 2
        out = ["", f"{heading}:"]
        for name, text in rows:
            lines = wrap(text, max(width - first - 2, 10))
            lead = f"  {name}" + (" " * (first - len(name)) if len(name) <= first - 2 else "\n" + " " * (first + 2))
            out += [lead + lines[0], *(" " * (first + 2) + line for line in lines[1:])]
        return out

    return "\n".join(["Usage: gpuprov [OPTIONS] COMMAND [ARGS]...", "", *wrap(APP_SETTINGS["help"], width, "  "),
                      *section("Options", [*ROOT_OPTIONS.items(), ("--help", "Show this message and exit.")]),
                      *section("Commands", [(name, summary(name)) for name in COMMANDS])])


def _version_only() -> None:
    print(f"gpuprov {__version__}")


def fast_path(argv: list[str]) -> Optional[Callable[[], None]]:
    """`gpuprov --help`, `gpuprov --version` and `gpuprov [--no-wait] detect OPTIONS…` without typer, or None when
    typer must parse `argv`."""
    if "_GPUPROV_COMPLETE" in os.environ:  # click's main answers shell completion when it is set: typer's to do
        return None
    if argv in (["--help"], ["--version"]):
        return (lambda: print(listing_text())) if argv == ["--help"] else _version_only
    no_wait = argv[:1] == ["--no-wait"]
    args = argv[1:] if no_wait else argv
    if not args or args[0] not in FAST_COMMANDS:
        return None
    command = importlib.import_module(f"provision.commands.{COMMANDS[args[0]][0]}")
    kwargs = fast_args(args[1:], command.FAST_OPTIONS)
    if kwargs is None:
        return None

    def run() -> None:
        if no_wait:
            _set_no_wait()
        command.run(**kwargs)
    return run


class _QuietFlush:
    """stdout or stderr after a closed pipe, as typer's main leaves them: flushing again (at exit) says nothing."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _run_fast(run: Callable[[], None]) -> None:
    """A fast path's run, ending as typer's main ends a command: a write to a closed pipe (`gpuprov detect | head
    -1`) is exit 1 with nothing more said. (Ctrl-C is main's to report for both paths; Ctrl-D cannot reach these
    commands: they read no input.)"""
    try:
        run()
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        sys.stdout, sys.stderr = _QuietFlush(sys.stdout), _QuietFlush(sys.stderr)
        sys.exit(1)


def _clicks() -> list:
    """The click module(s) typer raises from: typer >= 0.26 vendors its own copy (typer._click) and a standalone
    click may sit beside it (the [test] extra pulls one in); catching only one of them turned usage errors into
    "internal error" (exit 1). Only modules already loaded can have raised, so nothing is imported here."""
    return [m for m in (sys.modules.get("typer._click"), sys.modules.get("click")) if m is not None]


def _classes(name: str) -> tuple[type, ...]:
    """typer's exception class `name` (its own since 0.26) and its clicks': none when typer was never loaded."""
    typer = sys.modules.get("typer")
    own = (getattr(typer, name),) if typer is not None and hasattr(typer, name) else ()
    return (*own, *(getattr(m.exceptions, name) for m in _clicks() if hasattr(m.exceptions, name)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        fast = fast_path(argv)
        if fast is not None:
            _run_fast(fast)
            return OK
        gc.enable()  # typer's commands run for minutes: cycles are collected there (script() turned it off)
        modules = command_modules(argv)
        app = load_commands(modules) if modules else listing()
        if click_command(app)(args=argv, prog_name="gpuprov", standalone_mode=False) == INTERRUPTED:
            raise KeyboardInterrupt  # typer >= 0.26 returns Ctrl-C as exit code 130 (nothing said) instead of raising
        return OK
    except GpuprovError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("Error: interrupted; re-run the same command to continue (every step is idempotent)", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        return OK
    except Exception as exc:  # noqa: BLE001 - sorted below: click's own exceptions, then the last resort
        if isinstance(exc, _classes("Exit")):
            return exc.exit_code
        if isinstance(exc, _classes("Abort")):  # Ctrl-D / N at a confirmation prompt
            print("Error: declined; nothing was changed", file=sys.stderr)
            return DECLINED
        if isinstance(exc, _classes("ClickException")):
            exc.show()
            return USAGE if isinstance(exc, _classes("UsageError")) else exc.exit_code
        if "GPUPROV_DEBUG" in os.environ:
            raise
        print(f"Error: internal error: {exc!r} (set GPUPROV_DEBUG=1 for a traceback, and please report it)",
              file=sys.stderr)
        return INTERNAL


def script() -> int:
    """The `gpuprov` console script (and `python -m provision`): main, and after a command that loaded no typer (the
    fast path: detect, --help, --version) an exit without the interpreter's teardown, once stdout and stderr are
    flushed: freeing every module is 5 ms of a 60 ms `gpuprov detect` (bench/detect_bench.py). Those commands leave
    no atexit work, thread or temporary file behind. A flush that fails (a closed pipe) is left to the interpreter's
    own exit, which reports it as it always has. The cyclic garbage collector is off until main leaves the fast path:
    such a command allocates a few MB and exits, and 25 collections while detect loads its modules cost 3 ms."""
    gc.disable()
    code = main()
    if "typer" not in sys.modules:
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # None: started with that descriptor closed (`gpuprov --version >&-`)
                    stream.flush()
        except OSError:
            return code
        os._exit(code)
    return code


"""The `gpuprov` command line. Sub-commands live in provision/commands/*; this file wires them and maps the one
domain exception (GpuprovError) to `Error: …` on stderr and a stable exit code (see provision/errors.py)."""
from __future__ import annotations

import importlib
import os
import sys

import typer

from provision import __version__
from provision.commands import COMMANDS, summary
from provision.errors import DECLINED, INTERNAL, USAGE, GpuprovError
from provision.hostlock import set_no_wait

APP_SETTINGS = dict(
    name="gpuprov",
    help="Turn a Linux host into a working GPU container node: detect, plan, bootstrap, inject, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app = typer.Typer(**APP_SETTINGS)


def _version(value: bool) -> None:
    if value:
        print(f"gpuprov {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit."),
          no_wait: bool = typer.Option(False, "--no-wait", help="If another gpuprov run is changing this host, "
                                       "fail at once (exit 11) instead of waiting for it.")) -> None:
    """gpuprov: GPU container nodes, one host or a fleet."""
    if no_wait:
        set_no_wait(True)


# Only the module of the command being run is imported (provision/commands/__init__.py: COMMANDS): each imports what
# its commands need at its top, and all of them together cost about 100 ms more at start-up than `gpuprov --help` or
# `gpuprov detect` need (-X importtime, the sum of the modules' own times, min of 7-9 runs: 148 ms with every command
# module loaded; --help 45 ms, detect 69 ms), which would break detect's 150 ms (bench/detect_bench.py).
# `--help`, no command or an unknown one get the listing from the table alone (`listing`, the same text).
_registered: set[str] = set()


def command_modules(args: list[str]) -> list[str]:
    """The command module `gpuprov ARGS` needs; none when it only lists the commands (help, no or unknown command)."""
    name = next((a for a in args if not a.startswith("-")), None)  # the root's options take no value
    if name in COMMANDS and "--help" not in args[:args.index(name)]:
        return [COMMANDS[name][0]]
    return []


def load_commands(modules: list[str]) -> typer.Typer:
    for module in modules:
        if module not in _registered:
            importlib.import_module(f"provision.commands.{module}").register(app)
            _registered.add(module)
    return app


def listing() -> typer.Typer:
    """An app with the root's options and every command's name and summary, to list them; it runs none."""
    lister = typer.Typer(**APP_SETTINGS)
    lister.callback()(_root)
    for name in COMMANDS:
        lister.command(name, short_help=summary(name), add_help_option=False, context_settings={
            "ignore_unknown_options": True, "allow_extra_args": True})(_listed_only)
    return lister


def _listed_only() -> None:  # pragma: no cover - the listing's commands are shown, never run
    raise typer.Exit(INTERNAL)


def _clicks() -> list:
    """The click module(s) typer raises from: typer >= 0.26 vendors its own copy (typer._click) and a standalone
    click may sit beside it (the [test] extra pulls one in); catching only one of them turned usage errors into
    "internal error" (exit 1). Only modules already loaded can have raised, so nothing is imported here."""
    return [m for m in (sys.modules.get("typer._click"), sys.modules.get("click")) if m is not None]


def _classes(name: str, *extra: type) -> tuple[type, ...]:
    return (*extra, *(getattr(m.exceptions, name) for m in _clicks() if hasattr(m.exceptions, name)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        modules = command_modules(argv)
        (load_commands(modules) if modules else listing())(args=argv, prog_name="gpuprov", standalone_mode=False)
        return 0
    except GpuprovError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("Error: interrupted; re-run the same command to continue (every step is idempotent)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - sorted below: click's own exceptions, then the last resort
        if isinstance(exc, _classes("Exit", typer.Exit)):
            return exc.exit_code
        if isinstance(exc, _classes("Abort", typer.Abort)):  # Ctrl-D / N at a confirmation prompt
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

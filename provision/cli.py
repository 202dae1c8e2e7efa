"""The `gpuprov` command line. Sub-commands live in provision/commands/*; this file wires them and maps the one
domain exception (GpuprovError) to `Error: …` on stderr and a stable exit code (see provision/errors.py)."""
from __future__ import annotations

import sys

import typer

from provision import __version__
from provision.errors import INTERNAL, GpuprovError

app = typer.Typer(
    name="gpuprov",
    help="Turn a Linux host into a working GPU container node: detect, plan, bootstrap, inject, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        print(f"gpuprov {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """gpuprov: GPU container nodes, one host or a fleet."""


def _register() -> None:
    # Imported here so each command module stays small and self-contained.
    from provision.commands import bundle, detect, engine, plan, runtime_cmds, share, verify

    for module in (detect, engine, plan, runtime_cmds, share, verify, bundle):
        module.register(app)


_register()


def _click():
    """click itself (typer < 0.26 depends on it) or the copy typer >= 0.26 vendors."""
    try:
        import click
    except ModuleNotFoundError:  # pragma: no cover - depends on the installed typer
        from typer import _click as click
    return click


def main(argv: list[str] | None = None) -> int:
    click = _click()

    try:
        app(args=argv, prog_name="gpuprov", standalone_mode=False)
        return 0
    except GpuprovError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (typer.Exit, getattr(click.exceptions, "Exit", typer.Exit)) as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (typer.Abort, getattr(click.exceptions, "Abort", typer.Abort)):
        print("Aborted.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Error: interrupted; re-run the same command to continue (every step is idempotent)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - last resort: one line, not a traceback, unless asked
        if "GPUPROV_DEBUG" in __import__("os").environ:
            raise
        print(f"Error: internal error: {exc!r} (set GPUPROV_DEBUG=1 for a traceback, and please report it)",
              file=sys.stderr)
        return INTERNAL

"""The `gpuprov` command line. Sub-commands live in provision/commands/*; this file wires them and maps the one
domain exception (GpuprovError) to `Error: …` on stderr and a stable exit code (see provision/errors.py)."""
from __future__ import annotations

import sys

import typer

from provision import __version__, dispatch
from provision.errors import DECLINED, INTERNAL, USAGE, GpuprovError

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
                                       help="Print the version and exit."),
          no_wait: bool = typer.Option(False, "--no-wait", help="If another gpuprov run is changing this host, "
                                       "fail at once (exit 11) instead of waiting for it.")) -> None:
    """gpuprov: GPU container nodes, one host or a fleet."""
    if no_wait:
        from provision.hostlock import set_no_wait

        set_no_wait(True)


def _register() -> None:
    # Imported here so each command module stays small and self-contained.
    from provision.commands import bundle, detect, engine, k8s, metrics, plan, runtime_cmds, share, verify

    for module in (detect, engine, plan, runtime_cmds, share, verify, bundle, k8s, metrics):
        module.register(app)


_register()


def _dispatch(args: list[str]):
    return app(args=args, prog_name="gpuprov", standalone_mode=False)


# Bootstrap runs its `gpuprov …` steps through this same dispatch, in-process (provision/plan/steps.py).
dispatch.register(_dispatch)


def _clicks() -> list:
    """The click module(s) typer raises from: typer >= 0.26 vendors its own copy (typer._click) and a standalone
    click may sit beside it (the [test] extra pulls one in); catching only one of them turned usage errors into
    "internal error" (exit 1). Only modules already loaded can have raised, so nothing is imported here."""
    return [m for m in (sys.modules.get("typer._click"), sys.modules.get("click")) if m is not None]


def _classes(name: str, *extra: type) -> tuple[type, ...]:
    return (*extra, *(getattr(m.exceptions, name) for m in _clicks() if hasattr(m.exceptions, name)))


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, prog_name="gpuprov", standalone_mode=False)
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
        if "GPUPROV_DEBUG" in __import__("os").environ:
            raise
        print(f"Error: internal error: {exc!r} (set GPUPROV_DEBUG=1 for a traceback, and please report it)",
              file=sys.stderr)
        return INTERNAL

"""`gpuprov engine configure docker|containerd|crio|podman`."""
from __future__ import annotations

import os
import shutil
from contextlib import nullcontext
from typing import Optional

import typer

from provision import engines
from provision.commands import summary
from provision.engines.configure import configure
from provision.hostlock import host_lock
from provision.options import rule
from provision.output import emit_json

engine_app = typer.Typer(help="Container engine configuration (merge, never overwrite).", no_args_is_help=True)


def default_runtime_path() -> str:
    for cand in ("/usr/local/bin/gpuprov-runtime",):
        if os.path.exists(cand):
            return cand
    return shutil.which("gpuprov-runtime") or "/usr/local/bin/gpuprov-runtime"


@engine_app.command("configure", short_help=summary("engine configure"))
def configure_cmd(
    engine: str = typer.Argument(..., help="docker | containerd | crio | podman"),
    config: Optional[str] = typer.Option(None, "--config", callback=rule("path"),
                                         help="Config file (default: the engine's own)."),
    runtime_name: str = typer.Option("nvidia", "--runtime-name", callback=rule("runtime_name"),
                                     help="Name to register (keeps --runtime=nvidia)."),
    runtime_path: Optional[str] = typer.Option(None, "--runtime-path", callback=rule("abs_path"),
                                               help="Default: the installed gpuprov-runtime."),
    default: bool = typer.Option(False, "--default", help="Make it the default runtime (needed for --gpus). Off "
                                 "here, on in bootstrap (--no-default-runtime): this command edits an engine you "
                                 "already run, whose default it changes only when asked."),
    cdi: bool = typer.Option(False, "--cdi", help="Enable CDI in the engine."),
    replace: bool = typer.Option(False, "--replace-runtime", help="Replace your own runtime of that name (its "
                                 "runtimeArgs are dropped) or your default-runtime; without it, such a conflict "
                                 "stops with exit 14 and nothing changed."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the diff; change nothing."),
    no_restart: bool = typer.Option(False, "--no-restart", help="Write the file but do not reload the engine."),
    restart_engine: bool = typer.Option(False, "--restart-engine", help="Let a needed dockerd restart (--cdi, a "
                                        "newer --gpus hook) stop its running containers (live-restore off); "
                                        "without it such a run stops before it writes anything: exit 14."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Register gpuprov-runtime in the engine's config (backup, atomic write, reload only on change, verify)."""
    with nullcontext() if dry_run else host_lock(f"engine configure {engine}"):
        res = configure(engine, config=config, runtime_name=runtime_name,
                        runtime_path=runtime_path or engines.get(engine).front_end(default_runtime_path()),
                        default=default, cdi=cdi,
                        replace=replace, dry_run=dry_run, restart=not no_restart, restart_engine=restart_engine)
    if json_out:
        emit_json(res.to_dict())
        return
    if res.diff:
        print(res.diff, end="")
    print("\n".join(res.lines(dry_run)))


def register(app: typer.Typer) -> None:
    app.add_typer(engine_app, name="engine", short_help=summary("engine"))

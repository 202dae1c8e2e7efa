"""`gpuprov uninstall`: bootstrap's inverse, planned first (provision/plan/uninstall.py) and applied as planned."""
from __future__ import annotations

import sys
from pathlib import Path

import typer

from provision import errors
from provision.commands import summary
from provision.errors import UsageError
from provision.facts.rootfs import is_live
from provision.hostlock import host_lock
from provision.output import emit_json, print_steps
from provision.plan import apply as ap
from provision.plan.uninstall import UninstallOptions, uninstall_steps


def _print(steps, root: Path, json_out: bool) -> None:
    doc = {"schema": "gpuprov.uninstall-plan/v1", "root": str(root), "steps": [s.to_dict(root) for s in steps]}
    if json_out:
        emit_json(doc)
        return
    print_steps("Uninstall plan", doc["steps"])


def uninstall_cmd(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every command and file diff it would run; change "
                                 "nothing."),
    json_out: bool = typer.Option(False, "--json"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every command and all of its output as it "
                                 "runs (the full output is in the run's log either way)."),
    driver: bool = typer.Option(False, "--driver", help="Also purge the driver packages gpuprov installed (its own "
                                "record) and their holds."),
    engine: bool = typer.Option(False, "--engine", help="Also purge the engine packages gpuprov installed (never an "
                                "engine it found on the host)."),
    root: Path = typer.Option(Path("/"), "--root", help="With --dry-run: plan for the host tree under ROOT."),
) -> None:
    """Take gpuprov off this host: its keys out of every engine config it edited (your changes since kept), its
    runtime, hook, CDI specs, units, MPS daemon, caches and state. Packages stay unless --driver/--engine."""
    opt = UninstallOptions(driver=driver, engine=engine)
    if dry_run:
        _print(uninstall_steps(root, opt), root, json_out)
        return
    if not is_live(root):
        raise UsageError(f"--root {root}: uninstall applies to this host only; use it with --dry-run")
    with host_lock("uninstall"):  # held from planning to the end, so the plan shown is the one applied
        *work, release = uninstall_steps(Path("/"), opt)
        if not yes:
            if not sys.stdin.isatty():
                raise errors.UsageError("refusing to change the host without --yes when not on a terminal")
            _print([*work, release], Path("/"), False)
            if not typer.confirm("Apply this plan?"):
                raise errors.Declined("declined at the prompt; nothing was changed")
        # Its run's log lies outside the log directory it removes (ap.UNINSTALL_LOGS); the one-line-a-step log
        # is not written (logged=False): it is in that directory.
        with ap.open_run("uninstall", json_out=json_out, verbose=verbose, log_dir=ap.UNINSTALL_LOGS) as run:
            res = ap.apply_plan(work, logged=False, run=run)
    res.outcomes += ap.apply_plan([release], quiet=True, logged=False).outcomes
    if json_out:
        emit_json({"schema": "gpuprov.uninstall/v1", **res.to_dict()})
    else:
        print(f"uninstall: {res.changed} change(s), {len(res.outcomes)} steps; {ap.log_named(res)}")


def register(app: typer.Typer) -> None:
    app.command("uninstall", short_help=summary("uninstall"))(uninstall_cmd)

"""`gpuprov uninstall`: bootstrap's inverse, planned first (provision/plan/uninstall.py) and applied as planned.
Resumable: every step is idempotent, a step that fails does not stop the others (all of them only take away what is
gpuprov's), and the summary names what is left and why; gpuprov's state (the install record the next run needs)
goes only when nothing failed."""
from __future__ import annotations

import sys
from pathlib import Path

import typer

from provision import errors
from provision.commands import summary
from provision.errors import UsageError
from provision.facts.distro_facts import read_host_root
from provision.facts.rootfs import is_live
from provision.hostlock import host_lock
from provision.options import rule
from provision.output import emit_json, print_steps
from provision.plan import apply as ap
from provision.plan.uninstall import (
    ALLOW_REMOVE,
    ENGINE_DATA,
    FORCE,
    PURGE_OPTIONS,
    RESTART_ENGINE,
    UninstallOptions,
    engine_data_doc,
    refusal,
    uninstall_steps,
)


def _print(steps, root: Path, json_out: bool, verbose: bool = False) -> None:
    doc = {"schema": "gpuprov.uninstall-plan/v1", "root": str(root), "steps": [s.to_dict(root) for s in steps],
           "engine_data": engine_data_doc(steps)}
    if json_out:
        emit_json(doc)
        return
    print_steps("Uninstall plan", doc["steps"], verbose=verbose)


def _engine_data(keep: bool, delete: bool, purge: bool) -> str:
    if keep and delete:
        raise UsageError(f"{ENGINE_DATA['keep']} and {ENGINE_DATA['delete']} say opposite things: give one")
    if (keep or delete) and not purge:
        raise UsageError(f"{ENGINE_DATA['keep' if keep else 'delete']} says what {PURGE_OPTIONS['engine']} does "
                         f"with the engines' data: give it with {PURGE_OPTIONS['engine']}")
    return "keep" if keep else "delete" if delete else ""


def uninstall_cmd(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every command and file diff it would run; change "
                                 "nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan (with --dry-run) or the result as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every command and all of its output as it "
                                 "runs (the full output is in the run's log either way)."),
    purge_driver: bool = typer.Option(False, PURGE_OPTIONS["driver"], help="Also purge the driver packages gpuprov "
                                      "installed (its own record) and their holds."),
    purge_engine: bool = typer.Option(False, PURGE_OPTIONS["engine"], help="Also purge the engine packages gpuprov "
                                      "installed (never an engine it found on the host)."),
    old_driver: bool = typer.Option(False, "--driver", hidden=True, help="Deprecated: --purge-driver."),
    old_engine: bool = typer.Option(False, "--engine", hidden=True, help="Deprecated: --purge-engine."),
    keep_engine_data: bool = typer.Option(False, ENGINE_DATA["keep"], help="With --purge-engine: remove, not purge, "
                                          "an engine package whose purge deletes its data root (Debian's docker.io: "
                                          "/var/lib/docker), keeping your containers, images and volumes there."),
    delete_engine_data: bool = typer.Option(False, ENGINE_DATA["delete"], help="With --purge-engine: purge it, "
                                            "deleting that data root and your containers, images and volumes in "
                                            "it (the plan names them). Without either option, a purge that would "
                                            "delete any of yours stops before any change (exit 14, naming them)."),
    allow_remove: bool = typer.Option(False, ALLOW_REMOVE, help="Let a purge remove packages gpuprov did not "
                                      "install (apt's simulation runs first and names them; without this option "
                                      "they stop the purge, exit 14)."),
    restart_engine: bool = typer.Option(False, RESTART_ENGINE, help="Restart dockerd where a change needs it "
                                        "(features.cdi is read at start only), holding live-restore on for the "
                                        "restart so that running containers keep running (where dockerd cannot, "
                                        "as in swarm mode, they stop); without this option the change waits for "
                                        "dockerd's next restart."),
    force: bool = typer.Option(False, FORCE, help="Go on while Podman containers started under gpuprov's runtime "
                               "still run (without it: exit 14 naming them, nothing changed); Podman cannot stop "
                               "them through that runtime afterwards."),
    root: Path = typer.Option(Path("/"), "--root", metavar="PATH", callback=rule("path"),
                              help="With --dry-run: plan for the host tree under ROOT."),
) -> None:
    """Take gpuprov off this host: its keys out of every engine config it edited (your changes since kept), its
    runtime, hook, CDI specs, units, MPS daemon, caches and state. Packages stay unless --purge-driver/--purge-engine;
    an engine's containers, images and volumes stay unless --delete-engine-data. Engines are reloaded live, never
    restarted unasked."""
    purge_engine = purge_engine or old_engine
    opt = UninstallOptions(purge_driver=purge_driver or old_driver, purge_engine=purge_engine,
                           allow_remove=allow_remove, restart_engine=restart_engine, force=force,
                           engine_data=_engine_data(keep_engine_data, delete_engine_data, purge_engine))
    read_host_root(root)  # exit 3 for a --root that is no host tree, as plan and detect say
    if dry_run:
        steps = uninstall_steps(root, opt)
        _print(steps, root, json_out, verbose)
        stop = refusal(steps)  # the dry run exits as the run would: the plan shown, then why it stops
        if stop:
            raise stop
        return
    if not is_live(root):
        raise UsageError(f"--root {root}: uninstall applies to this host only; use it with --dry-run")
    with host_lock("uninstall"):  # held from planning to the end, so the plan shown is the one applied
        steps = uninstall_steps(Path("/"), opt)
        stop = refusal(steps)
        if stop:  # before the prompt and before any step: nothing changes
            raise stop
        if not yes:
            if not sys.stdin.isatty():
                raise errors.UsageError("refusing to change the host without --yes when not on a terminal")
            _print(steps, Path("/"), False, verbose)
            if not typer.confirm("Apply this plan?"):
                raise errors.Declined("declined at the prompt; nothing was changed")
        work = [s for s in steps if s.id != "uninstall.state"]
        # Its run's log lies outside the log directory it removes (ap.UNINSTALL_LOGS); the one-line-a-step log
        # is not written (logged=False): it is in that directory.
        with ap.open_run("uninstall", json_out=json_out, verbose=verbose, log_dir=ap.UNINSTALL_LOGS) as run:
            # numbered as one plan ([1/5]..[5/5]), as the dry run listed it, though applied in two parts
            res = ap.apply_plan(work, logged=False, keep_going=True, run=run, total=len(steps))
            state = [s for s in steps if s.id == "uninstall.state"]
            if state and not res.failed:  # the record stays for the next run while anything is left to undo
                res.outcomes += ap.apply_plan(state, logged=False, keep_going=True, run=run, first=len(work) + 1,
                                              total=len(steps)).outcomes
    left = [f"{o.id}: {o.detail}" for o in res.failed]
    if json_out:
        emit_json({"schema": "gpuprov.uninstall/v1", **res.to_dict(), "left": left})
    else:
        print(f"uninstall: {res.counts()}; {ap.log_named(res)}"
              + (f"; left, run `gpuprov uninstall` again once fixed: {'; '.join(left)}" if left else ""))
    if res.failed:
        first = res.failed[0]
        raise errors.StepFailed(f"uninstall left {len(left)} step(s) undone (the others are done; run it again to "
                                f"finish): {'; '.join(left)}", exit_code=first.exit_code)


def register(app: typer.Typer) -> None:
    app.command("uninstall", short_help=summary("uninstall"))(uninstall_cmd)

"""`gpuprov verify`: this node, layer by layer, as a table or JSON; exit 10 when a check fails."""
from __future__ import annotations

from typing import Optional

import typer

from provision.commands import summary
from provision.errors import REQUIREMENT_FAILED, GpuprovError
from provision.output import emit_json, table
from provision.verify.checks import LocalHost, prepare_image, run_checks


def verify_cmd(json_out: bool = typer.Option(False, "--json"),
               prepare: Optional[str] = typer.Option(None, "--prepare", hidden=True, metavar="ENGINE",
                                                     help="Only build the check image for ENGINE (docker | "
                                                     "containerd | podman) from this host's files (the fleet suite "
                                                     "uses it).")
               ) -> None:
    """Driver loaded, versions coherent, engine running, runtime registered, containers (GPU where present).
    Nothing is pulled: the check image is built from this host's own files."""
    if prepare is not None:
        prepare_image(prepare)  # an engine without a check image: exit 2
        return
    results = run_checks(LocalHost())
    failed = [r for r in results if r.status == "fail"]
    if json_out:
        emit_json({"ok": not failed, "checks": [r.to_dict() for r in results]})
    else:
        print(table(["CHECK", "RESULT", "DETAIL"], [[r.name, r.status.upper(), r.detail] for r in results]))
    if failed:  # the domain error, so the exit code is 10 whichever click/typer is installed
        raise GpuprovError(f"{len(failed)} check(s) failed: " + "; ".join(r.name for r in failed),
                           exit_code=REQUIREMENT_FAILED)


def register(app: typer.Typer) -> None:
    app.command("verify", short_help=summary("verify"))(verify_cmd)

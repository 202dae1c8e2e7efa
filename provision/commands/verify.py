"""`gpuprov verify`: this node, layer by layer, as a table or JSON; exit 10 when a check fails."""
from __future__ import annotations

import typer

from provision.output import emit_json, table


def verify_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """Driver loaded, versions coherent, engine running, runtime registered, containers (GPU where present)."""
    from provision.errors import REQUIREMENT_FAILED
    from provision.verify.checks import LocalHost, run_checks

    results = run_checks(LocalHost())
    failed = [r for r in results if r.status == "fail"]
    if json_out:
        emit_json({"ok": not failed, "checks": [r.to_dict() for r in results]})
    else:
        print(table(["CHECK", "RESULT", "DETAIL"], [[r.name, r.status.upper(), r.detail] for r in results]))
    if failed:
        raise typer.Exit(REQUIREMENT_FAILED)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_cmd)

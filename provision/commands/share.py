"""`gpuprov share enable|disable|status`: several containers on one GPU with memory caps and compute shares."""
from __future__ import annotations

from typing import Optional

import typer

from provision.commands import summary
from provision.errors import Refused, UsageError
from provision.hostlock import changes_host
from provision.inject.settings import load_settings
from provision.output import emit_json, kv, table
from provision.share import mps
from provision.share.limits import is_index, parse_percent, parse_size

share_app = typer.Typer(help="GPU sharing with limits (NVIDIA MPS): enable, disable, status.", no_args_is_help=True)


def _state_path() -> str:
    return load_settings().share_state


@share_app.command("enable", short_help=summary("share enable"))
@changes_host("share enable")
def enable_cmd(
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU indices to share, e.g. 0,1 (default: all)."),
    max_clients: Optional[int] = typer.Option(None, "--max-clients", help="Max containers per GPU (max_inst)."),
    default_memory: Optional[str] = typer.Option(None, "--default-memory", help="Cap for containers that ask none."),
    default_compute: Optional[int] = typer.Option(None, "--default-compute", help="Percent for those containers."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="Hard per-container ceiling the MPS daemon "
                                             "enforces even against a process that sets its own limit."),
    keep_compute_mode: bool = typer.Option(False, "--keep-compute-mode", help="Leave the GPUs' compute mode as it "
                                           "is (a GPU you may not reconfigure). Then a container that bypasses the "
                                           "MPS pipe runs outside MPS, without the limits."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Start the MPS control daemon for the chosen GPUs (pipe dir /run/gpuprov/mps, logs /var/log/gpuprov/mps), with
    their compute mode set to EXCLUSIVE_PROCESS (put back by `share disable`) so that only MPS reaches them."""
    bad = [x for x in gpus.split(",") if not is_index(x.strip())] if gpus else []
    if bad:  # ASCII digits only: int() would take '１' or '٣' as 1 and 3
        raise UsageError(f"--gpus takes GPU indices such as 0,1 (got {', '.join(map(repr, bad))})")
    try:
        ids = [int(x) for x in gpus.split(",")] if gpus else None
        mem = parse_size(default_memory, "--default-memory") if default_memory else None
        ceiling = parse_size(max_memory, "--max-memory") if max_memory else None
        comp = parse_percent(str(default_compute), "--default-compute") if default_compute else None
    except (ValueError, Refused) as exc:
        raise UsageError(str(exc)) from None
    st = mps.enable(_state_path(), gpus=ids, max_clients=max_clients, default_memory=mem, default_compute=comp,
                    max_memory=ceiling, keep_compute_mode=keep_compute_mode)
    if json_out:
        emit_json(st.to_dict())
    else:
        print(kv([("MPS daemon", f"pid {st.daemon_pid} ({st.supervisor})"), ("gpus", gpus or "all"),
                  ("pipe dir", st.pipe_dir), ("default memory", default_memory), ("default compute", comp),
                  ("ceiling", max_memory), ("compute mode", _modes(st.previous_compute_modes))]))


def _modes(previous: tuple[tuple[str, str], ...]) -> str:
    if not previous:
        return "left as it was (--keep-compute-mode): a container that bypasses MPS is not held to the limits"
    return "EXCLUSIVE_PROCESS (only the MPS server holds a context; `share disable` puts back " + \
        ", ".join(sorted({m for _, m in previous})) + ")"


@share_app.command("disable", short_help=summary("share disable"))
@changes_host("share disable")
def disable_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """Stop the MPS daemon cleanly (running clients finish first)."""
    res = mps.disable(_state_path())
    if json_out:
        emit_json(res)
    else:
        print("GPU sharing off" + (f"; still running: {res['left_running']}" if res.get("left_running") else ""))


@share_app.command("follow", short_help=summary("share follow"), hidden=True)
def follow_cmd(state: str = typer.Option(..., "--state", help="The share state file the unit names."),
               json_out: bool = typer.Option(False, "--json")) -> None:
    """gpuprov-mps.service's ExecStartPost: a restarted daemon gets the state's limits, and the state names it."""
    res = mps.follow(state)
    if json_out:
        emit_json(res)
    else:
        print(f"MPS daemon pid {res['daemon_pid']} now serves {state}" if res["followed"] else res["note"])


@share_app.command("status", short_help=summary("share status"))
def status_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """The daemon, its clients and, per container, GPU memory in use and the limit (like cgpu-smi)."""
    st = mps.status(_state_path())
    if json_out:
        emit_json(st)
        return
    if not st["enabled"]:
        print(st.get("note") or "GPU sharing is off (gpuprov share enable)")
        return
    d = st["daemon"]
    print(kv([("MPS daemon", f"pid {d['pid']} ({d['supervisor']})"), ("gpus", d["gpus"]),
              ("servers", " ".join(map(str, st["servers"])) or "none yet")]))
    print(table(["PID", "CONTAINER", "MEM USED (MiB)", "MEM LIMIT", "COMPUTE %"],
                [[c["pid"], (c["container"] or "")[:12], c["memory_used_mib"], c["memory_limit"],
                  c["compute_percent"]] for c in st["clients"]]))


def register(app: typer.Typer) -> None:
    app.add_typer(share_app, name="share", short_help=summary("share"))

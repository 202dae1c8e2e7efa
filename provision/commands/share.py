"""`gpuprov share enable|disable|status`: several containers on one GPU with memory caps and compute shares."""
from __future__ import annotations

from typing import Optional

import typer

from provision.commands import summary
from provision.errors import Refused, UsageError
from provision.hostlock import changes_host
from provision.inject.settings import load_settings
from provision.output import emit_json, kv, table
from provision.share import mps, policy
from provision.share.limits import is_index, parse_percent, parse_size

share_app = typer.Typer(help="GPU sharing with limits (NVIDIA MPS): enable, disable, status.", no_args_is_help=True)


def _state_path() -> str:
    return load_settings().share_state


@share_app.command("enable", short_help=summary("share enable"))
@changes_host("share enable")
def enable_cmd(
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU indices to share, e.g. 0,1 (default: all)."),
    max_clients: Optional[int] = typer.Option(None, "--max-clients", help="Max containers per GPU (max_inst)."),
    policy_name: Optional[str] = typer.Option(None, "--policy", help="cGPU's scheduling policy by name or number: "
                                              "preemptive (1), weight-preemptive (2, the default), fixed (3), "
                                              "native (5). fair-share (0) and soft (4) need time slices MPS lacks."),
    prio_ratio: Optional[int] = typer.Option(None, "--prio-ratio", help="Percent of the SMs a high-priority "
                                             "container may take (20-99; default: no ceiling)."),
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
        pol = policy.parse(policy_name) if policy_name is not None else policy.of("")
        comp = _policy_default(pol, max_clients, comp, prio_ratio)
    except (ValueError, Refused) as exc:
        raise UsageError(str(exc)) from None
    st = mps.enable(_state_path(), gpus=ids, max_clients=max_clients, default_memory=mem, default_compute=comp,
                    max_memory=ceiling, keep_compute_mode=keep_compute_mode, policy=pol.name, prio_ratio=prio_ratio)
    if json_out:
        emit_json(st.to_dict())
    else:
        print(kv([("MPS daemon", f"pid {st.daemon_pid} ({st.supervisor})"), ("gpus", gpus or "all"),
                  ("policy", f"{pol.name} ({pol.number}): {pol.mps}"),
                  ("pipe dir", st.pipe_dir), ("default memory", default_memory), ("default compute", comp),
                  ("ceiling", max_memory), ("compute mode", _modes(st.previous_compute_modes))]))


def _policy_default(pol: policy.Policy, max_clients: int | None, comp: int | None, prio_ratio: int | None) -> int | None:
    """The daemon's default compute share (--default-compute; fixed's shares go in each client's environment
    instead, share/limits.py); ValueError for options the policy cannot take."""
    if max_clients is not None and not 1 <= max_clients <= 25:
        raise ValueError(f"--max-clients {max_clients}: max_inst is 1-25 containers per GPU")
    if prio_ratio is not None and not (pol.priorities and 20 <= prio_ratio <= 99):
        raise ValueError(f"--prio-ratio {prio_ratio}: must be 20-99, with a policy that has priorities "
                         f"({pol.name} has none)" if not pol.priorities else
                         f"--prio-ratio {prio_ratio}: must be 20-99 (percent of the SMs)")
    if pol.name == "native" and comp:
        raise ValueError("--policy native sets no compute limits: drop --default-compute or choose --policy fixed")
    if comp and pol.default_weight:
        raise ValueError(f"--policy {pol.name} gives each container weight/max_inst of the SMs: drop --default-compute")
    if comp and prio_ratio:  # the daemon's default holds every client, so a high-priority share above it is moot
        raise ValueError("--default-compute is a ceiling MPS holds every client to: --prio-ratio cannot lift it; "
                         "drop one of them")
    if pol.default_weight and not max_clients:
        raise ValueError(f"--policy {pol.name} gives each container 1/max_inst of the SMs: add --max-clients N")
    return comp


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
    """Like cgpu-smi: the daemon and its policy, and per container and GPU: memory used and its cap, the compute
    share, the priority and the process count (--json: per container and per process)."""
    st = mps.status(_state_path())
    if json_out:
        emit_json(st)
        return
    if not st["enabled"]:
        print(st.get("note") or "GPU sharing is off (gpuprov share enable)")
        return
    d = st["daemon"]
    print(kv([("MPS daemon", f"pid {d['pid']} ({d['supervisor']})"), ("gpus", d["gpus"]),
              ("policy", f"{d['policy']} ({d['policy_number']})"), ("max_inst", d["max_clients"]),
              ("servers", " ".join(map(str, st["servers"])) or "none yet")]))
    print(table(["GPU", "CONTAINER", "MEM USED (MiB)", "MEM CAP", "COMPUTE %", "PRIORITY", "PIDS"],
                [[c["gpu"], (c["container"] or "host")[:12], c["memory_used_mib"], c["memory_limit"] or "-",
                  c["compute_percent"] or "-", c["priority"], len(c["pids"])] for c in st["containers"]]))


def register(app: typer.Typer) -> None:
    app.add_typer(share_app, name="share", short_help=summary("share"))

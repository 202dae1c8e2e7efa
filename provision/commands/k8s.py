"""`gpuprov k8s node|labels|manifests`: Kubernetes GPU nodes on containerd or CRI-O."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from provision.commands import summary
from provision.commands.engine import default_runtime_path
from provision.commands.runtime_cmds import _discover
from provision.errors import Declined, GpuprovError, UsageError
from provision.fsutil import SHARED_DIR_HELP, SHARED_DIR_OPTION, write_file
from provision.hostlock import host_lock
from provision.inject.settings import load_settings, set_setting, settings_path
from provision.k8s import node
from provision.k8s.labels import NFD_FILE, gfd_labels, kubelet_flag, nfd_file
from provision.k8s.manifests import MIG_STRATEGIES, NodeSettings, decide_mig_strategy, decide_sharing, decide_strategy, render_all
from provision.k8s.node import CDI_SPEC, installed_engine_has_cdi, write_if_changed
from provision.metrics import nvml
from provision.options import check_choice, rule
from provision.output import emit_json, kv
from provision.share import mps

k8s_app = typer.Typer(help="Kubernetes GPU nodes: CRI handler, CDI, node labels, RuntimeClass, device plugin config.",
                      no_args_is_help=True)

LABEL_FORMATS = ("nfd", "kubelet", "json")
SHARING_METAVAR = "auto|none|time-slicing|mps"
SHARING_HELP = "auto (gpuprov share state) | none | time-slicing | mps (the device plugin's own MPS daemon)."
MIG_HELP = "none | single | mixed (how the device plugin and the labels offer MIG devices; GFD's --mig-strategy)."
STRATEGY_HELP = "auto | envvar | volume-mounts | cdi-annotations (how the device plugin passes GPUs to the runtime)."


def _settings(engine_cdi: bool | None = None):
    s = load_settings()
    st = mps.load_state(s.share_state)
    share_on = bool(st and mps.daemon_pid(st))
    if engine_cdi is None:  # what the engine has now: the CDI spec gpuprov writes, and an engine that applies it
        engine_cdi = os.path.exists(CDI_SPEC) and installed_engine_has_cdi()
    return NodeSettings(share_state=st if share_on else None,
                        accept_env_unprivileged=s.accept_env_unprivileged, engine_cdi=engine_cdi,
                        driver_root=s.driver_root)


def _labels(sharing: str, replicas: Optional[int], mig_strategy: str = "none") -> dict[str, str]:
    sharing_d = decide_sharing(_settings(), sharing, replicas)
    mig_strategy = decide_mig_strategy(mig_strategy, sharing_d)
    profiles = None
    if mig_strategy != "none":  # the MIG devices as the runtime's discovery sees them (NVML's profiles)
        layout = _discover(None, arch=True).mig
        profiles = [d.profile for d in layout.devices] if layout is not None else []
    return gfd_labels(nvml.snapshot(), sharing_d, mig_strategy, profiles)


@k8s_app.command("labels", short_help=summary("k8s labels"))
def labels_cmd(
    fmt: str = typer.Option("nfd", "--format", metavar="|".join(LABEL_FORMATS),
                            help="nfd (NFD local-source lines) | kubelet (--node-labels) | json"),
    write: bool = typer.Option(False, "--write", help="Write the NFD local-source file "
                               "/etc/kubernetes/node-feature-discovery/features.d/gpuprov (atomic)."),
    sharing: str = typer.Option("auto", "--sharing", metavar=SHARING_METAVAR, help=SHARING_HELP),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Pods per GPU when shared."),
    mig_strategy: str = typer.Option("none", "--mig-strategy", metavar="|".join(MIG_STRATEGIES), help=MIG_HELP),
) -> None:
    """This node's GPU labels in GPU Feature Discovery's format (product, memory, count, family, compute capability,
    CUDA driver/runtime versions, sharing strategy and replicas, MIG capability)."""
    check_choice(fmt, LABEL_FORMATS, "--format")  # before anything is written
    labels = _labels(sharing, replicas, mig_strategy)
    if write:
        with host_lock("k8s labels --write"):
            changed = write_if_changed(NFD_FILE, nfd_file(labels))
        print(f"{'wrote' if changed else 'unchanged'} {NFD_FILE} ({len(labels)} labels)", file=sys.stderr)
    if fmt == "nfd":
        print(nfd_file(labels), end="")
    elif fmt == "kubelet":
        print(kubelet_flag(labels))
    else:
        emit_json(labels)


def _check_output_dir(out: Path) -> None:
    """--output names a directory, or one to create: the first part of it that exists must be a directory (exit 2
    before anything is rendered or written, not NotADirectoryError halfway)."""
    for p in (out, *out.parents):
        if os.path.lexists(p):
            if not p.is_dir():
                raise UsageError(f"--output {out}: {p} is not a directory; name a directory to write the manifests "
                                 "into")
            return


@k8s_app.command("manifests", short_help=summary("k8s manifests"))
def manifests_cmd(
    output: Optional[str] = typer.Option(None, "--output", metavar="DIR", callback=rule("path"), help="Write the files into DIR "
                                         "(default: print them)."),
    sharing: str = typer.Option("auto", "--sharing", metavar=SHARING_METAVAR, help=SHARING_HELP),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Pods per GPU when shared."),
    strategy: str = typer.Option("auto", "--device-list-strategy", metavar="auto|envvar|volume-mounts|cdi-annotations",
                                  help=STRATEGY_HELP),
    namespace: str = typer.Option("nvidia-device-plugin", "--namespace", callback=rule("namespace"),
                                  help="The device plugin's namespace."),
    allow_shared_dir: bool = typer.Option(False, SHARED_DIR_OPTION, help=SHARED_DIR_HELP),
    mig_strategy: str = typer.Option("none", "--mig-strategy", metavar="|".join(MIG_STRATEGIES), help=MIG_HELP),
) -> None:
    """RuntimeClass `nvidia`, and the NVIDIA device plugin's config (file, ConfigMap, Helm values) from gpuprov's
    sharing and runtime settings."""
    if output is not None:
        _check_output_dir(Path(output))
    s = _settings()
    sharing_d = decide_sharing(s, sharing, replicas)
    files = render_all(s, sharing_d, decide_strategy(s, strategy), namespace,
                       decide_mig_strategy(mig_strategy, sharing_d))
    if output is None:
        for name, text in files.items():
            print(f"---\n# {name}\n{text}", end="")
        return

    for name, text in files.items():
        write_file(Path(output) / name, text, mode=0o644, backup=False, shared_dir_ok=allow_shared_dir)
    print(kv([("wrote", " ".join(files)), ("into", output)]))


@k8s_app.command("node", short_help=summary("k8s node"))
def node_cmd(
    engine: str = typer.Option("auto", "--engine", metavar="containerd|crio|auto", help="containerd | crio | auto"),
    config: Optional[str] = typer.Option(None, "--config", callback=rule("path"),
                                         help="The engine's main config (default: its own)."),
    default: bool = typer.Option(False, "--default", help="Make `nvidia` the default CRI handler (pods then need "
                                 "no runtimeClassName)."),
    cdi: bool = typer.Option(True, "--cdi/--no-cdi", help="Enable CDI in the engine and write the spec (on here, "
                             "unlike bootstrap's --cdi: the device plugin's CDI strategies need it)."),
    sharing: str = typer.Option("auto", "--sharing", metavar=SHARING_METAVAR, help=SHARING_HELP),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Pods per GPU when shared."),
    runtime_path: Optional[str] = typer.Option(None, "--runtime-path", callback=rule("abs_path"),
                                               help="Default: the installed gpuprov-runtime."),
    manifests: Optional[str] = typer.Option(None, "--manifests", metavar="DIR", callback=rule("path"),
                                            help="Also write the manifests here."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would change; change nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_out: bool = typer.Option(False, "--json"),
    env_unprivileged: bool = typer.Option(False, "--accept-env-unprivileged", help="Keep letting unprivileged "
                                          "pods pick GPUs with NVIDIA_VISIBLE_DEVICES (single-tenant nodes only)."),
) -> None:
    """Prepare this containerd/CRI-O node for GPU pods: handler `nvidia` (drop-in), CDI spec and its refresh at boot,
    GPU labels for NFD; the runtime's accept_env_unprivileged off (a pod gets only the GPUs the device plugin gave
    it) unless --accept-env-unprivileged. Idempotent: a second run changes nothing. As bootstrap: what would change
    is shown and asked about first, unless --yes; not on a terminal, --yes is needed."""
    if not (dry_run or yes or sys.stdin.isatty()):  # (it changed the host unasked: issue 39)
        raise UsageError("refusing to change the host without --yes when not on a terminal (--dry-run shows what "
                         "would change)")
    args = (engine, config, default, cdi, sharing, replicas, runtime_path, manifests)
    with host_lock("k8s node"):  # held from the question to the end, so what was shown is what is done
        if not (dry_run or yes) and _node(*args, dry_run=True, json_out=False, env_unprivileged=env_unprivileged):
            if not typer.confirm("Apply these changes?"):
                raise Declined("declined at the prompt; nothing was changed")
        _node(*args, dry_run=dry_run, json_out=json_out, env_unprivileged=env_unprivileged)


def _node(engine, config, default, cdi, sharing, replicas, runtime_path, manifests, dry_run, json_out,
          env_unprivileged=False) -> list[str]:
    """Set the node up (or, with dry_run, say what would change), print the result; what changed."""
    name = node.pick_engine(engine)
    # Multi-tenant: any pod can set NVIDIA_VISIBLE_DEVICES=all in its image or spec and, with the setting on, get
    # every GPU of the node, the other tenants' included; off, only the device plugin's /dev/null mounts count.
    env_changed = set_setting("accept_env_unprivileged", env_unprivileged, dry_run=dry_run)
    s = _settings(engine_cdi=cdi and node.engine_has_cdi(name))
    sharing_d = decide_sharing(s, sharing, replicas)
    try:
        labels = gfd_labels(nvml.snapshot(), sharing_d)
    except GpuprovError as exc:  # driver not loaded yet (reboot pending): the engine side still gets done
        labels = None
        print(f"warning: no GPU labels: {exc}", file=sys.stderr)
    disc = None
    if cdi:
        try:
            disc = _discover(None)
        except GpuprovError as exc:
            print(f"warning: no CDI spec now: {exc}", file=sys.stderr)
    res = node.setup(name, runtime_path=runtime_path or default_runtime_path(), default=default, cdi=cdi,
                     dry_run=dry_run, disc=disc, labels=labels, config=config)
    if env_changed:
        res.changed.append(f"{'would set' if dry_run else 'set'} accept_env_unprivileged "
                           f"{str(env_unprivileged).lower()} in {settings_path()}")
    if manifests and not dry_run:
        manifests_cmd(output=manifests, sharing=sharing, replicas=replicas, strategy="auto",
                      namespace="nvidia-device-plugin", allow_shared_dir=False, mig_strategy="none")
    if json_out:
        emit_json(res.to_dict())
        return res.changed
    print(kv([("engine", name), ("changes", "; ".join(res.changed) or "none"), ("CDI spec", res.cdi_spec),
              ("labels", res.labels_file), ("kubelet", "pods use `runtimeClassName: nvidia`" if not default
               else "nvidia is the default handler")]))
    return res.changed


def register(app: typer.Typer) -> None:
    app.add_typer(k8s_app, name="k8s", short_help=summary("k8s"))

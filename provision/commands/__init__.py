"""CLI sub-commands, one module each; every module has `register(app)`.

COMMANDS: each sub-command's module and its line in `gpuprov --help`, in that listing's order. provision.cli imports
only the module of the command being run, and lists the commands from this table alone (tests/unit/test_imports.py
holds the table to what the modules register, and the listing to the one the loaded modules would print)."""
from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "detect": ("detect", "Read-only facts: distro, GPUs and their driver, engines."),
    "plan": ("plan", "Every command and file diff bootstrap would run."),
    "bootstrap": ("plan", "Make this host a GPU container node (idempotent)."),
    "docker-args": ("runtime_cmds", "Print --device/--volume flags for a plain `docker run`."),
    "driver-volume": ("runtime_cmds", "Keep BASE/current linked to the running driver's files."),
    "verify": ("verify", "Check this node layer by layer, containers included."),
    "metrics": ("metrics", "Per-GPU and per-container metrics in Prometheus' text format."),
    "uninstall": ("uninstall", "Take gpuprov off this host: bootstrap's inverse."),
    "runtime": ("runtime_cmds", "The injection runtime (gpuprov-runtime): install, discover."),
    "cdi": ("runtime_cmds", "CDI specs for engines that consume CDI natively."),
    "engine": ("engine", "Container engine configuration (merge, never overwrite)."),
    "share": ("share", "GPU sharing with limits (NVIDIA MPS)."),
    "bundle": ("bundle", "Offline bundles: create, verify, install (network off)."),
    "k8s": ("k8s", "Kubernetes GPU nodes: CRI handler, labels, manifests."),
}


def summary(name: str) -> str:
    return COMMANDS[name][1]

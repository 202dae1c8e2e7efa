"""CLI sub-commands, one module each; every module has `register(app)`.

COMMANDS: each sub-command's module and its line in `gpuprov --help`, in that listing's order. provision.cli imports
only the module of the command being run, and lists the commands from this table alone (tests/unit/test_imports.py
holds the table to what the modules register, and the listing to the one the loaded modules would print)."""
from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "detect": ("detect", "Read-only facts: distro, GPUs and their driver, engines."),
    "plan": ("plan", "What bootstrap would do, step by step (-v: every command)."),
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
    "bundle": ("bundle", "Offline bundles: create, verify, install (network off), plan."),
    "k8s": ("k8s", "Kubernetes GPU nodes: CRI handler, labels, manifests."),
}


# Each sub-command's line in its group's --help (`gpuprov bundle --help`): click cuts a line made from the docstring
# at the terminal's width less the names' ("Resolve the full closure in a clean root of TARGET, download..."), so each
# says itself in a few words (tests/unit/test_help.py holds every listing to whole lines).
SUBCOMMANDS: dict[str, str] = {
    "runtime install": "Install gpuprov-runtime and refresh its discovery.",
    "runtime dev-char-links": "Make /dev/char links for NVIDIA's device nodes.",
    "runtime discover": "What the runtime would inject into a container.",
    "cdi generate": "Write a CDI spec for this host's GPUs.",
    "cdi refresh": "Write the CDI spec where engines read it, if changed.",
    "cdi list": "List the CDI device names in the spec directories.",
    "engine configure": "Register gpuprov-runtime in an engine's config.",
    "share enable": "Start MPS for the chosen GPUs, with limits.",
    "share disable": "Stop the MPS daemon (running clients finish first).",
    "share follow": "Follow the MPS daemon (internal).",
    "share status": "The MPS daemon, its clients, memory per container.",
    "bundle create": "Build a bundle for TARGET (on a connected machine).",
    "bundle verify": "Check a bundle: checksums, signature, manifest.",
    "bundle install": "Verify, then install from the bundle alone.",
    "bundle plan": "How a bundle for TARGET is built and installed.",
    "k8s labels": "This node's GPU labels (GPU Feature Discovery).",
    "k8s manifests": "RuntimeClass and the device plugin's config.",
    "k8s node": "Prepare this containerd/CRI-O node for GPU pods.",
}


def summary(name: str) -> str:
    """A command's line in `gpuprov --help`, or a sub-command's in its group's (`"bundle create"`)."""
    return COMMANDS[name][1] if name in COMMANDS else SUBCOMMANDS[name]

"""What every command's --help shows for an option that does not say it itself: a metavar that names the kind of value
(PATH, BRANCH, HOST:PORT, the choices), never click's `TEXT` or typer's `<str>`, and the help of options many commands
share (--json, --target, --driver-root, …), written once here. An option's own metavar or help always wins.
tests/unit/test_help.py walks every command's options and holds them to this."""
from __future__ import annotations

from provision.options import CHOICES

# provision.values rule (an option's `rule(NAME)` callback) -> the metavar of its value
RULE_METAVARS = {
    "path": "PATH", "abs_path": "PATH", "abs_paths": "PATH:PATH", "pci_id": "VENDOR:DEVICE",
    "kernel_release": "KERNEL", "driver": "auto|skip|BRANCH", "url": "URL", "runtime_name": "NAME",
    "cri_handler": "NAME", "namespace": "NAMESPACE", "gpg_key": "KEYFILE", "listen": "HOST:PORT",
    "packages": "PKG,PKG", "boolean": "true|false", "engine_option": "KEY=JSON", "user_name": "USER",
}
# options named alike on several commands, whose value is of one kind everywhere
NAME_METAVARS = {
    "--target": "RELEASE", "--driver-root": "PATH", "--dev-root": "PATH", "--proc-root": "PATH", "--prefix": "PATH",
    "--runc": "PATH", "--state": "PATH", "--base": "PATH", "--config": "PATH", "--output": "PATH",
    "--spec-dirs": "PATH:PATH", "--keyring": "KEYFILE", "--sign-key": "KEYID", "--only": "STAGE,STAGE",
    "--mirror": "NAME=URL", "--gpus": "GPUS", "--capabilities": "CAP,CAP", "--replicas": "N",
    "--max-clients": "N", "--default-compute": "PERCENT", "--default-memory": "SIZE", "--max-memory": "SIZE",
    "--policy": "NAME|NUMBER", "--prio-ratio": "PERCENT",
    "--interval": "SECONDS", "--kernel": "KERNEL", "--pci-id": "VENDOR:DEVICE",
}
TYPE_METAVARS = {"integer": "N", "float": "NUMBER", "path": "PATH"}
SHARED_HELP = {
    "--json": "Print the result as JSON (its documented schema) instead of text.",
    "--target": "The release to decide for, e.g. debian-12, ubuntu-24.04, rocky-9 (default: this host's own).",
    "--driver-root": "Where the driver's files are (default: gpuprov's setting, else the host's /).",
    "--runtime-name": "The name the runtime is registered under in the engine (`--runtime NAME`).",
    "--no-validate": "Skip the validation container.",
}


def metavar_for(option) -> str | None:
    """The metavar a click option's value gets, by what it is: its rule, its choices, its name, its type."""
    rule = getattr(option.callback, "rule", None)
    if rule in RULE_METAVARS:
        return RULE_METAVARS[rule]
    if option.name in CHOICES:
        return "|".join(CHOICES[option.name])
    name = option.opts[0]
    if name in NAME_METAVARS:
        return NAME_METAVARS[name]
    return TYPE_METAVARS.get(option.type.name)


def commands(cmd, path=()):
    """(command path, click command) for every leaf command under `cmd`."""
    subs = getattr(cmd, "commands", None)
    if subs is None:
        yield path, cmd
        return
    for name, sub in subs.items():
        yield from commands(sub, (*path, name))


def name_options(root) -> None:
    """Fill in what an option leaves unsaid (metavar, shared help), on the click command tree about to run."""
    for _, cmd in commands(root):
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            if not p.is_flag and p.metavar is None:
                p.metavar = metavar_for(p)
            if not p.help:
                p.help = SHARED_HELP.get(p.opts[0])


# options of one name whose defaults differ between commands, and why (tests/unit/test_help.py holds the list whole)
DIFFERENT_DEFAULTS = {
    "--driver": "uninstall's --driver/--engine are purge flags (yes/no), not bootstrap's driver branch or engine",
    "--engine": "uninstall's --driver/--engine are purge flags; k8s node picks the CRI engine it finds (auto)",
    "--cdi": "k8s node enables CDI by default (the device plugin's cdi strategies need it); bootstrap and engine "
             "configure leave it to the operator (--cdi)",
    "--gpus": "docker-args prints flags for a container (all GPUs); share enable shares the GPUs it is given",
    "--format": "k8s labels prints node labels (nfd), cdi generate a CDI spec (yaml): different documents",
    "--dev-root": "runtime install keeps the dev root runtime.json names unless told (a re-install changes no "
                  "setting it was not given); the read-only commands look at / unless told",
}

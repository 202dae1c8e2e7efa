"""The choices of bootstrap's options, declared once. The CLI checks values against them, and
tests/unit/test_option_choices.py holds the Ansible module's argument spec, the role's argument_specs.yml and
defaults/main.yml to them (those cannot import gpuprov: the module runs with the node's own Python).
Free-form values (URLs, kernel releases, names, paths…) follow provision/values.py's rules: `rule(NAME)` is the
callback an option checks its value with, and bootstrap's options take the rule of their module parameter.
`Options` (provision/plan/options.py) is what plan and bootstrap decide from, checked against these choices."""
from __future__ import annotations

from enum import Enum

from provision.errors import UsageError
from provision.values import PARAMS, BadValue, check


class KernelModules(str, Enum):
    AUTO = "auto"
    OPEN = "open"
    PROPRIETARY = "proprietary"


class DriverSource(str, Enum):
    DISTRO = "distro"
    ELREPO = "elrepo"
    NVIDIA = "nvidia"


class Engine(str, Enum):
    DOCKER = "docker"
    CONTAINERD = "containerd"
    PODMAN = "podman"
    NONE = "none"


class EngineSource(str, Enum):
    AUTO = "auto"
    DISTRO = "distro"
    DOCKER_CE = "docker-ce"


class Stage(str, Enum):
    """What `bootstrap --only` (and the role's tags) select: each step belongs to one stage."""
    DRIVER = "driver"
    ENGINE = "engine"
    RUNTIME = "runtime"
    VALIDATE = "validate"


class Mirror(str, Enum):
    """Repositories whose base URL `--mirror NAME=URL` replaces (provision/plan/repos.py)."""
    ELREPO = "elrepo"
    EPEL = "epel"
    CUDA = "cuda"
    DOCKER_CE = "docker-ce"


def values(enum: type[Enum]) -> tuple[str, ...]:
    return tuple(m.value for m in enum)


# bootstrap option -> its choices (the Ansible module's parameter of the same name, with _ for -)
CHOICES: dict[str, tuple[str, ...]] = {
    "kernel_modules": values(KernelModules),
    "driver_source": values(DriverSource),
    "engine": values(Engine),
    "engine_source": values(EngineSource),
}


# bootstrap's options (the CLI's parameter names) -> the parameter of the fleet role's module that passes each
# (plugins/modules/gpuprov_node.py, linked as roles/gpuprov/library/gpuprov_node.py; the role's variable is
# gpuprov_<parameter>). None: the module sets it itself (--yes or --check follow Ansible's check mode, --json is how
# it reads the result, --dry-run is --check's printed cousin, --reboot is the role's job: its handler drains, reboots
# and verifies, and --root plans or checks a host tree, while the module works on the node it runs on).
# tests/unit/test_option_choices.py fails when bootstrap has an option this table does not place, and proves each
# module parameter reaches its option by parsing the module's argv with the CLI itself.
MODULE_PARAMS: dict[str, str | None] = {
    "driver": "driver",
    "kernel_modules": "kernel_modules",
    "driver_source": "driver_source",
    "engine": "engine",
    "engine_source": "engine_source",
    "runtime_name": "runtime_name",
    "no_default": "default_runtime",
    "cdi": "cdi",
    "no_validate": "validate",
    "replace_runtime": "replace_runtime",
    "allow_remove": "allow_remove",
    "restart_engine": "restart_engine",
    "bundle": "bundle",
    "bundle_keyring": "bundle_keyring",
    "only": "stages",
    "mirror": "mirrors",
    "for_gpus": "for_gpus",
    "kernels": "kernels",
    "no_persistence": "persistence",
    "engine_option": "engine_options",
    "engine_user": "engine_users",
    "yes": None,
    "check": None,
    "json_out": None,
    "verbose": None,  # what the screen shows (the module reads --json; the run's log has everything)
    "dry_run": None,
    "reboot": None,
    "root": None,
}


def rule(name: str):
    """A click callback for an option whose value must pass provision.values' rule `name` (each element of a repeated
    option): one `--OPTION 'VALUE': RULE` line and exit 2 otherwise, before the value reaches a file or an argv.
    Untyped (ctx, param, value), click's own callback form, which typer passes through."""
    def callback(ctx, param, value):
        try:
            return check(name, value)
        except BadValue as exc:
            raise UsageError(f"{param.opts[0]} {exc}") from None

    callback.rule = name  # read by tests/unit/test_option_choices.py
    return callback


def param_rule(option: str):
    """A bootstrap option's callback: the rule of the module parameter that passes it (values.PARAMS), so the role
    and the CLI accept the same values."""
    return rule(PARAMS[MODULE_PARAMS[option]])


def check_choice(value: str, choices: tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)} (got {value!r})")
    return value

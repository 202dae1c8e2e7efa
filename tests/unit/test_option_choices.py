"""Option choices are declared once (provision/options.py). The Ansible module cannot import gpuprov (it runs with
the node's Python), so its argument spec, its documentation, the role's argument_specs.yml, defaults/main.yml and
the task that calls the module are held to gpuprov here: every bootstrap option has a module parameter and a role
variable (options.MODULE_PARAMS), the module's argv is parsed by gpuprov's own CLI, and the CLI rejects what the
enums do not list."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import typer.main
import yaml

from provision.cli import load_commands
from provision.options import CHOICES, MODULE_PARAMS, Mirror, Stage, values
from provision.plan import repos
from provision.plan.options import Options
from tests.conftest import REPO, run_cli

app = load_commands(["plan"])  # gpuprov imports only the invoked command's module: bootstrap's

ROLE = REPO / "roles/gpuprov"
# Module parameters that are not bootstrap options: `kubernetes` runs `gpuprov k8s node` after bootstrap, `gpuprov`
# is the command's path on the node.
NOT_BOOTSTRAP = {"kubernetes", "gpuprov", "state", "uninstall_driver", "uninstall_engine",
                 "uninstall_engine_data"}  # (the last four: `gpuprov uninstall`'s, test_absent_runs_uninstall_with_its_options)
# A value other than the default for each parameter (a parameter missing here fails the round trip below).
SAMPLES = dict(driver="535", kernel_modules="open", driver_source="nvidia", engine="containerd",
               engine_source="docker-ce", runtime_name="gpu", default_runtime=False, cdi=True, validate=False,
               persistence=False, replace_runtime=True, allow_remove=True, restart_engine=True,
               bundle="/var/lib/gpuprov/bundle", bundle_keyring="/var/lib/gpuprov/k.gpg",
               for_gpus=["10de:2335", "10de:2330"], kernels=["6.1.0-28-amd64"], stages=["engine", "runtime"],
               mirrors={"cuda": "https://mirror.example/cuda", "docker-ce": "https://mirror.example/docker-ce"},
               engine_options={"log-driver": "local", "log-opts": {"max-size": "10m"}, "live-restore": True},
               engine_users=["alice", "bob"])


def _module():
    """The module as Ansible ships it to a node: with module_utils/gpuprov_errors.py and gpuprov_values.py (links to
    errors.py and values.py)."""
    for name in ("gpuprov_errors", "gpuprov_values"):
        utils = importlib.util.spec_from_file_location(f"ansible.module_utils.{name}", ROLE / f"module_utils/{name}.py")
        sys.modules[utils.name] = importlib.util.module_from_spec(utils)
        utils.loader.exec_module(sys.modules[utils.name])
    spec = importlib.util.spec_from_file_location("gpuprov_node", ROLE / "library/gpuprov_node.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bootstrap():
    return typer.main.get_command(app).commands["bootstrap"]


def _module_defaults(mod) -> dict:
    return {name: spec.get("default") for name, spec in mod.ARGUMENT_SPEC.items()}


def _cli_params(mod, params: dict) -> dict:
    """What gpuprov's CLI makes of the module's argv for these parameters."""
    argv = mod.bootstrap_argv(params, check_mode=False)
    assert argv[:3] == [params["gpuprov"], "--no-wait", "bootstrap"], argv
    typer.main.get_command(app).make_context("gpuprov", argv[1:])  # the root accepts --no-wait
    return _bootstrap().make_context("bootstrap", argv[3:]).params


def test_module_argument_spec_matches_the_enums():
    mod = _module()
    spec, doc = mod.ARGUMENT_SPEC, yaml.safe_load(mod.DOCUMENTATION)["options"]
    for name, choices in CHOICES.items():
        assert tuple(spec[name]["choices"]) == choices, name
        assert tuple(doc[name]["choices"]) == choices, name
        assert spec[name]["default"] == doc[name]["default"] == getattr(Options(), name), name
    assert tuple(spec["stages"]["choices"]) == values(Stage) == tuple(doc["stages"]["choices"])
    assert set(doc) == set(spec)
    for name in spec:
        assert {k: v for k, v in doc[name].items() if k != "description"} == spec[name], name


def test_every_bootstrap_option_has_a_module_parameter():
    """A new bootstrap option fails here until options.MODULE_PARAMS places it (and then the tests below ask for
    the module parameter, the role variable and the task argument)."""
    assert {p.name for p in _bootstrap().params} == set(MODULE_PARAMS)
    assert set(_module().ARGUMENT_SPEC) == {p for p in MODULE_PARAMS.values() if p} | NOT_BOOTSTRAP


def test_module_defaults_are_the_cli_defaults():
    mod = _module()
    assert _cli_params(mod, _module_defaults(mod)) == {**_bootstrap().make_context("bootstrap", []).params,
                                                       "yes": True, "json_out": True}


@pytest.mark.parametrize("param", sorted(p for p in MODULE_PARAMS.values() if p))
def test_each_module_parameter_reaches_its_option(param):
    """Only the parameter's own option changes, as the CLI parses the module's argv."""
    mod = _module()
    defaults = _module_defaults(mod)
    base, changed = _cli_params(mod, defaults), _cli_params(mod, {**defaults, param: SAMPLES[param]})
    option = next(cli for cli, p in MODULE_PARAMS.items() if p == param)
    assert {k for k in base if base[k] != changed[k]} == {option}, (param, base, changed)


def test_role_variables_match_the_module():
    specs = yaml.safe_load((ROLE / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    module = _module().ARGUMENT_SPEC
    for name, choices in CHOICES.items():
        assert tuple(specs[f"gpuprov_{name}"]["choices"]) == choices, name
    # Every module parameter is a role variable of the same type and default (the stages come from the tags).
    for name, spec in module.items():
        if name in ("stages", "gpuprov"):
            continue
        var = specs[f"gpuprov_{name}"]
        assert var["type"] == spec["type"] and var.get("choices") == spec.get("choices"), name
        assert var.get("default") == defaults[f"gpuprov_{name}"] == spec.get("default"), name
    assert set(specs) == set(defaults), "every variable is typed in argument_specs.yml and defaulted"
    # ... and the task passes every one of them.
    (task,) = yaml.safe_load((ROLE / "tasks/bootstrap.yml").read_text())
    assert set(task["gpuprov_node"]) == set(module) - {"gpuprov"}
    # The reboot handler verifies with that same task (the play's options), not a second, shorter call.
    handlers = yaml.safe_load((ROLE / "handlers/main.yml").read_text())
    calls = [h for h in handlers if "gpuprov_node" in h]
    verify = [h["ansible.builtin.include_tasks"] for h in handlers if "ansible.builtin.include_tasks" in h]
    assert not calls and [v["file"] for v in verify] == ["bootstrap.yml"], handlers


@pytest.mark.parametrize("check_mode", [False, True])
def test_absent_runs_uninstall_with_its_options(check_mode):
    """`state: absent` is `gpuprov uninstall`, its two flags the module's two parameters, as the CLI parses them."""
    mod = _module()
    uninstall = typer.main.get_command(load_commands(["uninstall"])).commands["uninstall"]
    for driver, engine, data in ((False, False, None), (True, False, None), (False, True, None), (False, True, "keep"),
                                 (False, True, "delete"), (False, False, "keep")):
        argv = mod.uninstall_argv({**_module_defaults(mod), "state": "absent", "uninstall_driver": driver,
                                   "uninstall_engine": engine, "uninstall_engine_data": data}, check_mode)
        assert argv[1:3] == ["--no-wait", "uninstall"]
        params = uninstall.make_context("uninstall", argv[3:]).params
        assert (params["purge_driver"], params["purge_engine"], params["json_out"]) == (driver, engine, True)
        assert (params["dry_run"], params["yes"]) == (check_mode, not check_mode)
        # the engine's data, said only with the purge it is about (alone the CLI refuses it, exit 2)
        assert (params["keep_engine_data"], params["delete_engine_data"]) == (
            engine and data == "keep", engine and data == "delete")


def test_mirror_names_are_the_repository_table():
    assert set(values(Mirror)) == set(repos.BASES)


@pytest.mark.parametrize("option,bad", [("--engine", "cri-o"), ("--kernel-modules", "closed"),
                                        ("--engine-source", "snap"), ("--only", "kernel"),
                                        ("--mirror", "pypi=https://x.invalid")])
def test_cli_rejects_what_the_enums_do_not_list(option, bad):
    r = run_cli("plan", "--root", str(REPO / "tests/fixtures/hosts/h200-vm"), option, bad)
    assert r.returncode == 2, r.stderr


def test_options_hold_only_their_choices():
    """Options is made from options.py's choices: a value outside them never reaches a plan (exit 2, the option
    named), whether from the command line (Options.parse) or from code."""
    from provision.errors import UsageError

    for kw, words in (({"engine": "crio"}, "--engine must be one of " + ", ".join(CHOICES["engine"])),
                      ({"kernel_modules": "both"}, "--kernel-modules must be one of auto, open, proprietary")):
        for make in (Options, Options.parse):
            with pytest.raises(UsageError, match=words):
                make(**kw)
    opt = Options.parse(no_default=True, no_validate=True, only="driver,runtime", mirror=["epel=https://m.example/e"])
    assert (opt.default_runtime, opt.validate, opt.stages, opt.mirrors) == \
        (False, False, ("driver", "runtime"), {"epel": "https://m.example/e"})

"""Option choices are declared once (provision/options.py). The Ansible module cannot import gpuprov (it runs with
the node's Python), so its argument spec, its documentation, the role's argument_specs.yml and defaults/main.yml
are held to the enums here, and the CLI rejects what they do not list."""
from __future__ import annotations

import importlib.util

import pytest
import yaml

from provision.options import CHOICES, Mirror, Stage, values
from provision.plan import repos
from provision.plan.build import Options
from tests.conftest import REPO, run_cli

ROLE = REPO / "roles/gpuprov"


def _module():
    spec = importlib.util.spec_from_file_location("gpuprov_node", ROLE / "library/gpuprov_node.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_module_argument_spec_matches_the_enums():
    mod = _module()
    spec, doc = mod.ARGUMENT_SPEC, yaml.safe_load(mod.DOCUMENTATION)["options"]
    for name, choices in CHOICES.items():
        assert tuple(spec[name]["choices"]) == choices, name
        assert tuple(doc[name]["choices"]) == choices, name
        assert spec[name]["default"] == doc[name]["default"] == getattr(Options(), name), name
    assert tuple(spec["stages"]["choices"]) == values(Stage) == tuple(doc["stages"]["choices"])
    assert set(doc) == set(spec)


def test_role_argument_specs_and_defaults_match_the_enums():
    specs = yaml.safe_load((ROLE / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    module = _module().ARGUMENT_SPEC
    for name, choices in CHOICES.items():
        var = f"gpuprov_{name}"
        assert tuple(specs[var]["choices"]) == choices, var
        assert specs[var]["default"] == defaults[var] == module[name]["default"], var
    assert set(specs) == set(defaults), "every variable is typed in argument_specs.yml and defaulted"


def test_mirror_names_are_the_repository_table():
    assert set(values(Mirror)) == set(repos.BASES)


@pytest.mark.parametrize("option,bad", [("--engine", "podman"), ("--kernel-modules", "closed"),
                                        ("--engine-source", "snap"), ("--only", "kernel"),
                                        ("--mirror", "pypi=https://x.invalid")])
def test_cli_rejects_what_the_enums_do_not_list(option, bad):
    r = run_cli("plan", "--root", str(REPO / "tests/fixtures/hosts/h200-vm"), option, bad)
    assert r.returncode == 2, r.stderr

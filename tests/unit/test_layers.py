"""The layer rules (scripts/arch_report.py: LAYERS, INDEPENDENT) hold for provision/: no package imports from a layer
above its own (bundle and verify never import plan), plan and bundle stay apart, facts and decisions stay apart, and
no two modules import each other, directly or around a circle, beyond the known cycles listed with their reason."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, arch_report

SCRIPT = REPO / "scripts/arch_report.py"
arch = arch_report()


def test_no_forbidden_arrow_and_no_cycle():
    doc = arch.report()
    assert doc["forbidden_arrows"] == []
    assert doc["package_cycles"] == [] and doc["module_cycles"] == []
    assert "plan" not in doc["graph"]["bundle"] and "plan" not in doc["graph"]["verify"]


def test_known_cycles_are_still_there():
    """An exception that no longer applies goes: each known cycle is still a cycle of the module graph."""
    _, modules, *_ = arch.scan()
    found = {tuple(c) for c in arch.cycles(modules)}
    assert set(arch.KNOWN_CYCLES) <= found, "remove these from KNOWN_CYCLES: " + \
        ", ".join(" <-> ".join(c) for c in set(arch.KNOWN_CYCLES) - found)


def test_the_rules_see_what_they_forbid():
    edges = {"bundle": {"plan", "decide"}, "verify": {"plan"}, "facts": {"decide"}, "shiny": {"errors"},
             "plan": {"verify", "facts"}}
    assert arch.layer_violations(edges) == [
        "shiny: on no layer (place it in LAYERS)",
        "verify -> plan: checks imports from use cases, a layer above it",
        "bundle -> plan: " + arch.INDEPENDENT[0][2],
        "facts -> decide: " + arch.INDEPENDENT[1][2],
    ]
    assert arch.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_script_says_so_and_exits_0():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "forbidden arrows: none" in r.stdout and "cycles (modules): none" in r.stdout

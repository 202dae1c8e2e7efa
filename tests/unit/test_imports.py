"""Imports at the top: a function-level import must say what it saves, measured (`# lazy: … N ms …` on its line);
the provision.* package graph has no cycle; `gpuprov` imports only the invoked command's module, so `gpuprov
detect` loads none of the heavy libraries the other commands need, typer included (bench/detect_bench.py times it
against a bare start of the same interpreter: <= 5x)."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys

import typer
from typer.testing import CliRunner

from provision import cli
from provision.commands import COMMANDS
from tests.conftest import REPO, arch_report

FIXTURE_HOST = REPO / "tests/fixtures/hosts/h200-vm"  # a captured GPU host: os-release, PCI, driver
LAZY = re.compile(r"#\s*lazy:.*\d+(\.\d+)?\s*ms")
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _sources():
    for p in sorted((REPO / "provision").rglob("*.py")):
        yield str(p.relative_to(REPO)), p.read_text()


def _parents(tree: ast.AST) -> dict:
    return {ch: node for node in ast.walk(tree) for ch in ast.iter_child_nodes(node)}


def _ancestors(node, parents):
    while node in parents:
        node = parents[node]
        yield node


def _type_checking_only(node, parents) -> bool:
    return any(isinstance(a, ast.If) and "TYPE_CHECKING" in ast.unparse(a.test) for a in _ancestors(node, parents))


def test_function_level_imports_carry_their_measured_cost():
    bad = []
    for rel, src in _sources():
        tree, lines = ast.parse(src), src.splitlines()
        parents = _parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not _type_checking_only(node, parents) and \
                    any(isinstance(a, FUNCS) for a in _ancestors(node, parents)) and not LAZY.search(lines[node.lineno - 1]):
                bad.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("__import__", "importlib.import_module") \
                    and rel != "provision/cli.py":  # cli's command table: see COMMANDS' comment
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node.func)}")
    assert not bad, "move these imports to the module top, or say `# lazy: <what it saves, N ms>`:\n" + "\n".join(bad)


def test_the_guard_sees_what_it_looks_for():
    src = "def f():\n    import json\n    import re  # lazy: 4 ms (-X importtime)\n"
    tree = ast.parse(src)
    parents = _parents(tree)
    flagged = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Import) and
               any(isinstance(a, FUNCS) for a in _ancestors(n, parents)) and not LAZY.search(src.splitlines()[n.lineno - 1])]
    assert flagged == [2]


def package_of(module: str) -> str:
    """provision.facts.pci -> facts; a module at the package's top is its own node (provision.report -> report)."""
    return module.split(".")[1]


def package_graph() -> dict[str, set[str]]:
    """Every import of a provision module (top-level and lazy; `if TYPE_CHECKING:` ones excluded), as package edges;
    plus cli -> commands, which cli imports through its COMMANDS table."""
    edges: dict[str, set[str]] = {"cli": {"commands"}}
    for rel, src in _sources():
        mod = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        if mod == "provision":
            continue
        tree = ast.parse(src)
        parents = _parents(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.level:
                raise AssertionError(f"{rel}:{node.lineno}: relative import; name the module")
            elif node.module == "provision":
                names = [f"provision.{a.name}" for a in node.names]
            else:
                names = [node.module]
            for n in names:
                if n.startswith("provision.") and package_of(n) != package_of(mod) and package_of(n) != "__version__":
                    edges.setdefault(package_of(mod), set()).add(package_of(n))
    return edges


def test_no_package_cycles():
    edges = package_graph()
    print("\nprovision package graph (importer -> imported):")
    for k in sorted(edges):
        print(f"  {k:9} -> {', '.join(sorted(edges[k]))}")
    cycles = arch_report().cycles  # one cycle finder, the layer report's
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
    assert cycles(edges) == []


def _modules() -> list[str]:
    return list(dict.fromkeys(module for module, _ in COMMANDS.values()))


def test_command_table_names_what_each_module_registers():
    registered = {}
    for module in _modules():
        app = typer.Typer()
        importlib.import_module(f"provision.commands.{module}").register(app)
        for name in [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]:
            registered[name] = module
    assert registered == {name: module for name, (module, _) in COMMANDS.items()}
    modules = {p.stem for p in (REPO / "provision/commands").glob("*.py") if "def register(" in p.read_text()}
    assert modules == set(_modules())


def test_the_listing_is_what_the_loaded_modules_print():
    """`gpuprov --help` comes from the table alone; every module loaded prints the very same text."""
    full = cli.new_app()
    for module in _modules():
        importlib.import_module(f"provision.commands.{module}").register(full)
    listed = CliRunner().invoke(cli.listing(), ["--help"], prog_name="gpuprov")
    loaded = CliRunner().invoke(full, ["--help"], prog_name="gpuprov")
    assert listed.exit_code == loaded.exit_code == 0
    assert "k8s " in listed.output and listed.output == loaded.output


def test_command_modules_for_an_invocation():
    assert cli.command_modules(["detect", "--json"]) == ["detect"]
    assert cli.command_modules(["--no-wait", "bootstrap", "--yes"]) == ["plan"]
    assert cli.command_modules(["cdi", "list"]) == ["runtime_cmds"]
    assert cli.command_modules(["k8s", "--help"]) == ["k8s"]
    for args in ([], ["--help"], ["--help", "detect"], ["--version"], ["no-such-command"]):
        assert cli.command_modules(args) == []  # the listing: no command module at all


def test_help_loads_no_command_module():
    code = ("import sys\nfrom provision.cli import main\nrc = main(['--help'])\n"
            "print('\\n'.join(sorted(sys.modules)), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Commands:" in r.stdout, r.stderr[-2000:]
    assert sorted(m for m in r.stderr.split() if m.startswith("provision.commands.")) == []


HEAVY = ("typer", "click", "jinja2", "yaml", "tomlkit", "pynvml", "http.server", "provision.plan", "provision.inject",
         "provision.bundle", "provision.k8s", "provision.engines", "provision.verify", "provision.share",
         # what detect's own records and readers avoid (issue 20, item 7): frozen dataclasses cost ~1 ms a class and
         # their module 6 ms; `distro` 11 ms (read only for CentOS, legacy release files, incomplete os-release)
         "dataclasses", "distro",
         # the live tail of a step's command (provision/progress.py, issue 28 item 8): only a run on a terminal
         "rich", "provision.progress")


def test_detect_loads_only_what_it_needs():
    """Deterministic stand-in for the timing (bench/detect_bench.py): none of the other commands' modules and
    libraries load for `gpuprov detect`, and every command module but detect's stays unloaded."""
    for args in (["--pci-id", "10de:2330", "--target", "debian-12"], ["--root", str(FIXTURE_HOST)]):
        code = (f"import sys\nfrom provision.cli import main\nmain(['detect', '--json', *{args!r}])\n"
                "print('\\n'.join(sorted(sys.modules)), file=sys.stderr)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert '"schema": "gpuprov.detect/v1"' in r.stdout, r.stderr[-2000:]
        loaded = set(r.stderr.split())
        assert {m for m in loaded if m.startswith("provision.commands.")} == {"provision.commands.detect"}
        assert sorted(m for m in loaded if m.startswith(HEAVY)) == [], args

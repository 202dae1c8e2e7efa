"""One adapter per engine owns all of that engine (provision/engines/base.Engine): no module outside provision/engines/
branches on an engine's name. Fails on a comparison (`==`, `!=`, `in`, `not in`, `match`) with an engine-name string
literal, alone or in a tuple/list/set, and on a dict literal keyed by engine names (a table that does the same
branching), anywhere in provision/ but provision/engines/. Adding an engine (podman) then touches engines/ and its
registry line only."""
from __future__ import annotations

import ast
import re

from provision import engines
from provision.engines import base
from tests.conftest import REPO

NAMES = {"docker", "dockerd", "containerd", "crio", "cri-o", "podman"}
# (module, line's code) of the comparisons allowed outside engines/, with why. Keep it empty or very short: an
# engine's behaviour belongs in its adapter.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _names_in(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {n for e in node.elts for n in _names_in(e)}
    return set()


def engine_branches(src: str) -> list[tuple[int, str]]:
    """(line, code) of every engine-name comparison or engine-keyed dict literal in `src`."""
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.match_case):
            operands = [p.value for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue)]
        else:
            continue
        if any(_names_in(o) for o in operands):
            found.append((node.lineno if hasattr(node, "lineno") else node.pattern.lineno, ast.unparse(node)[:120]))
    return found


def test_no_engine_name_branches_outside_the_adapters():
    bad = []
    for path in sorted((REPO / "provision").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith("provision/engines/"):
            continue
        for line, code in engine_branches(path.read_text()):
            if (rel, code) not in EXCEPTIONS:
                bad.append(f"{rel}:{line}: {code}")
    assert not bad, "engine-name branches outside provision/engines/ (ask the engine's adapter instead):\n" + \
        "\n".join(bad)


def test_the_guard_sees_what_it_looks_for():
    src = ('if engine == "docker":\n    pass\n'
           'ok = name in ("containerd", "crio")\n'
           'UNITS = {"cri-o": "crio.service"}\n'
           'match e:\n    case "podman":\n        pass\n'
           'fine = engine == other\n'
           'label = ("docker-", "docker")\n')
    assert [line for line, _ in engine_branches(src)] == [1, 3, 4, 6]


def test_every_adapter_is_registered_and_complete():
    """engines.ADAPTERS is the one registry: each adapter there has its identity and implements the abstract
    methods (it instantiates), names are unique, and `engines.get` finds each one."""
    assert len(set(engines.names())) == len(engines.ADAPTERS)
    for cls in engines.ADAPTERS:
        eng = engines.get(cls.name)
        assert type(eng) is cls and cls.title and cls.daemon_names and cls.default_config.startswith("/")
        assert all(isinstance(p, tuple) and len(p) == 2 for p in cls.cgroup_prefixes)


def test_the_interface_doc_names_what_the_base_class_has():
    """base.py's docstring tells a new adapter what to implement: every name it lists exists on Engine."""
    listed = set(re.findall(r"`([a-z_]+)`", base.__doc__.split("The subclass sets or implements:")[1]))
    assert {"plan", "unplan", "apply", "validation", "node_probe", "cri_handler"} <= listed
    assert sorted(n for n in listed if not hasattr(base.Engine, n) and n not in base.Engine.__annotations__) == []

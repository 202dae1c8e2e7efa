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


# ---------------------------------------------------------------- package managers (issue 29 item 1)
# One adapter per package manager owns all of it (provision/package_managers/base.PackageManager): outside
# provision/package_managers/ no module branches on a package manager's name, nor names one of their commands as an
# argv's head (a tuple or list literal starting with it) or inside a shell script (after `;`, `|`, `&&` or `$(`).
# dpkg-deb, the .deb archive tool a bundle's repository is built with, is not a package manager; `apt` alone is left
# out (prose says "apt" after a semicolon; no code of gpuprov's runs apt's interactive front-end).
PM_NAMES = {"apt", "dnf", "yum"}
PM_COMMANDS = {"apt-get", "apt-mark", "apt-cache", "dpkg", "dpkg-query", "rpm", "dnf", "yum",
               "yum-config-manager", "createrepo_c", "unattended-upgrade"}
_PM_ALTERNATIVES = "|".join(map(re.escape, sorted(PM_COMMANDS, key=len, reverse=True)))
PM_SHELL = re.compile(rf"(?:[;|&]|\$\()\s*(?:{_PM_ALTERNATIVES})\s")
# (module, line's code) allowed outside package_managers/, with why. Keep it empty.
PM_EXCEPTIONS: dict[tuple[str, str], str] = {}


def package_manager_uses(src: str) -> list[tuple[int, str]]:
    """(line, code) of each package-manager-name branch, argv head or shell-script use of a command in `src`."""
    found = []
    tree = ast.parse(src)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if id(node) in prose:  # a docstring says how things work in words
            continue
        if isinstance(node, ast.Compare):
            hit = any(_pm_names_in(o) for o in [node.left, *node.comparators])
        elif isinstance(node, ast.Dict):
            hit = any(_pm_names_in(k) for k in node.keys if k is not None)
        elif isinstance(node, (ast.Tuple, ast.List)):
            hit = bool(node.elts) and isinstance(node.elts[0], ast.Constant) and node.elts[0].value in PM_COMMANDS
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            hit = bool(PM_SHELL.search(node.value))
        else:
            continue
        if hit:
            found.append((node.lineno, ast.unparse(node)[:120]))
    return found


def _pm_names_in(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & PM_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {n for e in node.elts for n in _pm_names_in(e)}
    return set()


def test_no_package_manager_commands_or_branches_outside_the_adapters():
    bad = []
    for path in sorted((REPO / "provision").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith("provision/package_managers/"):
            continue
        for line, code in package_manager_uses(path.read_text()):
            if (rel, code) not in PM_EXCEPTIONS:
                bad.append(f"{rel}:{line}: {code}")
    assert not bad, ("package-manager commands or branches outside provision/package_managers/ (ask the package "
                     "manager's adapter instead):\n" + "\n".join(bad))


def test_the_package_manager_guard_sees_what_it_looks_for():
    src = ('if pm == "apt":\n    pass\n'
           'argv = ("apt-get", "install", "-y")\n'
           'script = "set -e; dpkg-query -W | sort"\n'
           'MAP = {"dnf": 1}\n'
           'fine = Target("x", "apt")\n'
           'msg = "dpkg is consistent (`dpkg --audit` is empty)"\n'
           'also = ["install", "-d", "dpkg"]\n'
           '"""Docstring: `apt-get -s`; dnf erases nothing."""\n')
    assert [line for line, _ in package_manager_uses(src)] == [1, 3, 4, 5]
    # and the adapters themselves are where those commands are: the guard would see them there
    assert package_manager_uses((REPO / "provision/package_managers/apt.py").read_text())


def test_every_package_manager_adapter_is_registered_and_complete():
    """package_managers.ADAPTERS is the one registry; each adapter instantiates (every abstract method is there),
    has its identity, and `get` finds it; every Target's package manager has one."""
    from provision import package_managers
    from provision.decide.targets import TARGETS
    from provision.package_managers import base as pm_base

    assert len(set(package_managers.names())) == len(package_managers.ADAPTERS)
    for cls in package_managers.ADAPTERS:
        pm = package_managers.get(cls.name)
        assert type(pm) is cls and cls.database in ("dpkg", "rpm")
    assert {t.package_manager for t in TARGETS.values()} <= set(package_managers.names())
    listed = set(re.findall(r"`([a-z_]+)`", pm_base.__doc__.split("The subclass sets or implements:")[1]))
    assert sorted(n for n in listed if not hasattr(pm_base.PackageManager, n)
                  and n not in pm_base.PackageManager.__annotations__) == []
    assert {n for n in pm_base.PackageManager.__abstractmethods__} <= listed

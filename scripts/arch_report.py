"""Architecture report: the package dependency graph of provision/ (every import, top-level or inside a function),
the layer rules it must keep (LAYERS, INDEPENDENT), import cycles between modules, imports hidden inside functions,
direct subprocess calls, and the longest functions. tests/unit/test_layers.py holds the code to the rules.
Run: python3 scripts/arch_report.py [--json]   (exit 1 when a rule is broken)"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "provision"

# The layers, top to bottom: a package imports only from its own layer or a lower one. A package on no layer is a
# finding too (a new package is placed here on purpose). `__version__` is a constant every layer may read.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("__main__", "cli")),
    ("commands", ("commands",)),  # thin: parse options, call one use case, print
    ("use cases", ("plan", "bundle")),
    ("checks", ("verify",)),  # below plan: bootstrap's resume verifies the driver with them; verify never imports plan
    ("node services", ("k8s",)),
    ("runtime", ("inject", "share", "metrics")),
    ("engines", ("engines", "probe", "package_managers")),  # the adapters: each engine, each package manager
    ("host report", ("report", "options")),
    ("facts and decisions", ("facts", "decide")),
    ("foundation", ("effects", "progress", "fsutil", "hostlock", "record", "hook_presence", "output", "render", "paths",
                    "values", "versions", "errors")),
)
# Packages on one layer that must not import each other either.
INDEPENDENT: tuple[tuple[str, str, str], ...] = (
    ("plan", "bundle", "a bundle is built and installed without planning a host: bundle never imports plan"),
    ("facts", "decide", "facts are read, decisions are pure: report joins them (ARCHITECTURE.md, data flows one way)"),
)
# Module cycles known and being removed, each with why it is tolerated for now (tests/unit/test_layers.py fails
# once one is gone, so an entry cannot outlive its cycle). None today: inject.discover <-> inject.edits went with
# the typed runtime (issue 20 item 3).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def package_of(mod: str) -> str:
    """provision.facts.pci -> facts; a top-level module is its own node (provision.report -> report)."""
    parts = mod.split(".")
    return parts[1] if len(parts) >= 2 else "(top)"


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The provision modules an import statement loads (`from provision.x import y` is module x.y when y is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or not node.module:
        return []
    subs = [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
    return subs if len(subs) == len(node.names) else [node.module, *subs]


def scan():
    edges: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    hidden, total, sub_calls, funcs = [], 0, [], []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent)
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        src = package_of(mod)
        modules.setdefault(mod, set())
        tree = ast.parse(f.read_text())
        parents = {}
        for node in ast.walk(tree):
            for ch in ast.iter_child_nodes(node):
                parents[ch] = node
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
            if rel.name != "effects.py" and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess" and \
                    node.func.attr in ("run", "Popen", "check_output", "call", "check_call"):
                sub_calls.append(f"{rel}:{node.lineno}")
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for n in _imported(node):
                if not n.startswith("provision"):
                    continue
                total += 1
                p, inner = node, False
                while p in parents:
                    p = parents[p]
                    if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        inner = True
                if inner:
                    hidden.append(f"{rel}:{node.lineno} {n}")
                if n != mod and n != "provision" and not mod.startswith(n + "."):  # a package's own __init__
                    modules[mod].add(n)
                dst = package_of(n)
                if dst != src and dst != "(top)" and src != "(top)":
                    edges.setdefault(src, set()).add(dst)
    return edges, modules, hidden, total, sub_calls, sorted(funcs, reverse=True)


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Every package arrow the rules forbid, and every package on no layer, one line each."""
    rank = {pkg: i for i, (_, pkgs) in enumerate(LAYERS) for pkg in pkgs}
    name = {pkg: layer for layer, pkgs in LAYERS for pkg in pkgs}
    out = [f"{p}: on no layer (place it in LAYERS)" for p in sorted(set(edges) | {d for ds in edges.values()
                                                                                 for d in ds})
           if p not in rank and p != "__version__"]
    for src in sorted(edges):
        for dst in sorted(edges[src]):
            if src in rank and dst in rank and rank[dst] < rank[src]:
                out.append(f"{src} -> {dst}: {name[src]} imports from {name[dst]}, a layer above it")
    for a, b, why in INDEPENDENT:
        out += [f"{x} -> {y}: {why}" for x, y in ((a, b), (b, a)) if y in edges.get(x, ())]
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(out)


def report() -> dict:
    edges, modules, hidden, total, subs, funcs = scan()
    module_cycles = cycles(modules)
    return {"graph": {k: sorted(v) for k, v in sorted(edges.items())},
            "layers": {layer: list(pkgs) for layer, pkgs in LAYERS},
            "forbidden_arrows": layer_violations(edges), "package_cycles": cycles(edges),
            "module_cycles": [c for c in module_cycles if tuple(c) not in KNOWN_CYCLES],
            "known_module_cycles": {" <-> ".join(c): KNOWN_CYCLES[tuple(c)] for c in module_cycles
                                    if tuple(c) in KNOWN_CYCLES},
            "imports": total, "imports_inside_functions": len(hidden), "direct_subprocess_calls": subs,
            "longest_functions": [f"{n:4} {w}" for n, w in funcs[:10]]}


def main() -> int:
    doc = report()
    broken = bool(doc["forbidden_arrows"] or doc["package_cycles"] or doc["module_cycles"])
    if "--json" in sys.argv:
        print(json.dumps(doc, indent=2))
        return int(broken)
    for k, v in doc["graph"].items():
        print(f"{k:10} -> {', '.join(v)}")
    print("layers (top to bottom): " + " | ".join(", ".join(p) for p in doc["layers"].values()))
    print("forbidden arrows:", "none" if not doc["forbidden_arrows"] else "")
    for line in doc["forbidden_arrows"]:
        print("  " + line)
    print("cycles (packages):", doc["package_cycles"] or "none")
    print("cycles (modules):", doc["module_cycles"] or "none")
    for c, why in doc["known_module_cycles"].items():
        print(f"  known, tolerated: {c} ({why})")
    print(f"internal imports: {doc['imports']}, inside functions: {doc['imports_inside_functions']}")
    print(f"direct subprocess calls outside effects.py: {len(doc['direct_subprocess_calls'])}")
    print("longest functions:")
    for line in doc["longest_functions"]:
        print("  " + line)
    return int(broken)


if __name__ == "__main__":
    sys.exit(main())

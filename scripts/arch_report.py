"""Architecture report: the package dependency graph of provision/ (every import, top-level or inside a function),
its cycles, imports hidden inside functions, direct subprocess calls, and the longest functions.
Run: python3 scripts/arch_report.py [--json]"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "provision"


def package_of(mod: str) -> str:
    """provision.facts.pci -> facts; a top-level module is its own node (provision.report -> report)."""
    parts = mod.split(".")
    return parts[1] if len(parts) >= 2 else "(top)"


def scan():
    edges: dict[str, set[str]] = {}
    hidden, total, sub_calls, funcs = [], 0, [], []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent)
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        src = package_of(mod)
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
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if node.level == 0 else []
            if isinstance(node, ast.ImportFrom) and node.module == "provision":
                names = [f"provision.{a.name}" for a in node.names]
            for n in names:
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
                dst = package_of(n)
                if dst != src and dst != "(top)" and src != "(top)":
                    edges.setdefault(src, set()).add(dst)
    return edges, hidden, total, sub_calls, sorted(funcs, reverse=True)


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    def reach(a, b, seen=()):
        return any(n == b or (n not in seen and reach(n, b, (*seen, n))) for n in edges.get(a, ()))
    return sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if reach(b, a)})


def main() -> None:
    edges, hidden, total, subs, funcs = scan()
    doc = {"graph": {k: sorted(v) for k, v in sorted(edges.items())}, "cycles": cycles(edges),
           "imports": total, "imports_inside_functions": len(hidden), "direct_subprocess_calls": subs,
           "longest_functions": [f"{n:4} {w}" for n, w in funcs[:10]]}
    if "--json" in sys.argv:
        print(json.dumps(doc, indent=2))
        return
    for k, v in doc["graph"].items():
        print(f"{k:10} -> {', '.join(v)}")
    print("cycles (packages on a cycle, pairwise):", doc["cycles"] or "none")
    print(f"internal imports: {total}, inside functions: {len(hidden)}")
    print(f"direct subprocess calls outside effects.py: {len(subs)}")
    print("longest functions:")
    for line in doc["longest_functions"]:
        print("  " + line)


if __name__ == "__main__":
    main()

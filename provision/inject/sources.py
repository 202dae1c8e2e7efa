"""The runtime's own source files, derived from the package rather than listed by hand: the editor's entry
modules and every gpuprov module they import (at the top or inside a function), followed through the package with
`ast`, plus the non-Python files `runtime install` ships (shim.c, hook.sh). `runtime install`'s stamp and the warm
editor's "gpuprov was upgraded, exit" check both use this one list, so a change to any file the editor runs
reinstalls the runtime and restarts the editor."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]  # provision/
ENTRIES = ("provision.inject.modify_main", "provision.inject.server", "provision.inject.shim")
EXTRA = ("inject/shim.c", "inject/hook.sh")


def _file(module: str) -> Path | None:
    if module == "provision":
        return PKG / "__init__.py"
    rel = Path(*module.split(".")[1:])
    for cand in (PKG / rel.with_suffix(".py"), PKG / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("provision")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("provision"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from provision.x import module`
    return out


@functools.lru_cache(maxsize=1)
def source_files() -> tuple[Path, ...]:
    seen: dict[str, Path] = {}
    todo = list(ENTRIES)
    while todo:
        mod = todo.pop()
        f = _file(mod)
        if mod in seen or f is None:
            continue
        seen[mod] = f
        parents = [".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)]  # their __init__ runs too
        todo += sorted((_imports(f) | set(parents)) - set(seen))
    files = set(seen.values()) | {PKG / e for e in EXTRA}
    return tuple(sorted(files))

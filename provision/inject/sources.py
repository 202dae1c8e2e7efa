"""The runtime's own source files, derived from the package rather than listed by hand: the editor's entry
modules and every gpuprov module they import (at the top or inside a function), followed through the package,
plus the non-Python files `runtime install` ships (shim.c, hook.sh). `runtime install`'s stamp and the warm
editor's "gpuprov was upgraded, exit" check both use this one list, so a change to any file the editor runs
reinstalls the runtime and restarts the editor."""
from __future__ import annotations

import functools
import re
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


# `import provision.x` / `from provision.x import a, b` / `from provision.x import (a,\n b)`, at any indentation.
# A regular expression, not `ast`: `runtime install`'s check runs this on every bootstrap (parsing ~20 modules with
# ast took 30-120 ms here; this takes ~2 ms). Names that are not modules are dropped by _file().
IMPORT_RE = re.compile(r"^[ \t]*(?:import[ \t]+(provision[\w.]*)|from[ \t]+(provision[\w.]*)[ \t]+import[ \t]+"
                       r"(\([^)]*\)|[^\n#]+))", re.M)


def _imports(path: Path) -> set[str]:
    out = set()
    for plain, module, names in IMPORT_RE.findall(path.read_text()):
        if plain:
            out.add(plain)
            continue
        out.add(module)
        for name in names.strip("()").replace("\n", " ").split(","):  # `from provision.x import module`
            name = name.split(" as ")[0].strip()
            if name.isidentifier():
                out.add(f"{module}.{name}")
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

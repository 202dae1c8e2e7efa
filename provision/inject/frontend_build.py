"""The one recipe that compiles the runtime's front-end (shim.c). Used by the wheel build (setup.py, which loads this
file by path: it must import nothing from gpuprov) and by `gpuprov runtime install` when the wheel has no binary.
It starts no process itself: each caller passes how to run the compiler (gpuprov's through provision.effects)."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "shim.c"


def compile_front_end(out: Path, run: Callable[[list[str]], int], cc: str | None = None) -> str | None:
    """shim.c -> out. Statically linked where the toolchain can (it then runs on any Linux of this architecture
    whatever its glibc, and starts without the dynamic loader), dynamically otherwise. Returns "static", "dynamic",
    or None (no compiler, or it failed). `run(argv)` runs one compiler command and returns its exit status."""
    cc = cc or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    for link in ("static", "dynamic"):
        flags = ["-static"] if link == "static" else []
        cmd = [cc, "-O2", "-s", *flags, str(SOURCE), "-o", str(out)]
        if run(cmd) == 0:
            return link
    return None

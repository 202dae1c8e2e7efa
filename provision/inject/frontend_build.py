"""The one recipe that compiles the runtime's front-end (shim.c). Used by the wheel build (setup.py, which loads this
file by path: it must import nothing from gpuprov) and by `gpuprov runtime install` when the wheel has no binary.
It starts no process itself: each caller passes how to run the compiler (gpuprov's through provision.effects)."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "shim.c"
ENTRY = "gpuprov_entry"
LINKS = (("static", ("-static", f"-Wl,-e,{ENTRY}", f"-Wl,--require-defined={ENTRY}")), ("static", ("-static",)),
         ("dynamic", ()))


def compile_front_end(out: Path, run: Callable[[list[str]], int], cc: str | None = None) -> str | None:
    """shim.c -> out. Statically linked where the toolchain can (it then runs on any Linux of this architecture
    whatever its glibc, and starts without the dynamic loader), dynamically otherwise. A static build enters at
    shim.c's gpuprov_entry where that exists (x86_64, aarch64: runc's commands that need no edit are handed over
    before the C library starts, ~0.3 ms sooner; --require-defined fails the link elsewhere, and the next recipe
    builds it without). Returns "static", "dynamic", or None (no compiler, or it failed). `run(argv)` runs one
    compiler command and returns its exit status."""
    cc = cc or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    for link, flags in LINKS:
        cmd = [cc, "-O2", "-s", *flags, str(SOURCE), "-o", str(out)]
        if run(cmd) == 0:
            return link
    return None

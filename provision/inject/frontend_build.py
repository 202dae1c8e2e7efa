"""The one recipe that compiles the runtime's front-end (shim.c). Used by the wheel build (setup.py, which loads this
file by path: it must import nothing from gpuprov) and by `gpuprov runtime install` when the wheel has no binary."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "shim.c"


def compile_front_end(out: Path, cc: str | None = None) -> str | None:
    """shim.c -> out. Statically linked where the toolchain can (it then runs on any Linux of this architecture
    whatever its glibc, and starts without the dynamic loader), dynamically otherwise. Returns "static", "dynamic",
    or None (no compiler, or it failed)."""
    cc = cc or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    for link in ("static", "dynamic"):
        flags = ["-static"] if link == "static" else []
        cmd = [cc, "-O2", "-s", *flags, str(SOURCE), "-o", str(out)]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return link
    return None

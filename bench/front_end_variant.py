#!/usr/bin/env python3
"""A front-end built from a patched copy of this tree's shim.c, for timing one idea against the shipped front-end on
a GPU host without changing the product (issue 41): start_cost_device.sh's VARIANT=NAME=OUT installs it beside
gpuprov's, sharing its warm editor, and runtime_bench times it as one more runtime. The slots stay empty (the
install fills them, as it does the wheel's binary); built static, as the wheel's is.

Variants:
- spin: the front-end polls for the editor's reply with a zero timeout instead of sleeping in ppoll, so its CPU
  stays busy (not idle, not handed to another task) for the ~1 ms the editor works, and runc is exec'd on a CPU
  that never slept.

Usage: python3 bench/front_end_variant.py NAME OUT.bin"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (shim.c text, its replacement): each must occur exactly once
    "spin": ("""        long ready = RAW_PPOLL(&pfd, &ts);
        if (ready == -EINTR) continue;""",
             """        if (sent >= len) ts.tv_sec = 0, ts.tv_nsec = 0; /* the spin variant: never sleep on the reply */
        long ready = RAW_PPOLL(&pfd, &ts);
        if (ready == -EINTR || (ready == 0 && sent >= len)) continue;"""),
}


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in VARIANTS:
        print(__doc__.rsplit("Usage: ", 1)[1].strip(), f"(NAME: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    old, new = VARIANTS[sys.argv[1]]
    out = Path(sys.argv[2]).resolve()
    with tempfile.TemporaryDirectory() as td:
        tree = Path(td)
        shutil.copytree(REPO / "provision", tree / "provision", ignore=shutil.ignore_patterns("__pycache__", "*.bin"))
        shim = tree / "provision/inject/shim.c"
        text = shim.read_text()
        if text.count(old) != 1:
            print(f"{sys.argv[1]}: shim.c no longer holds the text this variant patches", file=sys.stderr)
            return 1
        shim.write_text(text.replace(old, new))
        sys.path.insert(0, str(tree))  # that tree's frontend_build compiles that tree's shim.c
        from provision.inject.frontend_build import compile_front_end
        from provision.inject.install import _compile

        if compile_front_end(out, _compile) != "static":
            print("no static build here (a compiler with a static C library is needed)", file=sys.stderr)
            return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""gpuprov's start-up against a bare start of the interpreter it runs on, in the same run, interleaved.

The reference is the interpreter named in the `gpuprov` script's shebang (the venv's python) started bare,
`PY -c pass`. Each round runs every case once (the sides' order alternating), so a busy machine slows all of them
alike; wall and CPU (user+sys of the child and what it waited for) medians are printed.

- `gpuprov detect --json` (this host's own /), `gpuprov --help`, 100 `--pci-id` lookups in one call;
- the runtime's cold editor: `PY -I -S provision/inject/modify_main.py BUNDLE` (this checkout's) for one GPU
  container on the fake H200 driver root (root only: its device nodes are made with mknod; skipped otherwise),
  also against `PY -I -S -c pass`, a bare start with the flags the compiled front-end starts it with;
- `--before GPUPROV`: another install's gpuprov in the same rounds, against its own interpreter; its cold editor is
  the modify_main.py of the provision package that interpreter imports (its install's own copy).

Targets (issue 20): detect --json and --help <= 5x the bare start, the cold editor <= 5x the bare start with its
own flags (`PY -I -S -c pass`) (wall medians); issue 2's 100 lookups in one call <= 250 ms.
Usage: python3 bench/detect_bench.py [-n 20] [--gpuprov PATH] [--before GPUPROV] [--json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import report  # noqa: E402

try:
    from tests.inject_helpers import gpu_bundle, write_settings  # noqa: E402
except ImportError:  # the test helpers need pytest: without it, no cold-editor case
    gpu_bundle = write_settings = None

IDS = ["10de:2330", "10de:1db4", "10de:2335:10de:18bf", "10de:0fc0", "10de:2901"] * 20  # 100 lookups
LOOKUP_ARGS = [a for i in IDS for a in ("--pci-id", i)]
RATIO, LOOKUP_MS = 5.0, 250
# As on a host: the warm-up rounds leave .pyc files (a shell with PYTHONDONTWRITEBYTECODE=1 would have every run
# compile its modules again, tens of ms that no installed gpuprov pays).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def gpuprov_script(given: str | None) -> Path:
    """The gpuprov to time: --gpuprov, else the one beside this interpreter, else the first on PATH."""
    found = given or (str(Path(sys.executable).with_name("gpuprov")) if Path(sys.executable).with_name("gpuprov").exists()
                      else shutil.which("gpuprov"))
    if not found:
        raise SystemExit("no gpuprov script found: pass --gpuprov PATH")
    return Path(found)


def interpreter(script: Path) -> str:
    """The interpreter the script runs on: its shebang's (`#!/venv/bin/python3`, or `#!/usr/bin/env python3`)."""
    line = script.read_bytes().split(b"\n", 1)[0].decode()
    if not line.startswith("#!"):
        raise SystemExit(f"{script}: no shebang")
    argv = line[2:].split()
    return shutil.which(argv[1]) if Path(argv[0]).name == "env" else argv[0]


def run_once(argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of one run (CPU: the child's user+sys, what it waited for included)."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env or CHILD_ENV)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv[:4])} … failed (exit {os.waitstatus_to_exitcode(status)})")
    return wall, ru.ru_utime + ru.ru_stime


def editor_file(side: str, py: str) -> str:
    """This checkout's modify_main.py; for another side, the one of the provision package its interpreter imports
    (-I: not this checkout's, which a plain `-c` would find first, in the current directory)."""
    if side == "this":
        return str(REPO / "provision/inject/modify_main.py")
    where = subprocess.run([py, "-I", "-c", "import os, provision; print(os.path.dirname(provision.__file__))"],
                           capture_output=True, text=True, check=True, env=CHILD_ENV).stdout.strip()
    return os.path.join(where, "inject/modify_main.py")


def editor_case(py: str, work: Path, editor: str):
    """The cold editor's argv and environment (a fresh GPU bundle each run), or None when not root. Each side has its
    own settings and discovery cache (another version's cache would be a miss, rebuilt on every run)."""
    if os.geteuid() != 0 or gpu_bundle is None:
        return None
    work.mkdir(parents=True, exist_ok=True)
    settings = write_settings(work)
    template = (gpu_bundle(work, "template") / "config.json").read_text()
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(settings)}

    def prepare(i: int) -> list[str]:
        bundle = gpu_bundle(work, f"cold-{i}")
        (bundle / "config.json").write_text(template)
        return [py, "-I", "-S", editor, str(bundle)]
    return prepare, env


def measure(sides: dict[str, tuple[Path, str]], n: int, work: Path) -> dict[str, list[tuple[float, float]]]:
    """Every case of every side once per round, rounds alternating the sides' order; each side's cold editor once
    per round."""
    cases: dict[str, list[str]] = {}
    for side, (script, py) in sides.items():
        gp = [str(script)]
        cases.update({f"{side}:bare": [py, "-c", "pass"], f"{side}:detect": gp + ["detect", "--json"],
                      f"{side}:help": gp + ["--help"], f"{side}:lookup100": gp + ["detect", "--json", "--target",
                                                                                  "debian-12", *LOOKUP_ARGS]})
    editors = {}
    for side, (_, py) in sides.items():
        editor = editor_case(py, work / side, editor_file(side, py))
        if editor:
            cases[f"{side}:bare_isolated"] = [py, "-I", "-S", "-c", "pass"]
            editors[f"{side}:editor"] = editor
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in [*cases, *editors]}
    for i in range(n + 2):  # 2 warm-up rounds: page cache, .pyc files, the engine-version cache
        for k, argv in (list(cases.items()) if i % 2 else list(cases.items())[::-1]):
            sample = run_once(argv)
            if i >= 2:
                times[k].append(sample)
        for k, (prepare, env) in (list(editors.items()) if i % 2 else list(editors.items())[::-1]):
            sample = run_once(prepare(i), env)
            if i >= 2:
                times[k].append(sample)
    return times


REF = {"detect": "bare", "help": "bare", "lookup100": "bare", "editor": "bare"}
LABELS = {"bare": "python -c pass", "bare_isolated": "python -I -S -c pass", "detect": "gpuprov detect --json",
          "help": "gpuprov --help", "lookup100": "100 --pci-id lookups", "editor": "cold editor, 1 GPU"}


def summary(times: dict[str, list[tuple[float, float]]]) -> tuple[dict, dict, list[str]]:
    """Medians, ratios to the side's bare start, and the lines that print them."""
    med = {k: {"wall_ms": round(statistics.median(w for w, _ in v) * 1000, 1),
               "cpu_ms": round(statistics.median(c for _, c in v) * 1000, 1)} for k, v in times.items()}
    ratios: dict[str, dict] = {}
    lines = []
    for k, m in med.items():
        side, case = k.split(":")
        line = f"{side:6} {LABELS[case]:24} {m['wall_ms']:7.1f} ms ({m['cpu_ms']:6.1f} ms)"
        if case in REF:
            ref = med[f"{side}:{REF[case]}"]
            ratios[k] = {u: round(m[u] / ref[u], 2) for u in ("wall_ms", "cpu_ms")}
            line += f"  {ratios[k]['wall_ms']:5.2f}x ({ratios[k]['cpu_ms']:.2f}x) its bare start"
            if case == "editor":  # the editor runs isolated (-I -S): its target is against a bare start so started
                iso = med[f"{side}:bare_isolated"]
                ratios[f"{side}:editor_vs_isolated"] = {u: round(m[u] / iso[u], 2) for u in ("wall_ms", "cpu_ms")}
                line += (f"; {ratios[f'{side}:editor_vs_isolated']['wall_ms']:.2f}x "
                         f"({ratios[f'{side}:editor_vs_isolated']['cpu_ms']:.2f}x) python -I -S -c pass")
            line += f"; target <= {LOOKUP_MS} ms" if case == "lookup100" else f"; target <= {RATIO:g}x"
        else:
            line += "  (reference)"
        lines.append(line)
    return med, ratios, lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--gpuprov", help="the gpuprov script to time (default: beside this python, else on PATH)")
    ap.add_argument("--before", metavar="GPUPROV", help="another gpuprov script (an older install) timed in the same "
                    "rounds, against its own interpreter")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scripts = {"this": gpuprov_script(args.gpuprov), **({"before": Path(args.before)} if args.before else {})}
    sides = {side: (script, interpreter(script)) for side, script in scripts.items()}
    work = Path(tempfile.mkdtemp(prefix="gpuprov-detect-bench-"))
    try:
        times = measure(sides, args.n, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med, ratios, lines = summary(times)
    res = {"sides": {side: {"gpuprov": str(s), "interpreter": py} for side, (s, py) in sides.items()}, "n": args.n,
           "median": med, "vs_bare": ratios, "targets": {"detect_help_editor_vs_bare": RATIO, "lookup100_ms": LOOKUP_MS}}
    res["ok"] = all(ratios[f"this:{k}"]["wall_ms"] <= RATIO for k in ("detect", "help", "editor_vs_isolated")
                    if f"this:{k}" in ratios) and med["this:lookup100"]["wall_ms"] <= LOOKUP_MS
    head = [f"{side}: {s} on {py}" for side, (s, py) in sides.items()]
    head.append(f"medians of {args.n} rounds, wall (cpu: user+sys)")
    if "this:editor" not in med:
        lines.append("cold editor: not measured (needs root for the fake driver root's device nodes, and pytest)")
    return report(res, head + lines, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

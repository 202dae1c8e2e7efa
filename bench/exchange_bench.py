#!/usr/bin/env python3
"""What the exchange with the warm editor costs a GPU create, without the edit (issue 41): the compiled front-end
asks an editor whose edit answers at once ("0\\t\\n"), and execs /bin/true; against the same front-end on a no-GPU
bundle (no exchange at all). Shuffled rounds (seed printed), each create --gap-ms after the one before (the editor's
code goes cold between real starts, which are seconds apart).

Servers, each on its own socket, timed in the same rounds:
- `after`: this checkout's server.py (its accept loop, reads, timers and upgrade check; only `handle` replaced);
- `before`: --before REV's server.py, the same way;
- `c_echo`: a C server that reads the line and writes the answer (cc needed): the floor of the exchange itself.

Usage (root): python3 bench/exchange_bench.py [-n 200] [--gap-ms 20] [--before REV] [--json]"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _timing import bundle_dir, quantile, revision_tree  # noqa: E402
from create_split import side  # noqa: E402

from tests.inject_helpers import settings_dict  # noqa: E402
from tests.oci import make_config, write_bundle  # noqa: E402

# The side's server.py, run as the warm editor runs it from an editor copy (no code stamps; `current` names it).
SERVER = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
os.environ["GPUPROV_RUNTIME_CONFIG"] = sys.argv[2]
import provision.inject.server as s
assert s.__file__.startswith(sys.argv[1]), s.__file__
link = sys.argv[2] + ".current"
os.symlink("copy", link)
s.handle = lambda data: "0\t\n"
s._upgrade_stamp = lambda: None
s._copy_replaced = lambda: os.readlink(link) != "copy"
raise SystemExit(s.serve(s.socket_path()))
'''
C_ECHO = r'''
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {0};
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
    unlink(argv[1]);
    umask(077);
    if (argc < 2 || bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 128)) return 1;
    char buf[16384];
    for (;;) {
        int c = accept(s, 0, 0);
        if (c < 0) continue;
        if (read(c, buf, sizeof buf) > 0 && write(c, "0\t\n", 3) < 0) {}
        close(c);
    }
}
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=20)
    ap.add_argument("--before", default=None, help="git revision (or a directory holding its provision/)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    true = shutil.which("true")
    work = Path(tempfile.mkdtemp(prefix="gpuprov-exchange-", dir=bundle_dir()))
    image = work / "image/rootfs"
    for d in ("usr/lib/x86_64-linux-gnu", "usr/bin", "etc", "dev", "tmp"):
        (image / d).mkdir(parents=True, exist_ok=True)
    settings = {**settings_dict(work), "runc": true}
    trees = {"after": REPO}
    if args.before:
        trees["before"] = Path(args.before).resolve() if Path(args.before).is_dir() else \
            revision_tree(REPO, args.before, work)
    servers: list[subprocess.Popen] = []
    cases: dict[str, tuple[str, dict[str, str], list[str]]] = {}
    exe, env = side("nogpu", REPO, work, settings)
    cases["nogpu"] = (exe, env, [])
    for name, tree in trees.items():
        exe, env = side(name, tree, work, settings)
        servers.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", SERVER, str(tree),
                                         env["GPUPROV_RUNTIME_CONFIG"]]))
        cases[name] = (exe, env, ["NVIDIA_VISIBLE_DEVICES=all"])
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        (work / "echo.c").write_text(C_ECHO)
        subprocess.run([cc, "-O2", "-o", str(work / "echo"), str(work / "echo.c")], check=True)
        exe, env = side("c_echo", REPO, work, settings)
        servers.append(subprocess.Popen([str(work / "echo"), env["GPUPROV_RUNTIME_CONFIG"] + ".sock"]))
        cases["c_echo"] = (exe, env, ["NVIDIA_VISIBLE_DEVICES=all"])
    times: dict[str, list[float]] = {k: [] for k in cases}
    log = work / "log.json"

    def once(key: str, i: int) -> float:
        exe, env, asks = cases[key]
        b = write_bundle(work / f"{key}-{i}", make_config(str(image), ["/bin/true"], asks))
        argv = [exe, "--root", str(work / "state"), "--log", str(log), "--log-format", "json", "create",
                "--bundle", str(b), f"s{i}"]
        time.sleep(args.gap_ms / 1e3)
        t0 = time.perf_counter()
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env)
        dt = time.perf_counter() - t0
        if r.returncode != 0 or r.stderr:  # an editor that did not answer: the front-end edited directly
            raise SystemExit(f"{key}: exit {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
        shutil.rmtree(b)
        return dt

    try:
        time.sleep(1.0)  # the servers are listening
        for i in range(5):
            for key in cases:
                once(key, -1 - i)
        for i in range(args.n):
            order = list(cases)
            rng.shuffle(order)
            for key in order:
                times[key].append(once(key, i))
    finally:
        for p in servers:
            p.kill()
            p.wait()
    med = {k: quantile(v, 0.5) * 1e3 for k, v in times.items()}
    out = {"seed": seed, "n": args.n, "gap_ms": args.gap_ms, "before": args.before,
           "median_ms": {k: round(v, 3) for k, v in med.items()},
           "exchange_ms": {k: round(v - med["nogpu"], 3) for k, v in med.items() if k != "nogpu"}}
    print(json.dumps(out, indent=2) if args.json else
          f"seed {seed} n={args.n} gap {args.gap_ms} ms: the exchange over a no-GPU create (ms): {out['exchange_ms']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

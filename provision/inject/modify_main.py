"""Entry for the compiled shim: `python3 -I -S modify_main.py BUNDLE`. Isolated mode ignores PYTHON* env and
user site-packages; the package root is put on sys.path from this file's location."""
import gc
import os
import sys

# A process of ~50 ms that builds no garbage cycles worth finding: the cyclic collector's ~25 passes over what the
# imports create cost ~2-3 ms of a cold start (bench/detect_bench.py). Objects are still freed by their refcounts.
gc.disable()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from provision.inject.shim import run_create_edits  # noqa: E402

# argv: BUNDLE [LOG [LOG_FORMAT [--spawn-server]]] (runc's --log/--log-format, so refusals reach the engine's
# error message; --spawn-server: no warm editor was listening, leave one behind for the next containers)
rc = run_create_edits(sys.argv[1], *(a or None for a in sys.argv[2:4]))
if "--spawn-server" in sys.argv[4:]:
    # only a create that leaves an editor behind loads the server (socket, fcntl…)
    from provision.inject.server import spawn_detached  # lazy: 3.6 ms (-X importtime -I -S, min of 15)

    gc.enable()  # the server it forks lives on: it collects as any process does
    spawn_detached()
# Out without the interpreter's teardown (freeing each of the ~100 modules and all they built: ~5 ms of a cold start,
# bench/detect_bench.py). Nothing is left to close: every file was written through fsutil or in a `with` block; only
# the standard streams' buffers remain, written out here as at a normal exit (a failing one is ignored, as there).
for stream in (sys.stdout, sys.stderr):
    try:
        if stream is not None:  # None: started with that descriptor closed
            stream.flush()
    except (OSError, ValueError):
        pass
os._exit(rc)

"""`gpuprov metrics`: GPU and per-container GPU metrics in Prometheus text format (stdout, a node-exporter textfile,
or a local HTTP endpoint)."""
from __future__ import annotations

import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from provision.commands import summary
from provision.errors import UsageError
from provision.fsutil import SHARED_DIR_HELP, SHARED_DIR_OPTION, write_file
from provision.metrics import nvml, usage
from provision.options import rule
from provision.output import emit_json, progress
from provision.values import listen_address

TEXTFILE_NAME = "gpuprov.prom"


def _collect() -> str:
    from provision.metrics import prom  # lazy: prometheus_client, 66 ms (-X importtime, min of 6); --json needs none

    snap = nvml.snapshot()
    return prom.render(snap, usage.by_container(snap), socket.gethostname())


def serve(host: str, port: int, collect=_collect, stop=None) -> None:
    """Serve /metrics until interrupted (or `stop`, a threading.Event, is set); every scrape takes a fresh reading.
    A host that does not resolve is exit 2, a port in use exit 5 (metrics/server.py: deadlines, bounded clients)."""
    # only --listen serves; the textfile and stdout modes run often (a timer) and need none of it
    from provision.metrics.server import Server, bind  # lazy: 2.5 ms (-X importtime, min of 15: selectors)

    srv = Server(bind(host, port), collect)
    bound = srv.sock.getsockname()
    progress(f"serving GPU metrics on http://{f'[{host}]' if ':' in host else host}:{bound[1]}/metrics")
    try:
        srv.serve_forever(stop)
    finally:
        srv.close()


def write_textfile(directory: str, text: str, shared_dir_ok: bool = False) -> str:
    """Atomically replace DIR/gpuprov.prom (node-exporter's textfile collector reads only *.prom, so the temporary
    dot-file beside it is never read half-written). Collector directories are often not root's: a link planted
    there is refused, and a directory others can write only with --allow-shared-dir (fsutil)."""
    path = Path(directory) / TEXTFILE_NAME
    write_file(path, text, mode=0o644, backup=False, keep_mode=False, shared_dir_ok=shared_dir_ok)
    return str(path)


def metrics_cmd(
    textfile: Optional[str] = typer.Option(None, "--textfile", metavar="DIR", callback=rule("path"),
                                           help="Write DIR/gpuprov.prom atomically (node-exporter textfile collector)."),
    listen: Optional[str] = typer.Option(None, "--listen", metavar="HOST:PORT", callback=rule("listen"),
                                         help="Serve /metrics over HTTP, e.g. 127.0.0.1:9400."),
    interval: float = typer.Option(0, "--interval", help="With --textfile: rewrite every N seconds until stopped."),
    json_out: bool = typer.Option(False, "--json", help="The readings as JSON instead of Prometheus text."),
    allow_shared_dir: bool = typer.Option(False, SHARED_DIR_OPTION, help=SHARED_DIR_HELP),
) -> None:
    """Per-GPU utilisation, memory, temperature, power, ECC and Xid errors, and GPU memory and utilisation per
    container (DCGM-exporter and cAdvisor metric names)."""
    if not 0 <= interval < float("inf"):  # nan, inf, a negative wait: never a sleep that fails or never ends
        raise UsageError(f"--interval {interval!r}: a number of seconds, 0 or more")
    if listen:
        serve(*listen_address(listen))
        return
    if json_out:
        snap = nvml.snapshot()
        emit_json({"schema": "gpuprov.metrics/v1", **asdict(snap),
                   "containers": [{**asdict(u), "ref": u.ref.to_dict()} for u in usage.by_container(snap)]})
        return
    if textfile:
        while True:
            write_textfile(textfile, _collect(), shared_dir_ok=allow_shared_dir)
            if interval <= 0:
                return
            time.sleep(interval)

    sys.stdout.write(_collect())


def register(app: typer.Typer) -> None:
    app.command("metrics", short_help=summary("metrics"))(metrics_cmd)

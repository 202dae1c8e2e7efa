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
from provision.fsutil import write_file
from provision.metrics import nvml, prom, usage
from provision.options import rule
from provision.output import emit_json, progress

TEXTFILE_NAME = "gpuprov.prom"


def _collect() -> str:
    snap = nvml.snapshot()
    return prom.render(snap, usage.by_container(snap), socket.gethostname())


def _parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen {text!r}: use HOST:PORT, e.g. 127.0.0.1:9400")
    return host.strip("[]"), int(port)


def serve(host: str, port: int, collect=_collect) -> None:
    """Serve /metrics until interrupted; every scrape takes a fresh reading."""
    # only --listen serves; the textfile and stdout modes run often (a timer) and need none of it
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # lazy: 17.5 ms (-X importtime, min of 15)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body, code = collect().encode(), 200
            except Exception as exc:  # noqa: BLE001 - a failed reading is a 500 for this scrape, not a dead server
                body, code = f"# gpuprov metrics failed: {exc}\n".encode(), 500
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes are not worth a line each on stderr
            pass

    srv = ThreadingHTTPServer((host, port), Handler)

    progress(f"serving GPU metrics on http://{host}:{srv.server_address[1]}/metrics")
    try:
        srv.serve_forever()
    finally:
        srv.server_close()


def write_textfile(directory: str, text: str) -> str:
    """Atomically replace DIR/gpuprov.prom (node-exporter's textfile collector reads only *.prom, so the temporary
    dot-file beside it is never read half-written)."""
    path = Path(directory) / TEXTFILE_NAME
    write_file(path, text, mode=0o644, backup=False, keep_mode=False)
    return str(path)


def metrics_cmd(
    textfile: Optional[str] = typer.Option(None, "--textfile", metavar="DIR", callback=rule("path"),
                                           help="Write DIR/gpuprov.prom atomically (node-exporter textfile collector)."),
    listen: Optional[str] = typer.Option(None, "--listen", metavar="HOST:PORT",
                                         help="Serve /metrics over HTTP, e.g. 127.0.0.1:9400."),
    interval: float = typer.Option(0, "--interval", help="With --textfile: rewrite every N seconds until stopped."),
    json_out: bool = typer.Option(False, "--json", help="The readings as JSON instead of Prometheus text."),
) -> None:
    """Per-GPU utilisation, memory, temperature, power, ECC and Xid errors, and GPU memory and utilisation per
    container (DCGM-exporter and cAdvisor metric names)."""
    if listen:
        host, port = _parse_listen(listen)
        serve(host, port)
        return
    if json_out:
        snap = nvml.snapshot()
        emit_json({"schema": "gpuprov.metrics/v1", **asdict(snap),
                   "containers": [{**asdict(u), "ref": u.ref.to_dict()} for u in usage.by_container(snap)]})
        return
    if textfile:
        while True:
            write_textfile(textfile, _collect())
            if interval <= 0:
                return
            time.sleep(interval)

    sys.stdout.write(_collect())


def register(app: typer.Typer) -> None:
    app.command("metrics", short_help=summary("metrics"))(metrics_cmd)

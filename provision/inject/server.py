"""A warm editor for the compiled front-end: the same edits as modify_main.py, without a Python start-up per
container. The front-end connects to a root-only unix socket; when nothing listens it runs the editor directly,
which then leaves this server behind (detached, minimal environment) for the next containers. The server exits
after IDLE_SECONDS without requests, or as soon as gpuprov's runtime code on disk changes (an upgrade)."""
from __future__ import annotations

import os
import socket
import sys

IDLE_SECONDS = 600
DEFAULT_SOCKET = "/run/gpuprov/runtime-editor.sock"


def socket_path() -> str:
    # Mirrors shim.c: tests that point GPUPROV_RUNTIME_CONFIG elsewhere get their own server.
    cfg = os.environ.get("GPUPROV_RUNTIME_CONFIG")
    return f"{cfg}.sock" if cfg else DEFAULT_SOCKET


def _code_stamp() -> float:
    here = os.path.dirname(os.path.abspath(__file__))
    return max(os.stat(os.path.join(here, n)).st_mtime for n in ("modify.py", "edits.py", "discover.py", "server.py"))


def serve(path: str) -> None:
    from provision.inject.shim import run_create_edits

    stamp = _code_stamp()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    old = os.umask(0o077)  # the socket is root's alone: only the engine's runtime may ask for edits
    try:
        srv.bind(tmp)
    finally:
        os.umask(old)
    srv.listen(64)
    os.replace(tmp, path)  # atomic: clients never see a half-made socket
    srv.settimeout(IDLE_SECONDS)
    while True:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            break
        with conn:
            conn.settimeout(30)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(8192)
                if not chunk:
                    break
                data += chunk
            parts = data.decode(errors="replace").rstrip("\n").split("\t")
            if len(parts) != 3 or not parts[0]:
                conn.sendall(b"1\n")
                continue
            import io

            err, sys.stderr = sys.stderr, io.StringIO()  # the refusal text goes back to the front-end's stderr
            try:
                rc = run_create_edits(parts[0], parts[1] or None, parts[2] or None)
                msg = sys.stderr.getvalue().replace("\n", " ").strip()
            finally:
                sys.stderr = err
            conn.sendall(f"{rc}\t{msg}\n".encode())
        if _code_stamp() != stamp:
            break  # upgraded on disk: let the next container start a fresh server
    try:
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(srv.fileno()).st_ino:
            os.unlink(path)
    except OSError:
        pass
    srv.close()


def spawn_detached() -> None:
    """Double-fork a server with no terminal, stdio on /dev/null, and the environment we were given (minimal)."""
    if os.fork() != 0:
        return
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(socket_path())
    finally:
        os._exit(0)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else socket_path())

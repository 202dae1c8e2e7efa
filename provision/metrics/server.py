"""The metrics HTTP endpoint (`gpuprov metrics --listen`): one thread, one selector, every connection on a deadline,
so slow or idle clients cost a file descriptor for a bounded time, never a thread, and never starve a scrape.

- Bounded: at most `limit` connections at once (below the process's fd limit). One more closes the oldest connection
  that has not finished sending its request; a scraper sends its request at once, so it is never the one closed.
- Deadlines: a connection has READ_TIMEOUT_S to send its whole request and WRITE_TIMEOUT_S to take the answer.
- At the fd limit (EMFILE/ENFILE) accepting frees the oldest waiting connection and goes on; with none to free it
  pauses ACCEPT_PAUSE_S: never a busy loop on `accept`.
- Scrapes are answered one at a time in arrival order (a reading is one NVML pass); answers are HTTP/1.1 with
  `Connection: close`.

Why not prometheus_client's own server (issue 28 item 15 asked): the body is the library's (`prom.render`:
generate_latest), the serving is not. `start_http_server` is a `ThreadingWSGIServer` (wsgiref): one thread per
connection, no limit on their number, and no deadline on reading a request (its handler sets no timeout). The
clients of tests/faults/test_metrics_server.py (hundreds that connect and send nothing, one byte every few seconds,
or never read the answer) would each hold a thread for as long as they like. Measured (prometheus_client 0.26, this
machine): 300 idle connections made 300 threads, all still there 13 s later (here: dropped after READ_TIMEOUT_S);
test_a_silent_client_is_dropped_after_the_read_timeout and the fd-limit test need the bounded, deadlined loop below."""
from __future__ import annotations

import errno
import resource
import selectors
import socket
import time

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from provision.errors import StepFailed, UsageError

READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
ACCEPT_PAUSE_S = 0.2
MAX_REQUEST = 8192  # request line and headers; a scrape's are a few hundred bytes
MAX_CLIENTS = 512
FD_RESERVE = 32  # fds left for the reading itself (NVML, /proc) and the listener
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the format generate_latest writes


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (a name, IPv4 or IPv6 address). A host that does not resolve is a usage
    error (exit 2); a port in use or an address this host does not have is exit 5."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--listen {where}: the host does not resolve ({exc}); use an address or a name this "
                         "host resolves, e.g. 127.0.0.1:9400 or [::1]:9400") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart while old connections linger
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise StepFailed(f"--listen {where}: cannot listen there ({exc.strerror}); choose a free port, or stop what "
                         "holds it") from None
    sock.setblocking(False)
    return sock


def fd_bound() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(4, min(MAX_CLIENTS, soft - FD_RESERVE)) if soft != resource.RLIM_INFINITY else MAX_CLIENTS


class _Conn:
    __slots__ = ("sock", "request", "answer", "deadline")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.request, self.answer, self.deadline = sock, b"", None, deadline


def response(request: bytes, collect) -> bytes:
    """The answer to one request (its line and headers)."""
    line = request.split(b"\n", 1)[0].decode("latin-1").split()
    if len(line) != 3 or not line[2].startswith("HTTP/"):
        code, body = 400, "bad request\n"
    elif line[0] not in ("GET", "HEAD"):
        code, body = 405, "only GET\n"
    elif line[1].split("?")[0] not in ("/metrics", "/"):
        code, body = 404, "not found: the metrics are at /metrics\n"
    else:
        try:
            code, body = 200, collect()
        except Exception as exc:  # noqa: BLE001 - a failed reading is a 500 for this scrape, not a dead server
            code, body = 500, f"# gpuprov metrics failed: {exc}\n"
    data = body.encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}
    head = (f"HTTP/1.1 {code} {reason[code]}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode()
    return head if line[:1] == ["HEAD"] else head + data


class Server:
    def __init__(self, sock: socket.socket, collect, limit: int | None = None):
        self.sock, self.collect, self.limit = sock, collect, limit or fd_bound()
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.conns: dict[socket.socket, _Conn] = {}  # in order of arrival: the first waiting one is the oldest
        self.paused_until = 0.0

    def serve_forever(self, stop=None) -> None:
        """Until interrupted (or `stop`, a threading.Event, is set: tests)."""
        while stop is None or not stop.is_set():
            self.step()

    def step(self) -> None:
        now = time.monotonic()
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            self.sel.register(self.sock, selectors.EVENT_READ, None)
        wake = min([c.deadline for c in self.conns.values()] + [self.paused_until or now + 1.0, now + 1.0])
        for key, _ in self.sel.select(max(0.0, wake - now)):
            if key.data is None:
                self._accept()
            elif key.data.answer is None:
                self._read(key.data)
            else:
                self._write(key.data)
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections, then the others' turn
            try:
                sock, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and not self._free_one():
                    self.sel.unregister(self.sock)  # nothing to free: wait, instead of spinning on accept
                    self.paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    return
                continue  # freed one (or the peer gave up, ECONNABORTED): accept the next
            if len(self.conns) >= self.limit and not self._free_one():
                sock.close()  # every slot is answering a scrape: this one comes back later
                continue
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + READ_TIMEOUT_S)
            self.conns[sock] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _free_one(self) -> bool:
        """Close the oldest connection still sending its request (an idle or slow client)."""
        oldest = next((c for c in self.conns.values() if c.answer is None), None)
        if oldest is not None:
            self._close(oldest)
        return oldest is not None

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.request += data
        if b"\r\n\r\n" not in conn.request and b"\n\n" not in conn.request:
            if len(conn.request) > MAX_REQUEST:
                self._close(conn)
            return
        conn.answer = response(conn.request, self.collect)
        conn.deadline = time.monotonic() + WRITE_TIMEOUT_S
        self.sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.answer)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        conn.answer = conn.answer[sent:]
        if not conn.answer:
            try:
                conn.sock.shutdown(socket.SHUT_WR)  # the whole answer is queued: end it, then let go
            except OSError:
                pass
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self.conns.pop(conn.sock, None) is not None:
            self.sel.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        self.sel.close()
        self.sock.close()

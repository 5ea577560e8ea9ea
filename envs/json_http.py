"""The HTTP side shared by tokengym's JSON endpoints (the rollout worker, ``tokengym serve``, an agent env's endpoint).

A threaded stdlib server whose backlog holds a batch of clients connecting at once (the default of 5 refuses some),
whose threads do not keep a finished process alive, and which does not print a traceback for a client that went away;
and a handler that speaks HTTP/1.1 keep-alive with ``TCP_NODELAY``, so a reply's headers and body leave together
(written apart, Nagle's algorithm against the client's delayed ACKs holds the body back ~40 ms).

A handler may also bound what one client can hold (opt-in class attributes, see :class:`JsonHandler`): how many
connections are served at once (the rest are answered 503 and closed, so the server's threads stay bounded), how
long a request may take to arrive, and the size and nesting depth of a JSON body (:meth:`JsonHandler.read_json`).
"""

from __future__ import annotations

import io
import json
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["JsonHandler", "ThreadedServer", "BadRequest", "error_reply", "too_deep", "log_line"]


class BadRequest(Exception):
    """A request refused while its body is read: the HTTP status and one line saying why."""

    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code = code


def error_reply(code: int, text: str) -> bytes:
    """A whole HTTP/1.1 reply ``{"error": text}`` that closes the connection, for a socket answered before (or
    instead of) a handler: the connection bound's 503, a TLS worker's refusal of the other protocol."""
    body = json.dumps({"error": text}).encode()
    return (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


_LOG_LOCK = threading.Lock()


def log_line(text: str) -> None:
    """``text`` as one whole line on stderr: a server's handler threads log at once, and ``print`` writes the
    newline apart, so two lines could be glued together."""
    with _LOG_LOCK:
        sys.stderr.write(f"{text}\n")
        sys.stderr.flush()


class ThreadedServer(ThreadingHTTPServer):
    """One thread per connection, at most ``RequestHandlerClass.max_connections`` of them (None: no bound)."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, *args: Any, **kwargs: Any):
        self.open_connections, self._count = 0, threading.Lock()
        super().__init__(*args, **kwargs)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        limit = getattr(self.RequestHandlerClass, "max_connections", None)
        with self._count:
            full = limit is not None and self.open_connections >= limit
            if not full:
                self.open_connections += 1
        if not full:
            return super().process_request(request, client_address)
        try:  # (never blocks the accepting thread: a reply that does not fit at once is dropped with the connection)
            request.settimeout(0)
            request.sendall(error_reply(503, f"the server holds {limit} connections, its limit; try again"))
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.open_connections -= 1


class _Deadline(io.RawIOBase):
    """A connection's reading side where each request must arrive whole within ``seconds`` of the handler starting to
    wait for it (a client that sends nothing, or drips a byte now and then, gets ``TimeoutError``); writes keep the
    socket blocking (a reply is not timed: only a caller past the door gets one worth waiting for)."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.seconds = sock, seconds
        self.restart()

    def readable(self) -> bool:
        return True

    def restart(self, seconds: float | None = None) -> None:
        self.allowed = self.seconds if seconds is None else seconds
        self.until = time.monotonic() + self.allowed

    def readinto(self, b: Any) -> int:
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self.allowed:g} s")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(b)
        finally:
            self.sock.settimeout(None)


def too_deep(data: bytes, limit: int) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects more than ``limit`` levels deep (checked before it is
    parsed: the parser recurses once a level). Strings are left out first; each pass then drops the innermost
    brackets, so at most ``limit + 1`` passes over what is left."""
    brackets = re.sub(rb'"[^"\\]*(?:\\.[^"\\]*)*"', b"", data, flags=re.S).translate(None, delete=_NOT_BRACKETS)
    brackets, depth = brackets.translate(_ROUND), 0
    while brackets and depth <= limit:
        shorter = brackets.replace(b"()", b"")
        if len(shorter) == len(brackets):  # unbalanced (not JSON): what is left opens a level at each "("
            return depth + shorter.count(b"(") > limit
        brackets, depth = shorter, depth + 1
    return depth > limit


_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_ROUND = bytes.maketrans(b"[]{}", b"()()")


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive, JSON replies, no access log (each server logs what it refuses itself).

    Opt-in bounds (class attributes; None: unbounded): ``max_connections`` served at once (see
    :class:`ThreadedServer`), ``read_timeout`` seconds for a request's line and headers to arrive (then as long again,
    plus a second per MB, for its body), and for :meth:`read_json` ``max_body`` bytes and ``max_depth`` levels.
    """

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    max_connections: int | None = None
    read_timeout: float | None = None
    max_body: int | None = None
    max_depth: int | None = None

    def setup(self) -> None:
        super().setup()
        self.deadline = None
        if self.read_timeout is not None:
            self.deadline = _Deadline(self.connection, self.read_timeout)
            self.rfile.close()  # (the socket's own reader: closed, or the socket outlives its close)
            self.rfile = io.BufferedReader(self.deadline)

    def handle_one_request(self) -> None:
        if self.deadline is not None:
            self.deadline.restart()  # (a kept-alive connection's wait for its next request counts too)
        super().handle_one_request()

    def log_message(self, fmt: str, *args: Any) -> None:  # each server logs what it refuses itself
        pass

    def body_length(self) -> int:
        """The body's length from its one ``Content-Length`` (none: 0); :class:`BadRequest` (400) for a chunked body,
        a length that is not a number, or several that differ (RFC 9112: never guess which one frames the body)."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise BadRequest(400, "a body sent with Transfer-Encoding is not read here; send a Content-Length")
        given = [v.strip() for h in self.headers.get_all("Content-Length") or () for v in h.split(",")]
        if not given:
            return 0
        if len(set(given)) > 1:
            raise BadRequest(400, f"conflicting Content-Length headers ({', '.join(given)})")
        if not re.fullmatch(r"[0-9]{1,19}", given[0]):
            raise BadRequest(400, f"Content-Length {given[0][:40]!r} is not a number of bytes")
        return int(given[0])

    def read_json(self) -> Any:
        """The request's body as JSON (empty: None), within ``max_body`` bytes and ``max_depth`` levels; else
        :class:`BadRequest` (400, or 413 for a body over the limit) and this connection ends with the reply (the
        rest of the body is never read). A client gone mid-body raises ``ConnectionError``."""
        try:
            n = self.body_length()
            if self.max_body is not None and n > self.max_body:
                raise BadRequest(413, f"a message of {n} bytes is over the limit of {self.max_body}")
        except BadRequest:
            self.close_connection = True
            raise
        if self.deadline is not None:  # the body's own limit: one more second per MB (a large one on a slow link)
            self.deadline.restart(self.read_timeout + n / 1e6)
        data = self.rfile.read(n) if n else b""
        if len(data) < n:
            self.close_connection = True
            raise ConnectionResetError(f"the client left after {len(data)} of {n} bytes")
        if not data:
            return None
        if self.max_depth is not None and too_deep(data, self.max_depth):
            raise BadRequest(400, f"the message nests more than {self.max_depth} levels deep")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:
            raise BadRequest(400, f"the message is not JSON: {e}") from None

    def send_body(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, code: int, out: Any) -> None:
        self.send_body(code, json.dumps(out).encode())

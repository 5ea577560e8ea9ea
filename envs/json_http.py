"""The HTTP side shared by tokengym's JSON endpoints (the rollout worker, ``tokengym serve``, an agent env's endpoint).

A threaded stdlib server whose backlog holds a batch of clients connecting at once (the default of 5 refuses some),
whose threads do not keep a finished process alive, and which does not print a traceback for a client that went away;
and a handler that speaks HTTP/1.1 keep-alive with ``TCP_NODELAY``, so a reply's headers and body leave together
(written apart, Nagle's algorithm against the client's delayed ACKs holds the body back ~40 ms).

A handler may also bound a JSON body's size and nesting depth (:meth:`JsonHandler.read_json`; opt-in class attributes).
"""

from __future__ import annotations

import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["JsonHandler", "ThreadedServer", "BadRequest", "too_deep"]


class BadRequest(Exception):
    """A request refused while its body is read: the HTTP status and one line saying why."""

    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code = code


class ThreadedServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


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

    Opt-in bounds for :meth:`read_json` (class attributes; None: unbounded): ``max_body`` bytes and ``max_depth``
    levels of nesting.
    """

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    max_body: int | None = None
    max_depth: int | None = None

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
            raise BadRequest(400, f"the request has conflicting Content-Length headers ({', '.join(given)})")
        if not re.fullmatch(r"[0-9]{1,19}", given[0]):
            raise BadRequest(400, f"Content-Length {given[0][:40]!r} is not a number of bytes")
        return int(given[0])

    def read_json(self) -> Any:
        """The request's body as JSON (empty: None), within ``max_body`` bytes and ``max_depth`` levels; else
        :class:`BadRequest` (400, or 413 for a body over the limit) and this connection ends with the reply (the
        rest of the body is never read)."""
        try:
            n = self.body_length()
            if self.max_body is not None and n > self.max_body:
                raise BadRequest(413, f"a message of {n} bytes is over the limit of {self.max_body}")
        except BadRequest:
            self.close_connection = True
            raise
        data = self.rfile.read(n) if n else b""
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

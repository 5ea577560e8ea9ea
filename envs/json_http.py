"""The HTTP side shared by tokengym's JSON endpoints (the rollout worker, ``tokengym serve``, an agent env's endpoint).

A threaded stdlib server whose backlog holds a batch of clients connecting at once (the default of 5 refuses some),
whose threads do not keep a finished process alive, and which does not print a traceback for a client that went away;
and a handler that speaks HTTP/1.1 keep-alive with ``TCP_NODELAY``, so a reply's headers and body leave together
(written apart, Nagle's algorithm against the client's delayed ACKs holds the body back ~40 ms).
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["JsonHandler", "ThreadedServer"]


class ThreadedServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, fmt: str, *args: Any) -> None:  # each server logs what it refuses itself
        pass

    def send_body(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, code: int, out: Any) -> None:
        self.send_body(code, json.dumps(out).encode())

"""The OpenAI-compatible endpoint of an agent env: each episode's calls reach it at ``<base>/e/<episode>/v1``.

Over loopback HTTP (the default: a threaded stdlib server on ``127.0.0.1``, so any agent, in this process or another,
or in another language, reaches its episode by ``base_url``), or in process through :class:`InProcess`, an ``httpx``
transport that hands the request to the same :meth:`AgentServer.dispatch` without a socket. Every request carries the
server's Bearer secret.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hmac
import json
import secrets
import threading
from typing import Any

import httpx

from tokengym.envs.json_http import BadRequest, JsonHandler, ThreadedServer
from tokengym.envs.openai_api import APIError, error_body, model_list

__all__ = ["AgentServer", "InProcess", "AsyncInProcess"]

Reply = tuple[int, dict[str, Any]]


class AgentServer:
    """Routes ``/e/<episode>/v1/chat/completions`` to ``episodes[episode].call(body)`` (a future of the reply) and
    answers ``/v1/models``. ``serve()`` starts the HTTP side on ``host:port`` (0: a free port)."""

    def __init__(self, models: list[str], secret: str | None = None):
        self.models, self.secret = list(models), secret or secrets.token_hex(16)
        self.episodes: dict[str, Any] = {}
        self.httpd: ThreadedServer | None = None
        self.lock = threading.Lock()

    def add(self, eid: str, episode: Any) -> None:
        with self.lock:
            self.episodes[eid] = episode

    def drop(self, eid: str) -> None:
        with self.lock:
            self.episodes.pop(eid, None)

    def dispatch(self, method: str, path: str, auth: str | None, body: bytes) -> cf.Future:
        """A future of ``(status, json body)`` for one request."""
        done: cf.Future = cf.Future()
        try:
            if not hmac.compare_digest((auth or "").encode(), f"Bearer {self.secret}".encode()):
                raise APIError(401, "missing or wrong API key (Authorization: Bearer <the env's secret>)",
                               "authentication_error", "invalid_api_key")
            parts = path.split("?", 1)[0].strip("/").split("/")
            if parts[:1] == ["e"] and len(parts) >= 3:
                eid, parts = parts[1], parts[2:]
            else:
                eid = None
            if method == "GET" and parts == ["v1", "models"]:
                done.set_result((200, model_list(self.models)))
                return done
            if method != "POST" or parts != ["v1", "chat", "completions"]:
                raise APIError(404, f"{method} {path}: not served here (POST <base_url>/chat/completions, GET "
                                    "<base_url>/models)", code="not_found")
            if eid is None:
                raise APIError(404, f"{path}: no episode in the path; an agent env's base_url is <server>/e/<episode>/v1",
                               code="not_found")
            with self.lock:
                episode = self.episodes.get(eid)
            if episode is None:
                raise APIError(410, f"episode {eid} is over (or never was): its calls are no longer answered",
                               code="episode_over")
            try:
                request = json.loads(body or b"{}")
            except ValueError as e:
                raise APIError(400, f"the request body is not JSON: {e}") from None
            return episode.call(request)
        except APIError as e:
            done.set_result((e.status, error_body(e)))
        return done

    # ------------------------------------------------------------------ over HTTP
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the HTTP side (once); return its base address ``http://host:port``."""
        if self.httpd is None:
            server = self

            class Handler(JsonHandler):
                def _handle(self) -> None:
                    try:  # one plain Content-Length (RFC 9112), else a 400 and this connection ends unread
                        n = self.body_length()
                    except BadRequest as e:
                        self.close_connection = True
                        return self.send_json(e.code, error_body(APIError(e.code, str(e))))
                    status, out = server.dispatch(self.command, self.path, self.headers.get("Authorization"),
                                                  self.rfile.read(n) if n else b"").result()
                    self.send_json(status, out)

                do_GET = do_POST = _handle

            self.httpd = ThreadedServer((host, port), Handler)
            threading.Thread(target=self.httpd.serve_forever, name="tokengym-agent-server", daemon=True).start()
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


def _response(request: httpx.Request, status: int, out: dict[str, Any]) -> httpx.Response:
    return httpx.Response(status, json=out, request=request)


class InProcess(httpx.BaseTransport):
    """An ``httpx`` transport that answers from an :class:`AgentServer` in this process, without a socket."""

    def __init__(self, server: AgentServer):
        self.server = server

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        fut = self.server.dispatch(request.method, request.url.raw_path.decode(), request.headers.get("Authorization"),
                                   request.read())
        return _response(request, *fut.result())


class AsyncInProcess(httpx.AsyncBaseTransport):
    """:class:`InProcess` for ``httpx.AsyncClient`` (``openai.AsyncOpenAI``): the call waits without a thread."""

    def __init__(self, server: AgentServer):
        self.server = server

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        fut = self.server.dispatch(request.method, request.url.raw_path.decode(), request.headers.get("Authorization"),
                                   body)
        return _response(request, *(await asyncio.wrap_future(fut)))



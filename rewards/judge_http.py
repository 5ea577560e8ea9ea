"""The HTTP side of :class:`~tokengym.rewards.judge.JudgeReward`: one batch of chat (or text) completion requests to an
OpenAI-compatible server, at most ``max_concurrency`` in flight, each with a timeout and retries with exponential
backoff, and a cache of answered requests keyed on the full request (url and body), so that a completion seen again in
a run is not judged twice. Nothing here raises for a failed request: it comes back as an error line, counted by the
caller. The API key goes into the ``Authorization`` header only: it is in no message or ``repr`` (a pickle, for a rollout
worker process, carries it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .common import read_secret_file

__all__ = ["Answer", "JudgeClient", "read_api_key"]

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try (overload, a gateway's hiccup); any other error status is final."""


@dataclass
class Answer:
    """What one request gave: the reply ``text`` or an ``error`` line, the ``requests`` it took (tries, 0 when the
    cache answered) and whether the cache answered (``cached``)."""

    text: str | None
    error: str | None
    requests: int
    cached: bool = False


def read_api_key(api_key_env: str | None, api_key_file: str | None) -> str | None:
    """The API key from file ``api_key_file`` (refused when any user may read it) or else environment variable
    ``api_key_env`` (unset or empty: no key, as a local server needs none). ValueError in one line otherwise."""
    if api_key_file is not None:
        return read_secret_file(api_key_file, "api_key_file")
    return os.environ.get(api_key_env) or None if api_key_env else None


class JudgeClient:
    """Posts request bodies to ``url`` (``.../chat/completions`` or ``.../completions``) and reads the first choice's
    text; see the module docstring. ``httpx`` (the ``judge`` extra) is imported when the first batch is sent."""

    def __init__(self, url: str, *, api_key: str | None, timeout: float, retries: int, backoff: float,
                 max_concurrency: int, cache_size: int):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.max_concurrency, self.cache_size = max_concurrency, cache_size
        self._key = api_key
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._http: Any = None

    def __getstate__(self) -> dict[str, Any]:  # a worker process gets its own connections and an empty cache
        state = dict(self.__dict__, _http=None, _lock=None, _cache=OrderedDict())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        return f"JudgeClient({self.url!r}, timeout={self.timeout:g}, retries={self.retries})"

    def _client(self) -> Any:
        if self._http is None:
            try:
                import httpx
            except ImportError:
                raise ImportError("the judge reward needs httpx: pip install 'tokengym[judge]'") from None
            headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
            self._http = httpx.Client(headers=headers, timeout=self.timeout,
                                      limits=httpx.Limits(max_connections=self.max_concurrency))
        return self._http

    def close(self) -> None:
        """Close the connections (a later batch opens new ones)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def ask(self, bodies: list[dict[str, Any]]) -> list[Answer]:
        """One :class:`Answer` per body, in order; identical bodies are sent once, cached ones not at all."""
        keys = [json.dumps([self.url, b], sort_keys=True) for b in bodies]
        todo: dict[str, dict[str, Any]] = {}
        done: dict[str, Answer] = {}
        with self._lock:
            for k, b in zip(keys, bodies):
                if k in self._cache:
                    self._cache.move_to_end(k)
                    done[k] = Answer(self._cache[k], None, 0, cached=True)
                elif k not in todo:
                    todo[k] = b
        if todo:
            client = self._client()
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(todo))) as pool:
                fresh = dict(zip(todo, pool.map(lambda b: self._one(client, b), todo.values())))
            with self._lock:
                for k, a in fresh.items():
                    if a.error is None and self.cache_size > 0:
                        self._cache[k] = a.text
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
            done.update(fresh)
        out, first = [], set()
        for k in keys:  # a body repeated within the batch: its later copies are cache hits of the first
            a = done[k]
            if k in first and not a.cached:
                a = Answer(a.text, a.error, 0, cached=a.error is None)
            first.add(k)
            out.append(a)
        return out

    def _one(self, client: Any, body: dict[str, Any]) -> Answer:
        """Send one body, retrying timeouts, lost connections and :data:`RETRY_STATUS` answers ``retries`` times."""
        import httpx

        error = "no request"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = client.post(self.url, json=body)
            except httpx.TimeoutException:
                error = f"timed out after {self.timeout:g} s"
                continue
            except httpx.HTTPError as e:  # refused, reset, ...: the key is in no message of these
                error = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:200].strip()}"
                if r.status_code in RETRY_STATUS:
                    continue
                return Answer(None, error, attempt + 1)
            try:
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                if not isinstance(text, str):
                    raise TypeError(f"the reply's content is {type(text).__name__}")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                return Answer(None, f"a reply that is not an OpenAI completion ({type(e).__name__}: {e})", attempt + 1)
            return Answer(text, None, attempt + 1)
        return Answer(None, error, self.retries + 1)

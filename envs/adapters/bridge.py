"""A program that asks a model for turns, suspended at each ask until a token episode answers it.

Agent code (an OpenAI-client agent, a verifiers rollout loop) drives its own loop and calls a model when it wants a
turn. A token env drives the other way: it generates a turn, then asks for the reply. :class:`Suspended` joins the two:
the program's side calls :meth:`Suspended.ask` (from any thread or, with ``asyncio.wrap_future``, a coroutine) and
waits; the env's side takes the request with :meth:`Suspended.next`, generates, and answers with
:meth:`Suspended.answer`. The program ends with :meth:`Suspended.finish` (its result) or :meth:`Suspended.fail`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Any

__all__ = ["Loop", "Suspended"]


class Loop:
    """One event loop on a daemon thread, where the async programs of a task run."""

    def __init__(self, name: str = "tokengym-agents") -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()


class Suspended:
    """The meeting point of one program and its token episode (see the module docstring)."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._event: cf.Future = cf.Future()  # the program's next event: ("ask", request) or ("done", result)
        self._answer: cf.Future | None = None
        self._lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------ the program's side
    def ask(self, request: Any) -> cf.Future:
        """Ask for a turn; the returned future gets the env's answer. One ask at a time: a second one while the first
        is out fails its future with ``RuntimeError``."""
        answer: cf.Future = cf.Future()
        with self._lock:
            if self.closed:
                answer.set_exception(RuntimeError("the episode is over"))
                return answer
            if self._answer is not None and not self._answer.done():
                answer.set_exception(RuntimeError("a call is already waiting for its turn: one call at a time"))
                return answer
            self._answer = answer
            self._set(("ask", request))
        return answer

    def finish(self, result: Any) -> None:
        with self._lock:
            self._set(("done", result))

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._set(("error", error))

    def _set(self, event: tuple[str, Any]) -> None:
        if not self._event.done():
            self._event.set_result(event)

    # ------------------------------------------------------------------ the env's side
    def next(self) -> tuple[str, Any]:
        """The program's next event, ``("ask", request)``, ``("done", result)`` or ``("error", exception)``; raises
        ``TimeoutError`` past ``timeout``."""
        try:
            return self._event.result(timeout=self.timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"no call and no result within {self.timeout:g} s") from None

    def answer(self, value: Any = None, error: BaseException | None = None) -> None:
        """Answer the ask taken by :meth:`next` (a value, or an exception for the program to raise)."""
        with self._lock:
            answer, self._event = self._answer, cf.Future()
        if answer is not None and not answer.done():
            answer.set_exception(error) if error is not None else answer.set_result(value)

    def close(self, error: BaseException | None = None) -> None:
        """End the meeting: an ask still out fails with ``error`` (or "the episode is over"); later asks fail too."""
        with self._lock:
            self.closed = True
            answer = self._answer
        if answer is not None and not answer.done():
            answer.set_exception(error or RuntimeError("the episode is over"))

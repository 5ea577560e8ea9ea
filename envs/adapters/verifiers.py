"""``verifiers`` environments (Prime Intellect's Environments Hub) as tokengym tasks (extra: ``tokengym[verifiers]``).

A verifiers environment runs its own rollout loop against a model client: its parser and rubric, its
``env_response`` and stop hooks, its ``setup_state`` and cleanup. This adapter runs that loop unchanged
(``Environment.run_rollout``) with a client whose "model" is the token episode: each time the loop asks the model,
the request waits for the agent's turn in the token env, and the messages the environment added since the agent's
last turn (its ``env_response``) are the reply. When the loop ends, the rubric's score is a turn reward on the
agent's last token. Single-turn environments (``SingleTurnEnv``) end after the first turn.

This is the classic environment API (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv``, parsers and rubrics),
which verifiers 0.1 to 0.3 ship (0.3 keeps it as ``verifiers.legacy``; 0.4 dropped it). Environments whose rubric
calls a judge model, or whose tools run in remote sandboxes, need those services at run time.
"""

from __future__ import annotations

import asyncio
from typing import Any, Hashable

import numpy as np

from .bridge import Loop, Suspended
from .episodes import EpisodeTask, Turn, require

__all__ = ["VerifiersTask"]


def _legacy() -> Any:
    vf = require("verifiers", "verifiers", "VerifiersTask")
    if not hasattr(vf, "MultiTurnEnv"):  # verifiers 0.4 kept only its new (v1) stack
        raise ImportError(f"VerifiersTask needs the classic verifiers API (0.1 to 0.3), found verifiers "
                          f"{getattr(vf, '__version__', '?')}: pip install 'tokengym[verifiers]'")
    return vf


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if isinstance(part, dict) else str(getattr(part, "text", "")) for part in content)


def _as_dicts(messages: Any) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"}`` dicts (verifiers keeps them as pydantic models)."""
    out = []
    for m in messages:
        role = m["role"] if isinstance(m, dict) else m.role
        out.append({"role": str(role), "content": _text(m["content"] if isinstance(m, dict) else m.content)})
    return out


class _Rollout:
    """One verifiers rollout, suspended whenever it asks its model for a turn (:class:`~.bridge.Suspended`)."""

    def __init__(self, task: "VerifiersTask", row: dict[str, Any]):
        vf = _legacy()
        self.bridge, self.seen = Suspended(task.reply_timeout), 0
        rollout = self

        class TokenEpisodeClient(vf.Client):
            """The model of the rollout: the agent of the token episode."""

            def setup_client(self, config: Any) -> None:
                return None

            async def to_native_tool(self, tool: Any) -> Any:
                return tool

            async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
                return messages, {}

            async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                          **kwargs: Any) -> str:
                return await asyncio.wrap_future(rollout.bridge.ask(prompt))

            async def raise_from_native_response(self, response: Any) -> None:
                return None

            async def from_native_response(self, response: str) -> Any:
                message = vf.types.ResponseMessage(content=response, finish_reason="stop", is_truncated=False)
                return vf.types.Response(id="tokengym", created=0, model="tokengym", message=message)

            async def close(self) -> None:
                return None

        run = task.env.run_rollout(row, TokenEpisodeClient(None), "tokengym", {})
        self._task = asyncio.run_coroutine_threadsafe(self._run(run), task._loop.loop)

    async def _run(self, run: Any) -> None:
        try:
            out = await run
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits for this rollout
            self.bridge.fail(e)
            raise
        self.bridge.finish(out)

    def _next(self) -> tuple[str, Any]:
        try:
            kind, payload = self.bridge.next()
        except TimeoutError as e:
            raise TimeoutError(f"the verifiers rollout did not answer: {e}") from None
        if kind == "error":
            raise payload
        return kind, payload

    def first(self) -> list[dict[str, str]]:
        kind, payload = self._next()
        if kind != "ask":
            raise ValueError("the verifiers environment ended its rollout before asking the model anything")
        messages = _as_dicts(payload)
        self.seen = len(messages)
        return messages

    def step(self, action: str) -> Turn:
        self.bridge.answer(action)
        kind, payload = self._next()
        if kind == "ask":
            messages = _as_dicts(payload)
            new, self.seen = messages[self.seen + 1:], len(messages)  # after the agent's own message
            return Turn("\n\n".join(m["content"] for m in new))
        completion = _as_dicts(payload.get("completion") or [])
        after = len(completion) - next((i for i, m in enumerate(reversed(completion)) if m["role"] == "assistant"),
                                       len(completion))
        final = "\n\n".join(m["content"] for m in completion[after:]) or None  # a final env_response, if any
        return Turn(final, float(payload.get("reward") or 0.0), True)

    def close(self) -> None:
        self.bridge.close()
        if not self._task.done():
            self._task.cancel()


class VerifiersTask(EpisodeTask):
    """A verifiers environment (an instance, or an installed environment's id for ``vf.load_environment``) as a task.

    Prompts are the rows of its dataset (``eval=True``: its eval dataset), drawn uniformly by the env's generator;
    the prompt is the environment's own (system prompt and few-shot included).

    Args:
        env: a ``vf.Environment`` or the id of an installed verifiers environment.
        env_args: keyword arguments of ``vf.load_environment`` when ``env`` is an id.
        eval: use the eval dataset instead of the train dataset.
        num_examples: rows to use (``-1``: all).
        chat: chat prompts (the default, as verifiers environments are chat environments) or their text.
        **options: :class:`~tokengym.envs.adapters.episodes.EpisodeTask` options (``max_new_tokens``, ...).
    """

    def __init__(self, env: Any, env_args: dict[str, Any] | None = None, *, eval: bool = False,
                 num_examples: int = -1, chat: bool = True, **options: Any):
        vf = _legacy()
        if isinstance(env, str):
            env = vf.load_environment(env, **(env_args or {}))
        if not isinstance(env, vf.Environment):
            raise TypeError(f"VerifiersTask: env must be a verifiers Environment or an environment id, got {type(env).__name__}")
        dataset = env.get_eval_dataset(num_examples) if eval else env.get_dataset(num_examples)
        self.env, self.rows = env, [dict(r) for r in dataset]
        if not self.rows:
            raise ValueError(f"VerifiersTask: {type(env).__name__} has no {'eval ' if eval else ''}rows")
        self._loop = Loop("tokengym-verifiers")
        super().__init__(f"verifiers/{env.env_id or type(env).__name__}", chat=chat, **options)

    def draw(self, rng: np.random.Generator) -> Hashable:
        return int(rng.integers(len(self.rows)))

    def start(self, key: Hashable) -> tuple[list[dict[str, str]], _Rollout]:
        rollout = _Rollout(self, {**self.rows[int(key)], "example_id": int(key)})  # type: ignore[call-overload]
        return rollout.first(), rollout

    def __repr__(self) -> str:
        return f"VerifiersTask({type(self.env).__name__}, rows={len(self.rows)})"

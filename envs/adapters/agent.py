"""Any agent written against the OpenAI client as a token env: its calls to the model are the episode's agent turns.

The agent is a function, sync or ``async``, given an ``openai`` client and one sample of the data; it returns the
episode's reward (or ``None`` to leave scoring to ``reward(messages, sample)``). Each ``chat.completions.create`` call
it makes waits for the token env: the first call's messages (and ``tools``) are the episode's prompt; the model's
tokens for the turn are the actions; the call returns an ordinary ``ChatCompletion`` (content, ``tool_calls`` parsed
from the model's text, ``finish_reason`` ``stop``, ``tool_calls`` or ``length``, and usage). The messages a later call
adds after the model's turn are the env's reply, tokenized as a delta onto the episode (nothing the model generated is
ever re-tokenized), so the tokens trained on are the tokens sampled.

**History rule.** A call must repeat the episode's messages so far, then add new ones (an agent appends; the
assistant messages it echoes back are compared as text and parsed tool calls). A call that drops, edits or summarises
an earlier message is refused with ``BadRequestError`` naming the turn and the message, and the episode ends there:
its tokens up to that turn are trained as sampled, and it counts in ``agent/errors``.

A call's sampling settings (``temperature``, ``max_tokens``, ...) are the trainer's: the env ignores them.

**Bad agents.** An agent that raises, returns something that is not a finite number (or ``None`` with no reward
function), never calls the model, or asks for a model the env does not serve ends its episode with reward 0, counted
in ``agent/errors``; one silent past ``turn_timeout`` counts in ``agent/timeouts``. A call whose messages do not fit
the episode's token budget is refused (``context_length_exceeded``) and counts in ``env/reply_overflows``. Each also
warns one line naming it. The run goes on with every other episode.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import math
import numbers
import os
import threading
import uuid
import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from tokengym.envs.multiturn import Reply
from tokengym.envs.openai_api import (APIError, chat_completion, check_chat_request, check_tools, error_body,
                                      same_message, text_of)
from tokengym.envs.tasks.base import Task
from tokengym.rewards.common import TokengymWarning

from .agent_server import AgentServer, AsyncInProcess, InProcess
from .bridge import Loop, Suspended
from .chat_format import ChatFormat, PlainFormat, TemplateFormat
from .episodes import EpisodeTask, no_outcome, require

__all__ = ["AgentTask", "agent_env", "agent_task_class", "AGENT_EVENTS"]

AGENT_EVENTS = ("agent_errors", "agent_timeouts")
"""The per-row counts an agent env adds to a multi-turn env's (logged as ``agent/errors`` and ``agent/timeouts``)."""


class _Failed(Exception):
    """An agent that ended its episode: ``event`` is the count it adds (an :data:`AGENT_EVENTS` name, or
    ``reply_overflows``)."""

    def __init__(self, event: str, why: str, setting: bool = False):
        super().__init__(why)
        self.event, self.setting = event, setting  # setting: a request that can never work (bad tools, streaming)


def _load_rows(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, (str, os.PathLike)):
        with open(data, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = list(data)
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        raise ValueError(f"agent env data must be a non-empty list of dicts, a JSONL file of them, or a Task, got "
                         f"{data!r:.80}")
    return [dict(r) for r in rows]


def agent_env(data: Any = None, **options: Any) -> Callable[[Callable], Callable]:
    """Mark an agent function as an env, with its data and :class:`AgentTask` options; ``--env module:function`` then
    finds them (a plain function takes them from ``--env-kwargs``)."""

    def mark(fn: Callable) -> Callable:
        fn.tokengym_agent = {"data": data, **options}  # type: ignore[attr-defined]
        return fn

    return mark


def agent_task_class(agent: Callable, resolve: Callable[[str], Task] | None = None) -> type["AgentTask"]:
    """The :class:`AgentTask` class of an agent function, for ``--env module:function``: its ``@agent_env`` options
    (``data`` ...) are the defaults of the class's keyword arguments (``--env-kwargs``); ``resolve`` makes a task of a
    ``data`` that names one (``"calculator"``)."""
    if inspect.isclass(agent) or not callable(agent):
        raise ValueError(f"an agent must be a function agent(client, sample), got {agent!r:.80}")
    defaults = dict(getattr(agent, "tokengym_agent", {}))
    where = f"{getattr(agent, '__module__', '?')}:{getattr(agent, '__qualname__', agent)}"

    def __init__(self: AgentTask, **options: Any) -> None:
        options = {**defaults, **options}
        if options.get("data") is None:
            raise ValueError(f"agent {where} has no data: mark it @agent_env(data=...) or pass --env-kwargs "
                             "'{\"data\": \"samples.jsonl\"}' (a JSONL file, a list of dicts or a task name)")
        data = options.pop("data")
        if isinstance(data, str) and not data.endswith(".jsonl") and resolve is not None:
            data = resolve(data)
        AgentTask.__init__(self, agent, data, **options)

    name = getattr(agent, "__name__", "agent")
    return type(name, (AgentTask,), {"__init__": __init__, "agent": staticmethod(agent), "__module__": agent.__module__,
                                     "__qualname__": getattr(agent, "__qualname__", name),
                                     "__doc__": f"the OpenAI-client agent {where} as an env"})


class AgentTask(EpisodeTask):
    """An OpenAI-client agent as a multi-turn task (see the module docstring).

    Args:
        agent: ``agent(client, sample) -> reward | None``, a function or coroutine function; the client is an
            ``openai.OpenAI`` (``openai.AsyncOpenAI`` for a coroutine function) whose ``base_url`` is the episode.
        data: the samples: a list of dicts, a JSONL file of them, or a :class:`Task` (or registered task name) whose
            ``sample(rng)`` draws them.
        eval_data: held-out samples (a list or JSONL) for ``heldout_samples``; a Task's are its own held-out draws.
        reward: ``reward(messages, sample) -> float`` for an agent that returns ``None``.
        constrain_tools: sample each turn under a grammar (llguidance: ``tokengym[grammar]``): free text without
            ``<``, or tool calls that parse against the schemas of the tools the first call declared; the trainer
            scores the turn under the same masks.
        format: a :class:`ChatFormat` (default: the tokenizer's chat template with Hermes tool calls, or plain text
            for a tokenizer without one).
        model: the model name(s) the endpoint serves (a call naming another is refused: 404).
        transport: ``"auto"`` (the endpoint listens on ``host:port``, so ``client.base_url`` works from any process;
            the client handed to the agent reaches it without a socket), ``"http"`` (that client too goes over
            loopback HTTP) or ``"inproc"`` (no socket at all).
        turn_timeout: seconds the agent may take between the model's answer and its next call (or its result).
        max_turns: as in :class:`EpisodeTask`.
        max_new_tokens: as in :class:`EpisodeTask`.
        cache_size: as in :class:`EpisodeTask`.
    """

    outcome_is_return = True
    turn_events = AGENT_EVENTS

    def __init__(self, agent: Callable, data: Any, *, eval_data: Any = None, reward: Callable | None = None,
                 format: ChatFormat | None = None, model: str | Sequence[str] = "tokengym", transport: str = "auto",
                 host: str = "127.0.0.1", port: int = 0, secret: str | None = None, turn_timeout: float = 60.0,
                 max_turns: int | None = None, max_new_tokens: int = 256, cache_size: int = 4096,
                 constrain_tools: bool = False, name: str | None = None):
        options = {k: v for k, v in locals().items() if k not in ("self", "agent", "__class__")}
        if not callable(agent) or isinstance(agent, type):
            raise ValueError(f"agent must be a function agent(client, sample), got {agent!r:.80}")
        if transport not in ("auto", "http", "inproc"):
            raise ValueError(f"transport must be 'auto', 'http' or 'inproc', got {transport!r}")
        if reward is not None and not callable(reward):
            raise ValueError(f"reward must be a function reward(messages, sample), got {reward!r:.80}")
        if format is not None and not isinstance(format, ChatFormat):
            raise ValueError(f"format must be a ChatFormat (TemplateFormat(), PlainFormat(...)), got {format!r:.80}")
        if isinstance(turn_timeout, bool) or not isinstance(turn_timeout, numbers.Real) or not turn_timeout > 0:
            raise ValueError(f"turn_timeout must be a number of seconds > 0, got {turn_timeout!r}")
        if not isinstance(constrain_tools, bool):
            raise ValueError(f"constrain_tools must be true or false, got {constrain_tools!r}")
        self.openai = require("openai", "agents", "AgentTask")
        if constrain_tools:  # each turn sampled (and trained) under its tools' grammar: see grammar_for
            self.grammar = {"lark": "start: /[^<]*/"}  # a turn with no tools declared
            self.grammar_for = self._tool_grammar  # type: ignore[method-assign]
        self.agent, self.is_async = agent, inspect.iscoroutinefunction(agent)
        self.source = self._source(data)
        self.eval_rows = _load_rows(eval_data) if eval_data is not None else None
        self.reward_fn, self.format, self.transport = reward, format, transport
        self.models = [model] if isinstance(model, str) else list(model)
        self.turn_timeout = float(turn_timeout)
        self.reply_timeout = self.turn_timeout + 30.0  # the env's limit on respond(), which waits turn_timeout itself
        self.server = AgentServer(self.models, secret)
        self.address = self.server.serve(host, port) if transport != "inproc" else "http://tokengym.local"
        self._loop = Loop() if self.is_async else None
        self._http: Any = None
        self._ids = itertools.count()
        self._drawn: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.tag = uuid.uuid4().hex[:8]
        self.tokenizer = None
        self._options = {**options, "port": 0}  # a copy in another process serves on a port of its own
        super().__init__(name or f"agent/{getattr(agent, '__name__', 'agent')}", max_turns=max_turns,
                         max_new_tokens=max_new_tokens, max_prompt_chars=64, cache_size=cache_size)

    @staticmethod
    def _source(data: Any) -> Any:
        if isinstance(data, Task):
            return data
        if isinstance(data, str) and not data.endswith(".jsonl"):
            raise ValueError(f"agent env data {data!r}: a JSONL file must end in .jsonl; a task is passed as a Task "
                             "(tokengym.envs.resolve_task(name)), or by name in --env-kwargs")
        return _load_rows(data)

    # ------------------------------------------------------------------ set up by the env
    def bind(self, tokenizer: Any) -> None:
        """The env's tokenizer: the chat format renders with it; the prompt buffer is sized on a first episode."""
        if self.tokenizer is tokenizer:
            return
        if self.format is None:
            self.format = TemplateFormat() if getattr(tokenizer, "chat_template", None) else PlainFormat()
        self.format.bind(tokenizer)
        self.tokenizer, self.turn_stop_strings = tokenizer, tuple(self.format.turn_stop_strings)
        rng, longest = np.random.default_rng(0), 0
        for _ in range(4):  # a first episode that calls the model sizes the prompt buffer
            try:
                ids, episode = self.start(self.draw(rng))
            except _Failed as e:
                if e.setting:
                    raise ValueError(f"agent env {self.name!r}: {e}") from None
                continue
            episode.close()
            longest = len(ids)
            break
        # tokens here (prompts come as ids): room for longer draws (512 if no probe called the model)
        self.max_prompt_chars = 2 * longest + 64 if longest else 512

    def _tool_grammar(self, sample: dict[str, Any], turn: int) -> dict[str, Any] | None:
        """The grammar of ``sample``'s turns (``constrain_tools``): free text without ``<``, or calls that parse
        against the schemas of the tools its first call declared."""
        tools = sample.get("tools")
        text = self.format.tools.grammar(tools) if tools else None
        return {"lark": text} if text else self.grammar

    def client(self, eid: str) -> Any:
        """An ``openai`` client whose ``base_url`` is episode ``eid`` (async for a coroutine agent)."""
        import httpx

        if self._http is None:
            if self.is_async:
                transport = AsyncInProcess(self.server) if self.transport != "http" else None
                self._http = httpx.AsyncClient(transport=transport, timeout=None)
            else:
                transport = InProcess(self.server) if self.transport != "http" else None
                self._http = httpx.Client(transport=transport, timeout=None,
                                          limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        cls = self.openai.AsyncOpenAI if self.is_async else self.openai.OpenAI
        return cls(base_url=f"{self.address}/e/{eid}/v1", api_key=self.server.secret, http_client=self._http,
                   max_retries=2)  # a connection that failed before the call reached the env

    # ------------------------------------------------------------------ samples
    KEPT_ROWS = 1 << 16
    """A Task's drawn samples kept for replays (by key, oldest dropped first): far more than episodes in flight."""

    def draw(self, rng: np.random.Generator) -> Hashable:
        """A data row's index, or (a Task's) a key of the sample it draws from ``rng`` itself, so the agent env meets
        the same samples, in the same order, as the task's own env seeded alike (and ``heldout_samples`` its
        held-out ones)."""
        if not isinstance(self.source, Task):
            return int(rng.integers(len(self.source)))
        key = next(self._ids)
        with self._lock:
            self._drawn[key] = self.source.sample(rng)
            while len(self._drawn) > self.KEPT_ROWS:
                self._drawn.popitem(last=False)
        return key

    def row(self, key: Hashable) -> dict[str, Any]:
        if isinstance(key, tuple):  # ("eval", i): a held-out row
            return dict(self.eval_rows[key[1]])  # type: ignore[index]
        if isinstance(self.source, Task):
            return dict(self._drawn[key])
        return dict(self.source[int(key)])  # type: ignore[call-overload]

    def heldout_batch(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` held-out samples: ``eval_data``'s rows in order (cycled), else draws from ``seed`` (a Task's:
        its own env's held-out samples)."""
        if self.eval_rows is None:
            return self.batch(np.random.default_rng(seed), n)
        return [self._sample(("eval", i % len(self.eval_rows))) for i in range(n)]

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        return self._sample(self.draw(rng))

    def _sample(self, key: Hashable) -> dict[str, Any]:
        if self.tokenizer is None:
            raise RuntimeError(f"task {self.name!r} draws samples once an env has bound its tokenizer (TokenVectorEnv "
                               "does, at construction)")
        try:
            ids, episode = self.start(key)
        except _Failed as e:  # no prompt to train on: a one-turn stand-in episode that ends at once, counted
            ids = self.format.prompt([{"role": "user", "content": "(the agent made no call)"}], [])
            return {"prompt": self.format.text(ids), "prompt_ids": ids, "key": key, "failed": [e.event, str(e)]}
        self._park((key,), episode)
        return {"prompt": self.format.text(ids), "prompt_ids": ids, "key": key, "tools": episode.tools}

    def start(self, key: Hashable) -> tuple[list[int], "AgentEpisode"]:
        episode = AgentEpisode(self, key, self.row(key))
        try:
            ids = episode.first()
        except _Failed as e:
            episode.close()
            if not e.setting:  # a setting that cannot work is refused (by bind), not counted
                self.warn(e.event, str(e))
            raise
        if self.max_prompt_chars > 64 and len(ids) > self.max_prompt_chars:
            why = (f"its first call's messages are {len(ids)} tokens, more than the prompt buffer "
                   f"({self.max_prompt_chars})")
            episode.close(APIError(400, f"context length exceeded: {why}", code="context_length_exceeded"))
            self.warn("reply_overflows", why)
            raise _Failed("reply_overflows", why)
        return ids, episode

    # ------------------------------------------------------------------ turns
    def respond(self, sample: dict[str, Any], history: list[str]) -> Reply:
        if "failed" in sample:
            return Reply(done=True, event=sample["failed"][0])
        key = sample["key"]
        episode = self._take((key, *history[:-1]))
        if episode is None:
            try:
                episode = self._replay_agent(sample, history[:-1])
            except _Failed as e:
                return Reply(done=True, event=e.event)
        rep = episode.step(history[-1])
        if rep.done:
            episode.close()
        else:
            self._park((key, *history, rep.text), episode)
        return rep

    def _replay_agent(self, sample: dict[str, Any], prefix: list[str]) -> "AgentEpisode":
        """A fresh run of the agent for this row, fed the model's turns so far (a group's other rows, or a row whose
        parked episode was evicted); it must make the same calls, or the episode ends as an agent error."""
        ids, episode = self.start(sample["key"])
        same = ids == list(sample["prompt_ids"])
        for i in range(0, len(prefix), 2):
            if not same:
                break
            rep = episode.step(prefix[i])
            same = not rep.done and i + 1 < len(prefix) and rep.text == prefix[i + 1]
        if not same:
            episode.close()
            why = (f"a second run of the agent on the same sample made other calls than the first (turn "
                   f"{len(prefix) // 2 + 1}): an agent env needs an agent that is deterministic given its sample and "
                   "the model's answers")
            self.warn("agent_errors", why)
            raise _Failed("agent_errors", why)
        return episode

    def episode_over(self, sample: dict[str, Any], history: list[str], partial: str | None) -> None:
        """The env ended the row (its token budget or ``max_turns``): answer the agent's call still out, and close.
        ``partial``: the model's unfinished turn (the call gets it with ``finish_reason="length"``), else ``None``
        (the call's own messages did not fit: ``context_length_exceeded``)."""
        if "failed" in sample:
            return
        prefix = (sample["key"], *history)
        with self._lock:
            where = next((k for k in self._parked if k[:len(prefix)] == prefix and len(k) <= len(prefix) + 1), None)
        episode = self._take(where) if where is not None else None
        if episode is not None:
            episode.over(partial)
            episode.close()

    def reward(self) -> Callable:
        return no_outcome

    def close(self) -> None:
        super().close()
        self.server.close()

    def warn(self, event: str, why: str) -> None:
        counted = {"agent_errors": "agent/errors", "agent_timeouts": "agent/timeouts"}.get(event, "env/reply_overflows")
        warnings.warn(f"agent env {self.name!r}: an episode ended: {why} (counted in {counted}; the run goes on)",
                      TokengymWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"AgentTask({self.name!r}, {self.transport} at {self.address})"

    def __reduce__(self) -> tuple:
        """A copy for another process (an async rollout worker): the same agent (by reference: a module-level
        function) and options, with an endpoint, threads and parked episodes of its own."""
        return _rebuild, (self.agent, self._options, self.tokenizer)


def _rebuild(agent: Callable, options: dict[str, Any], tokenizer: Any) -> AgentTask:
    task = AgentTask(agent, **options)
    if tokenizer is not None:
        task.bind(tokenizer)
    return task


class AgentEpisode:
    """One run of the agent on one sample, and its conversation as the env sees it."""

    def __init__(self, task: AgentTask, key: Hashable, row: dict[str, Any]):
        self.task, self.row, self.fmt = task, row, task.format
        self.eid = f"{task.tag}-{next(task._ids)}"
        self.bridge = Suspended(task.turn_timeout)
        self.refused: APIError | None = None  # a request that can never work (see _Failed.setting)
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.turn = self.prompt_tokens = 0
        self.pending = False  # a call waits for the model's turn
        task.server.add(self.eid, self)
        client = task.client(self.eid)
        if task.is_async:
            self.job: Any = asyncio.run_coroutine_threadsafe(self._run_async(client), task._loop.loop)  # type: ignore[union-attr]
        else:
            self.job = threading.Thread(target=self._run, args=(client,), name=f"agent-{self.eid}", daemon=True)
            self.job.start()

    # ------------------------------------------------------------------ the agent's side
    def _run(self, client: Any) -> None:
        try:
            self.bridge.finish(self.task.agent(client, self.row))
        except BaseException as e:  # noqa: BLE001 - the env's thread reports it
            self.bridge.fail(e)

    async def _run_async(self, client: Any) -> None:
        try:
            self.bridge.finish(await self.task.agent(client, self.row))
        except BaseException as e:  # noqa: BLE001
            self.bridge.fail(e)

    def call(self, request: Any) -> Any:
        """The server's side of one ``chat.completions.create``: a future of ``(status, body)``."""
        import concurrent.futures as cf

        out: cf.Future = cf.Future()
        try:
            try:
                check_chat_request(request)
            except APIError as e:
                self.refused = e
                raise
            if request.get("model") not in self.task.models:
                raise APIError(404, f"model {request.get('model')!r} is not served here; this env serves "
                                    f"{', '.join(map(repr, self.task.models))}", code="model_not_found")
        except APIError as e:
            out.set_result((e.status, error_body(e)))
            return out

        def done(f: cf.Future) -> None:
            e = f.exception()
            if e is None:
                out.set_result(f.result())
            else:
                err = e if isinstance(e, APIError) else APIError(410, f"episode {self.eid}: {e}", code="episode_over")
                out.set_result((err.status, error_body(err)))

        self.bridge.ask(request).add_done_callback(done)
        return out

    # ------------------------------------------------------------------ the env's side
    def _event(self) -> tuple[str, Any]:
        try:
            return self.bridge.next()
        except TimeoutError as e:
            raise _Failed("agent_timeouts", f"the agent was silent for {self.task.turn_timeout:g} s (turn_timeout)") from None

    def first(self) -> list[int]:
        kind, payload = self._event()
        if kind == "error" and self.refused is not None:
            raise _Failed("agent_errors", f"its first call was refused: {self.refused}", setting=True)
        if kind != "ask":
            raise _Failed("agent_errors", "the agent " + (f"raised {type(payload).__name__}: {str(payload)[:160]}"
                          if kind == "error" else f"returned {payload!r:.40} without calling the model")
                          + " before its first call")
        try:
            self.tools = check_tools(payload.get("tools"))
            messages = [dict(m) for m in payload["messages"]]
            ids = self.fmt.prompt(messages, self.tools)
        except APIError as e:
            self.bridge.answer(error=e)
            raise _Failed("agent_errors", f"its first call was refused: {e}") from None
        self.messages, self.prompt_tokens, self.pending = messages, len(ids), True
        return ids

    def step(self, text: str) -> Reply:
        """Answer the call that waits with the model's turn ``text``; the agent's next call is the reply."""
        self.turn += 1
        content, calls = self.fmt.tools.parse(text, f"call_{self.eid}_{self.turn}")
        self._answer(content, calls, "tool_calls" if calls else "stop", text)
        try:
            return self._next()
        except _Failed as e:
            self.task.warn(e.event, str(e))
            return Reply(done=True, event=e.event)

    def _answer(self, content: str, calls: list[dict[str, Any]], finish: str, text: str) -> None:
        n = len(self.task.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
        out = chat_completion(id=f"chatcmpl-{self.eid}-{self.turn}", model=self.task.models[0], content=content,
                              tool_calls=calls, finish_reason=finish, prompt_tokens=self.prompt_tokens,
                              completion_tokens=n)
        self.messages.append(dict(out["choices"][0]["message"]))
        self.prompt_tokens += n
        self.pending = False
        self.bridge.answer((200, out))

    def _next(self) -> Reply:
        kind, payload = self._event()
        if kind == "error":
            raise _Failed("agent_errors", f"the agent raised {type(payload).__name__}: {str(payload)[:160]}")
        if kind == "done":
            return Reply(done=True, reward=self._reward(payload))
        messages, n = payload["messages"], len(self.messages)
        bad = next((i for i in range(n) if i >= len(messages) or not same_message(self.messages[i], messages[i])), None)
        if bad is not None:
            e = APIError(400, f"turn {self.turn + 1}: the call's messages do not extend the episode's conversation "
                              f"(message {bad} " + ("is missing" if bad >= len(messages) else "differs") + "); an agent"
                              " env trains on one growing conversation: keep earlier messages as they were")
            self.bridge.answer(error=e)
            raise _Failed("agent_errors", str(e))
        try:
            tools = check_tools(payload.get("tools"))
            ids = self.fmt.delta(messages[n:], tools)
        except APIError as e:
            self.bridge.answer(error=e)
            raise _Failed("agent_errors", f"turn {self.turn + 1}: {e}") from None
        self.messages += [dict(m) for m in messages[n:]]
        self.prompt_tokens += len(ids)
        self.pending = True
        return Reply(text=self.task.tokenizer.decode(ids), ids=ids)

    def _reward(self, value: Any) -> float:
        if value is None and self.task.reward_fn is not None:
            value = self.task.reward_fn(list(self.messages), self.row)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise _Failed("agent_errors", f"the agent returned {value!r:.40}, not a finite number"
                          + (" (and the env has no reward function)" if value is None else ""))
        return float(value)

    def over(self, partial: str | None) -> None:
        if not self.pending:
            return
        if partial is None:
            self.bridge.answer(error=APIError(400, "context length exceeded: this call's messages do not fit the "
                                                   "episode's token budget (max_new_tokens)",
                                              code="context_length_exceeded"))
        else:
            self.turn += 1
            self._answer(partial, [], "length", partial)

    def close(self, error: APIError | None = None) -> None:
        self.bridge.close(error)
        self.task.server.drop(self.eid)
        if self.task.is_async and not self.job.done():
            self.job.cancel()

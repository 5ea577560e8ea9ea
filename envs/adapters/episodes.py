"""The seam every library adapter stands on: a live episode of the library's own env behind :meth:`Task.respond`.

A library env acts on whole turns: ``reset`` gives the first observation, ``step(text)`` answers an agent turn
with an observation, a reward and whether the episode is over. :class:`EpisodeTask` turns that into a tokengym
multi-turn task: the first observation is the prompt, each answer is the env's reply (context, not actions), and each
reward is a turn reward on the agent token that ended the turn (``Reply.reward``), so it lands on an action column
and GRPO/PPO see it in the episode's return. The task's own outcome reward is 0 and it declares ``outcome_is_return``:
a rollout then reports the episode's return (the library's) as its outcome, which ``reward/mean``,
``reward/accuracy`` and ``evaluate`` read, and a return of 1 or more (a won game, a passed rubric) counts as solved;
the advantages still see each reward once. An adapter only says how to start an episode (:meth:`start`).

``respond(sample, history)`` is a function of the prompt and the turns so far, while library envs are stateful
objects. The live episode after each answer is parked under ``(key, *history)`` and taken back at the next turn;
one that is missing (a group's other rows share the first one, or it was evicted) is rebuilt by replaying the
agent's turns on a fresh episode from the same key, and a replay that answers differently raises, naming the
task (the library env is then not deterministic given its seed). Parked episodes are bounded (``cache_size``).
"""

from __future__ import annotations

import importlib
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

import numpy as np

from ..chat import user_prompt
from ..multiturn import Reply
from ..tasks.base import Task

__all__ = ["Turn", "Episode", "EpisodeTask", "GlobalRandom", "require", "no_outcome"]


def require(module: str, extra: str, what: str) -> Any:
    """``import module``, or one ImportError line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the {module.split('.')[0]!r} package: pip install 'tokengym[{extra}]'") from e


class GlobalRandom:
    """The global ``random`` and ``numpy.random`` streams of one episode, for libraries that seed and draw from them.

    Episodes answer concurrently (a thread per reply), and one episode's ``reset(seed)`` or draws would otherwise move
    another's stream, so a replayed episode would not meet the same game. ``with episode_rng:`` holds one lock for all
    episodes and swaps this episode's streams in (and the caller's back after)."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        self._py: Any = None
        self._np: Any = None

    def __enter__(self) -> "GlobalRandom":
        self._lock.acquire()
        self._saved = random.getstate(), np.random.get_state()
        if self._py is not None:
            random.setstate(self._py)
            np.random.set_state(self._np)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._py, self._np = random.getstate(), np.random.get_state()
        random.setstate(self._saved[0])
        np.random.set_state(self._saved[1])
        self._lock.release()


@dataclass
class Turn:
    """A library env's answer to one agent turn."""

    text: str | None
    """The observation shown to the agent (``None``: nothing more is said)."""
    reward: float = 0.0
    """The env's reward for the turn."""
    done: bool = False
    """The episode is over (terminated or truncated by the library env)."""


class Episode(Protocol):
    """One live episode of a library env."""

    def step(self, action: str) -> Turn: ...

    def close(self) -> None: ...


def no_outcome(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The outcome reward of adapter tasks at the env: 0, since the library's rewards arrive as turn rewards (a
    rollout folds them into its outcome: ``EpisodeTask.outcome_is_return``)."""
    return [0.0] * len(completions)


no_outcome.name = "env_turn_rewards"  # type: ignore[attr-defined]


def close_env(env: Any) -> None:
    """Close a library's env if it has a ``close``: what an :class:`Episode` over one does on :meth:`Episode.close`."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


class EpisodeTask(Task):
    """A tokengym task whose episodes are run by a library env (see the module docstring).

    Subclasses implement :meth:`start` (and may override :meth:`draw`, the key of a new episode: a seed by default).

    Args:
        name: the task's name in logs.
        chat: prompts are chat messages (the observation as a user message) and replies are chat turns of
            ``reply_role``; otherwise plain text, each reply on its own lines.
        system_prompt: a system message for chat prompts (or a first paragraph of text prompts).
        turn_stop_strings: texts that end an agent turn besides EOS / end-of-turn (``("]",)`` for ``[5]`` moves).
        max_turns: agent turns after which tokengym truncates the episode (``None``: the library env decides).
        max_new_tokens: the episode's token budget (agent turns and replies).
        max_prompt_chars: upper bound on the first observation's length; measured on one episode when ``None``.
        cache_size: parked live episodes kept at most (older ones are closed and replayed when needed).
    """

    reply_timeout = 60.0
    outcome_is_return = True
    """A rollout's ``outcome`` is the episode's return (the library's turn rewards), not the env's outcome reward (0)."""

    def __init__(self, name: str, *, chat: bool = False, system_prompt: str | None = None,
                 turn_stop_strings: tuple[str, ...] = (), max_turns: int | None = None, max_new_tokens: int = 256,
                 max_prompt_chars: int | None = None, cache_size: int = 4096):
        if not isinstance(chat, bool):
            raise ValueError(f"chat must be true or false, got {chat!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be an int >= 1, got {cache_size!r}")
        if isinstance(turn_stop_strings, str) or not all(isinstance(s, str) and s for s in turn_stop_strings):
            raise ValueError(f"turn_stop_strings must be a tuple of non-empty strings, got {turn_stop_strings!r}")
        self.name, self.chat, self.system_prompt = name, chat, system_prompt
        self.turn_stop_strings, self.max_turns = tuple(turn_stop_strings), max_turns
        self.default_max_new_tokens, self.cache_size = max_new_tokens, cache_size
        self._parked: OrderedDict[tuple, Episode] = OrderedDict()
        self._lock = threading.Lock()
        if max_prompt_chars is None:
            first, episode = self.start(self.draw(np.random.default_rng(0)))
            episode.close()
            max_prompt_chars = 2 * len(self._prompt_text(first)) + 64  # room for longer draws of the same game
        self.max_prompt_chars = int(max_prompt_chars)

    # -- what an adapter provides ------------------------------------------------------------------------------------

    def draw(self, rng: np.random.Generator) -> Hashable:
        """The key of a new episode (everything :meth:`start` needs to replay it): a seed by default."""
        return int(rng.integers(0, 2**31 - 1))

    def start(self, key: Hashable) -> tuple[Any, Episode]:
        """A new live episode for ``key`` and its first observation (text, or chat messages)."""
        raise NotImplementedError

    # -- the Task protocol ---------------------------------------------------------------------------------------------

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        key = self.draw(rng)
        first, episode = self.start(key)
        self._park((key,), episode)
        return {"prompt": self._prompt(first), "key": key}

    def respond(self, sample: dict[str, Any], history: list[str]) -> Reply:
        key = sample["key"]
        episode = self._take((key, *history[:-1]))
        if episode is None:
            episode = self._replay(key, history[:-1])
        turn = episode.step(history[-1])
        if turn.done:
            episode.close()
            return Reply(text=self._reply(turn.text) if turn.text else None, done=True, reward=float(turn.reward))
        text = self._reply(turn.text or "")
        self._park((key, *history, text), episode)
        return Reply(text=text, reward=float(turn.reward))

    def reward(self) -> Callable:
        return no_outcome

    # -- parked episodes -------------------------------------------------------------------------------------------

    def _park(self, where: tuple, episode: Episode) -> None:
        with self._lock:
            old = self._parked.pop(where, None)
            self._parked[where] = episode
            evicted = [self._parked.popitem(last=False)[1] for _ in range(len(self._parked) - self.cache_size)]
        for e in ([old] if old is not None else []) + evicted:
            e.close()

    def _take(self, where: tuple) -> Episode | None:
        with self._lock:
            return self._parked.pop(where, None)

    def close(self) -> None:
        """Close every parked episode."""
        with self._lock:
            parked, self._parked = list(self._parked.values()), OrderedDict()
        for e in parked:
            e.close()

    def _replay(self, key: Hashable, prefix: list[str]) -> Episode:
        _, episode = self.start(key)
        for i in range(0, len(prefix), 2):
            turn = episode.step(prefix[i])
            said = prefix[i + 1] if i + 1 < len(prefix) else None
            if turn.done or self._reply(turn.text or "") != said:
                episode.close()
                raise RuntimeError(f"task {self.name!r}: replaying turn {i // 2 + 1} of episode {key!r} gave another "
                                   f"answer ({turn.text!r:.80}); the library env is not deterministic given its seed")
        return episode

    # -- text ----------------------------------------------------------------------------------------------------------

    def _prompt_text(self, first: Any) -> str:
        if isinstance(first, str):
            return first
        return "\n\n".join(str(m.get("content", "")) for m in first)

    def _prompt(self, first: Any) -> Any:
        if self.chat:
            return user_prompt(first, self.system_prompt) if isinstance(first, str) else list(first)
        text = self._prompt_text(first)
        return (f"{self.system_prompt}\n\n" if self.system_prompt else "") + text.rstrip("\n") + "\n"

    def _reply(self, text: str) -> str:
        """The observation as reply text: as is in chat (the template writes the role markers), else on its own lines."""
        return text if self.chat else "\n" + text.strip("\n") + "\n"

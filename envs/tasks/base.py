"""What a task is: a seeded prompt source plus the rewards that judge its completions."""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable

import numpy as np

__all__ = ["Task", "BUNDLED_DATA", "fresh_samples", "check_seed", "int_range"]

BUNDLED_DATA = {"preference_pairs": ("preference pairs", "--pairs FILE.jsonl with prompt/chosen/rejected"),
                "step_labels": ("step labels", "--step-labels FILE.jsonl with prompt/steps/labels")}
"""The kinds of training data a task may bundle (its method names), with what the error says to pass instead."""


class Task:
    """Base class for prompt sources.

    A task draws prompts with :meth:`sample` from a ``numpy.random.Generator`` (so an env seeded with
    ``reset(seed=...)`` replays the same prompts) and names its default rewards.

    Each sample is a dict with ``"prompt"`` (str) and optional task fields: ``"solution"`` (a reference
    completion, used for supervised warm starts and preference pairs), ``"answer"`` and anything else the
    rewards need. Every sample of a task carries the same keys.

    Attributes:
        name: short name used in logs.
        stop_strings: texts that end an episode when generated (matched on token ids), besides EOS.
        step_delimiter: text that ends one reasoning step (``"\\n"``); ``None`` when the task has no steps.
        max_prompt_chars: upper bound on prompt length in characters (sizes the env's prompt buffer).
        default_max_new_tokens: generation budget when the env is not given one.
        chat: prompts are lists of chat messages (TRL's conversational format), rendered by the tokenizer's
            chat template; otherwise strings.
        turn_stop_strings: texts that end an agent turn so that the env answers (``"</calc>"``); multi-turn only.
        max_turns: agent turns after which a multi-turn episode is truncated (``None``: only the token budget).
        reply_timeout: seconds a reply may take before it becomes an error message (``None``: no limit, inline).
        reply_grace: ``None`` (a step waits for every reply of its agent turns) or seconds after which a step returns
            with the rows whose reply is still out waiting, so that a slow tool does not hold up the other rows.
        reply_role: the chat role of the env's replies in chat tasks.
        grammar: the actions' grammar, declared as stop strings are (``{"json_schema": ...}``, ``{"regex": ...}`` or
            ``{"lark": ...}``, see :func:`~tokengym.envs.masks.grammar_text`); ``None``: free text. Needs llguidance.
        bundled_data: the names of the data methods (:data:`BUNDLED_DATA`) that give data instead of raising;
            ask with :meth:`has_bundled_data`.

    Multi-turn tasks override :meth:`respond` (see :mod:`tokengym.envs.multiturn`); every stop of an agent turn
    (EOS, end-of-turn token, stop string or turn stop string) then asks it whether and how the env answers.
    """

    name: str = "task"
    stop_strings: tuple[str, ...] = ()
    step_delimiter: str | None = None
    max_prompt_chars: int = 64
    default_max_new_tokens: int = 32
    chat: bool = False
    turn_stop_strings: tuple[str, ...] = ()
    max_turns: int | None = None
    reply_timeout: float | None = 10.0
    reply_grace: float | None = None
    reply_role: str = "user"
    bundled_data: tuple[str, ...] = ()
    grammar: dict[str, Any] | None = None

    def grammar_for(self, sample: dict[str, Any], turn: int) -> dict[str, Any] | None:
        """The grammar agent turn ``turn`` (0 = the first) of ``sample``'s episode is sampled under, or ``None`` (free
        text). Default: :attr:`grammar` for every turn; a multi-turn task overrides it to constrain only some turns."""
        return self.grammar

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        raise NotImplementedError

    def reward(self) -> Callable:
        """The default outcome reward: ``(prompts, completions, **fields) -> list[float]``."""
        raise NotImplementedError

    def process_reward(self) -> Callable | None:
        """The default process reward ``(prompts, steps, **fields) -> list[list[float]]``, or ``None``."""
        return None

    def respond(self, sample: dict[str, Any], history: list[str]) -> Any:
        """The env's answer to the agent turn ``history[-1]``: reply text, ``None`` to end the episode, or a
        :class:`~tokengym.envs.multiturn.Reply`. ``history`` alternates agent turns and earlier replies (text)."""
        return None

    turn_events: tuple[str, ...] = ()
    """Per-row counts a task's replies add to the env's :data:`~tokengym.envs.multiturn.TURN_EVENTS` (``Reply.event``)."""

    def bind(self, tokenizer: Any) -> None:
        """Hook the env calls with its tokenizer at construction (a task that renders its own token ids needs it)."""

    def episode_over(self, sample: dict[str, Any], history: list[str], partial: str | None) -> None:
        """Hook the env calls when it truncates a multi-turn episode (token budget, ``max_turns``), so a task that
        keeps live state per episode can end it. ``partial``: the agent's unfinished turn, if the budget cut one."""

    @property
    def multi_turn(self) -> bool:
        """Whether the task answers the agent mid-episode (it overrides :meth:`respond`)."""
        return type(self).respond is not Task.respond

    def on_seed(self, seed: int | None) -> None:
        """Hook the environment calls on ``reset(seed=...)``, before sampling with the re-seeded generator.

        Stateless tasks ignore it; tasks that walk a stream of rows (e.g. ``DatasetTask``) restart the
        stream, so that re-seeding the env replays the same prompts.
        """

    def state_dict(self, rng: np.random.Generator) -> dict[str, Any]:
        """Where the task is in ``rng``'s stream of prompts (stateless tasks: ``{}``); see the env's ``state_dict``."""
        return {}

    def load_state_dict(self, state: dict[str, Any], rng: np.random.Generator) -> None:
        """Restore what :meth:`state_dict` returned, for the walk of ``rng``."""

    def has_bundled_data(self, kind: str) -> bool:
        """Whether :meth:`preference_pairs` (``kind="preference_pairs"``) or :meth:`step_labels` give data here."""
        if kind not in BUNDLED_DATA:
            raise ValueError(f"kind must be one of {sorted(BUNDLED_DATA)}, got {kind!r}")
        return kind in self.bundled_data

    def _no_bundled_data(self, kind: str) -> NotImplementedError:
        what, instead = BUNDLED_DATA[kind]
        name = type(self).__name__ + ("(chat=True)" if self.chat else "")
        return NotImplementedError(f"no bundled {what} for {name}; pass {instead}")

    def preference_pairs(self, n: int, seed: int = 0, exclude_prompts: Iterable[str] = ()) -> list[dict[str, Any]]:
        """``n`` seeded preference pairs (``prompt``/``chosen``/``rejected``, plus metadata) the task can make
        without a model, none with a prompt in ``exclude_prompts``; raises ``NotImplementedError`` when it has none."""
        raise self._no_bundled_data("preference_pairs")

    def step_labels(self, n: int, seed: int = 0, exclude_prompts: Iterable[str] = ()) -> list[dict[str, Any]]:
        """``n`` seeded step-labelled solutions (``prompt``/``steps``/``labels``, plus metadata) for a learned PRM,
        none with a prompt in ``exclude_prompts``; raises ``NotImplementedError`` when the task has none."""
        raise self._no_bundled_data("step_labels")

    def batch(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        """``n`` samples drawn in order from ``rng``."""
        return [self.sample(rng) for _ in range(n)]


def fresh_samples(task: Task, n: int, rng: np.random.Generator, exclude: set[str]) -> list[dict[str, Any]]:
    """``n`` samples of ``task`` drawn from ``rng`` whose prompts are not in ``exclude`` (e.g. held-out prompts)."""
    out: list[dict[str, Any]] = []
    for _ in range(1000):
        out += [s for s in task.batch(rng, n - len(out)) if s["prompt"] not in exclude]
        if len(out) >= n:
            return out
    raise RuntimeError("could not draw enough prompts outside exclude_prompts: the task's prompt space is too small")


def int_range(name: str, value: Any, minimum: int, maximum: int | None = None) -> tuple[int, int]:
    """Validate an int or an inclusive ``(lo, hi)`` range and return ``(lo, hi)``."""

    def is_int(x: Any) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    bounds = f">= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
    if is_int(value):
        lo = hi = int(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(x) for x in value):
        lo, hi = int(value[0]), int(value[1])
        if lo > hi:
            raise ValueError(f"{name} range must have min <= max, got {value!r}")
    else:
        raise ValueError(f"{name} must be an int or an inclusive (min, max) pair of ints, got {value!r}")
    if lo < minimum or (maximum is not None and hi > maximum):
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return lo, hi


def check_seed(seed: Any) -> int | None:
    """A task's ``seed`` argument as an int (``None`` stays ``None``); ValueError for a bool, a non-int or a negative."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"seed must be None or an int >= 0, got {seed!r}")
    return None if seed is None else int(seed)

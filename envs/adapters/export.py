"""The other way round: a tokengym task for other trainers, as a TRL ``environment_factory`` object and as a GEM env.

Both drive a task at the level of whole turns, as those libraries do: :class:`TaskEpisode` draws a sample, answers
each agent turn with :meth:`Task.respond` (multi-turn tasks), and scores the transcript with the task's outcome reward
plus its turn rewards. No tokenizer is involved, so there are no token masks here: that is what tokengym's own env adds.

- TRL (``GRPOTrainer(environment_factory=lambda: TRLEnvironment(task), ...)``): ``reset(**row)`` starts an episode
  from a dataset row (:func:`trl_rows` makes rows from the task) or, without one, from the task's own prompts and
  returns the prompt; the ``act`` tool sends the agent's turn and returns the env's reply; ``get_reward()`` scores
  the transcript of tool turns. A single-turn task has no tool turns: score its completions with TRL
  ``reward_funcs`` instead (a text task's ``reward()`` takes TRL's ``(prompts, completions, **columns)``).
- GEM (``gem_env(task)``, or ``register_gem_env(task_name)`` for ``gem.make``): ``reset(seed)`` gives the prompt,
  ``step(text)`` the reply, the reward and the end (single-turn tasks end after the first step).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokengym.rewards.protocols import score_outcome

from ..multiturn import Reply, answer_one
from ..tasks.base import Task
from .episodes import require

__all__ = ["TaskEpisode", "TRLEnvironment", "trl_rows", "gem_env", "register_gem_env"]


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


def _task(task: Any) -> Task:
    if isinstance(task, str):
        from ..vector_env import resolve_task

        return resolve_task(task)
    if not isinstance(task, Task):
        raise TypeError(f"expected a tokengym Task or a task name, got {type(task).__name__}")
    return task


class TaskEpisode:
    """One episode of a task at the level of turns: ``step(turn) -> (reply, reward, done)``."""

    def __init__(self, task: Task, sample: dict[str, Any]):
        self.task, self.sample, self.history = task, sample, []
        self.turn_rewards, self.done = 0.0, False

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        """The reply to ``turn``, the reward it earned (the outcome with the turn reward when the episode ends), and
        whether the episode ended."""
        if self.done:
            raise RuntimeError(f"task {self.task.name!r}: the episode has ended; reset first")
        self.history.append(turn)
        rep, _ = answer_one(self.task, self.sample, self.history) if self.task.multi_turn else (Reply(done=True), None)
        self.turn_rewards += rep.reward
        if not rep.done and self.task.max_turns is not None and len(self.history) // 2 + 1 >= self.task.max_turns:
            rep = Reply(text=rep.text, done=True, reward=rep.reward)  # tokengym's env truncates there too
        if rep.text is not None:
            self.history.append(rep.text)
        if not rep.done:
            return rep.text, rep.reward, False
        self.done = True
        return rep.text, rep.reward + self.outcome(), True

    def outcome(self) -> float:
        """The task's outcome reward on the transcript (agent turns and replies, as one text)."""
        fields = {k: [v] for k, v in self.sample.items() if k != "prompt"}
        total, _ = score_outcome(self.task.reward(), [_text(self.sample["prompt"])], ["".join(self.history)], fields)
        return float(total[0])

    @property
    def episode_return(self) -> float:
        return self.turn_rewards + (self.outcome() if self.done else 0.0)


def trl_rows(task: Any, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` samples of ``task`` as rows of a TRL dataset (``datasets.Dataset.from_list(trl_rows(...))``): ``prompt``
    (chat prompts stay messages) and the task's fields, which ``TRLEnvironment.reset(**row)`` reads back."""
    task = _task(task)
    return task.batch(np.random.default_rng(seed), n)


class TRLEnvironment:
    """A tokengym task as the environment object of TRL's ``GRPOTrainer(environment_factory=...)`` (see the module).

    Args:
        task: a :class:`~tokengym.envs.Task` or a registered task name.
        seed: seeds the prompts drawn when ``reset`` gets no row.
    """

    def __init__(self, task: Any = "calculator", seed: int = 0):
        self.task, self.rng = _task(task), np.random.default_rng(seed)
        self.episode: TaskEpisode | None = None
        self.last_reply: str | None = None

    def reset(self, **row: Any) -> str | None:
        """Start an episode: from the dataset row when it has a prompt (returns ``None``), else from a prompt of the task
        (returns its text, which TRL appends to the user message)."""
        sample = dict(row) if "prompt" in row else self.task.sample(self.rng)
        self.episode = TaskEpisode(self.task, sample)
        return None if "prompt" in row else _text(sample["prompt"])

    def act(self, message: str) -> str:
        """Send your turn to the environment and read its answer.

        Args:
            message: your turn, as the task expects it (for example a tool call).

        Returns:
            The environment's answer.
        """
        if self.episode is None:
            raise RuntimeError("TRLEnvironment: reset() first")
        if self.episode.done:
            return "The episode is over."
        reply, _, done = self.episode.step(message)
        return reply or ("The episode is over." if done else "")

    def get_reward(self) -> float:
        """The episode's return: its turn rewards, plus the outcome reward on its transcript."""
        if self.episode is None:
            raise RuntimeError("TRLEnvironment: reset() first")
        return self.episode.turn_rewards + self.episode.outcome()


_GEM_CLASS: Any = None


def _gem_class() -> Any:
    """The GEM env class (defined on first use, as ``gem`` is an optional extra)."""
    global _GEM_CLASS
    if _GEM_CLASS is None:
        gem = require("gem", "gem", "gem_env")

        class TokenGymGEMEnv(gem.Env):
            """A tokengym task as a GEM env: ``reset(seed)`` -> ``(prompt, info)``, ``step(text)`` -> GEM's 5-tuple."""

            def __init__(self, task: Any = "calculator", **task_kwargs: Any):
                super().__init__()
                if isinstance(task, str):
                    from ..vector_env import resolve_task

                    task = resolve_task(task, **task_kwargs)
                self.task, self.rng = _task(task), np.random.default_rng()
                self.episode: TaskEpisode | None = None

            def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
                if seed is not None:
                    self.rng = np.random.default_rng(seed)
                self.task.on_seed(seed)
                self.episode = TaskEpisode(self.task, self.task.sample(self.rng))
                return _text(self.episode.sample["prompt"]), {}

            def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
                if self.episode is None:
                    raise RuntimeError(f"task {self.task.name!r}: reset() before step()")
                reply, reward, done = self.episode.step(action)
                return reply or "", float(reward), done, False, {}

        _GEM_CLASS = TokenGymGEMEnv
    return _GEM_CLASS


def gem_env(task: Any = "calculator", **task_kwargs: Any) -> Any:
    """A tokengym task (an instance or a registered name with its keyword arguments) as a ``gem.Env``."""
    return _gem_class()(task, **task_kwargs)


def register_gem_env(task_name: str, env_id: str | None = None, **task_kwargs: Any) -> str:
    """Register a tokengym task with GEM (``gem.make(env_id)``); returns the id (``tokengym:<task_name>``)."""
    gem = require("gem", "gem", "register_gem_env")
    env_id = env_id or f"tokengym:{task_name}"
    gem.register(env_id, _gem_class(), task=task_name, **task_kwargs)
    return env_id

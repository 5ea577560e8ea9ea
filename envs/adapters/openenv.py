"""OpenEnv environments as tokengym multi-turn tasks whose replies are the env's observations (extra: ``tokengym[openenv]``).

An OpenEnv environment is a server-side ``Environment`` (``reset(seed=...)``, ``step(action)``, observations that carry
``done`` and ``reward``) that a client reaches over HTTP/WebSocket (``EnvClient``, whose ``reset``/``step`` return a
``StepResult``). :class:`OpenEnvTask` takes a factory of either, called once per episode: an ``Environment`` runs
in-process, and a client (sync, ``EnvClient(...).sync()``) talks to a server that is already running, on this machine
or elsewhere; that server, or the Docker image or Hub Space behind ``from_docker_image``/``from_env``, is a service
tokengym does not start. The agent's turn becomes an action through ``action`` (an Action class with one text field,
or a function of the text), and an observation becomes reply text through ``observation``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Hashable

from .episodes import EpisodeTask, close_env, Turn, require

__all__ = ["OpenEnvTask", "observation_text"]

HIDDEN = ("done", "reward", "metadata")
"""Observation fields that are not shown to the agent."""


def observation_text(obs: Any) -> str:
    """An observation as text: its one visible text field, else its visible fields as JSON."""
    fields = obs.model_dump() if hasattr(obs, "model_dump") else dict(obs)
    shown = {k: v for k, v in fields.items() if k not in HIDDEN}
    texts = [v for v in shown.values() if isinstance(v, str)]
    return texts[0] if len(shown) == 1 and texts else json.dumps(shown, default=str)


def _text_action(action_cls: type) -> Callable[[str], Any]:
    """``text -> action_cls(field=text)`` for an Action class with exactly one required field."""
    required = [name for name, f in action_cls.model_fields.items() if f.is_required()]
    if len(required) != 1:
        raise ValueError(f"OpenEnvTask: {action_cls.__name__} has required fields {required}; pass action= a function "
                         "that builds the action from the agent's text")
    field = required[0]
    return lambda text: action_cls(**{field: text})


class _Session:
    def __init__(self, env: Any, action: Callable[[str], Any], observation: Callable[[Any], str]):
        self.env, self.action, self.observation = env, action, observation

    def _turn(self, result: Any) -> Turn:
        if hasattr(result, "observation"):  # a client's StepResult
            obs, reward, done = result.observation, result.reward, result.done
        else:  # an in-process Environment's Observation
            obs, reward, done = result, getattr(result, "reward", None), getattr(result, "done", False)
        return Turn(self.observation(obs), float(reward or 0.0), bool(done))

    def reset(self, seed: int) -> str:
        return self._turn(self.env.reset(seed=seed)).text or ""

    def step(self, action: str) -> Turn:
        return self._turn(self.env.step(self.action(action)))

    def close(self) -> None:
        close_env(self.env)


class OpenEnvTask(EpisodeTask):
    """An OpenEnv environment (in-process, or through a client) as a multi-turn task.

    Args:
        env: a zero-argument factory of an OpenEnv ``Environment`` or of a sync client (``SomeEnv(base_url=...).sync()``),
            called once per episode (and once more to measure the prompt).
        action: the Action class, with one required field that receives the agent's text, or ``text -> action``.
        observation: ``observation -> text`` for prompts and replies (default :func:`observation_text`).
        name: the task's name in logs.
        **options: :class:`~tokengym.envs.adapters.episodes.EpisodeTask` options (``chat``, ``max_new_tokens``, ...).
    """

    def __init__(self, env: Callable[[], Any], action: Any, observation: Callable[[Any], str] = observation_text,
                 name: str = "openenv", **options: Any):
        require("openenv.core", "openenv", "OpenEnvTask")
        if not callable(env):
            raise TypeError(f"OpenEnvTask: env must be a factory (a class or function), got {type(env).__name__}")
        self.env_factory = env
        self.action = _text_action(action) if isinstance(action, type) else action
        if not callable(self.action):
            raise TypeError(f"OpenEnvTask: action must be an Action class or a function of the text, got {action!r}")
        self.observation = observation
        super().__init__(name, **options)

    def start(self, key: Hashable) -> tuple[str, _Session]:
        session = _Session(self.env_factory(), self.action, self.observation)
        return session.reset(int(key)), session  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"OpenEnvTask({self.name!r})"

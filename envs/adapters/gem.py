"""GEM environments (``gem-llm``: a Gym for LLMs) as tokengym multi-turn tasks (extra: ``tokengym[gem]``).

Each episode is one env of ``gem.make(env_id, **kwargs)``: ``reset(seed)`` gives the prompt, ``step(turn)`` the reply,
the reward (a turn reward) and the end. GEM's games seed and draw from the global ``random`` stream, so each
episode runs with its own (:class:`~tokengym.envs.adapters.episodes.GlobalRandom`) and replays exactly.

Example:
    >>> from tokengym.envs.adapters import GEMTask
    >>> task = GEMTask("game:GuessTheNumber-v0-easy")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Hashable

from .episodes import EpisodeTask, close_env, GlobalRandom, Turn, require

__all__ = ["GEMTask"]


class _GEMEpisode:
    def __init__(self, env: Any):
        self.env, self.rng = env, GlobalRandom()

    def reset(self, seed: int) -> str:
        with self.rng:
            obs, _ = self.env.reset(seed=seed)
        return str(obs)

    def step(self, action: str) -> Turn:
        from gem.utils.constants import TERMINAL_STATE

        with self.rng:
            obs, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        return Turn(None if done and obs == TERMINAL_STATE else str(obs), float(reward), done)  # GEM's "nothing more"

    def close(self) -> None:
        close_env(self.env)


class GEMTask(EpisodeTask):
    """A GEM env id (``game:GuessTheNumber-v0-easy``, ``game:Mastermind-v0-easy``, ...) as a multi-turn task.

    Args:
        env_id: a id registered with GEM (``gem.print_envs()`` lists them).
        env_kwargs: keyword arguments of ``gem.make``.
        **options: :class:`~tokengym.envs.adapters.episodes.EpisodeTask` options (``chat``, ``max_new_tokens``, ...).
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, **options: Any):
        gem = require("gem", "gem", "GEMTask")
        from gem.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            raise ValueError(f"GEMTask: unknown GEM env id {env_id!r} (gem.print_envs() lists them)")
        self.env_id, self.env_kwargs, self._gem = env_id, dict(env_kwargs or {}), gem
        super().__init__(f"gem/{env_id}", **options)

    def start(self, key: Hashable) -> tuple[str, _GEMEpisode]:
        with GlobalRandom():  # construction may reset (and so draw) too
            episode = _GEMEpisode(self._gem.make(self.env_id, **self.env_kwargs))
        return episode.reset(int(key)), episode  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"GEMTask({self.env_id!r})"

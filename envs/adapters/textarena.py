"""TextArena single-player games as tokengym multi-turn tasks (extra: ``tokengym[textarena]``).

Each episode is one game of ``textarena.make(env_id)`` reset with ``num_players=1``: the game's messages to the
player are the prompt and the replies (the player's own move, which TextArena echoes back, is left out: it is already
in the episode), and the reward of ``env.close()`` at the end of the game is a turn reward on the last move.
TextArena's games seed and draw from the global ``random`` stream, so each game runs with its own.

Use the ``-raw`` ids (``GuessTheNumber-v0-raw``): the default ids wrap observations for a model that sees one
message at a time, while a token episode already holds the whole game.
"""

from __future__ import annotations

from typing import Any, Hashable

from .episodes import EpisodeTask, GlobalRandom, Turn, require

__all__ = ["TextArenaTask"]


class _Game:
    def __init__(self, env: Any):
        self.env, self.rng = env, GlobalRandom()

    def messages(self) -> str:
        """The game's messages to the player since its last move (not the move itself)."""
        ta = require("textarena", "textarena", "TextArenaTask")
        _, obs = self.env.get_observation()
        if isinstance(obs, str):
            return obs
        return "\n".join(str(msg) for sender, msg, kind in obs if kind != ta.ObservationType.PLAYER_ACTION)

    def reset(self, seed: int) -> str:
        with self.rng:
            self.env.reset(num_players=1, seed=seed)
            return self.messages()

    def step(self, action: str) -> Turn:
        with self.rng:
            done, _ = self.env.step(action)
            text = self.messages()
            if not done:
                return Turn(text)
            rewards, _ = self.env.close()
        return Turn(text or None, float(rewards.get(0, 0.0)) if rewards else 0.0, True)

    def close(self) -> None:
        pass  # a finished game was closed by its last step; an unfinished one holds nothing to release


class TextArenaTask(EpisodeTask):
    """A single-player TextArena game id as a multi-turn task.

    Args:
        env_id: a TextArena id of a single-player game, preferably a ``-raw`` one (``GuessTheNumber-v0-raw``).
        env_kwargs: keyword arguments of ``textarena.make``.
        **options: :class:`~tokengym.envs.adapters.episodes.EpisodeTask` options (``chat``, ``turn_stop_strings``,
            ``max_new_tokens``, ...).
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, **options: Any):
        ta = require("textarena", "textarena", "TextArenaTask")
        from textarena.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            raise ValueError(f"TextArenaTask: unknown TextArena env id {env_id!r}")
        self.env_id, self.env_kwargs, self._ta = env_id, dict(env_kwargs or {}), ta
        super().__init__(f"textarena/{env_id}", **options)

    def start(self, key: Hashable) -> tuple[str, _Game]:
        with GlobalRandom():
            game = _Game(self._ta.make(self.env_id, **self.env_kwargs))
        try:
            return game.reset(int(key)), game  # type: ignore[arg-type]
        except (AssertionError, ValueError, TypeError) as e:
            raise ValueError(f"TextArenaTask: {self.env_id!r} cannot be played by one player: {e}") from e

    def __repr__(self) -> str:
        return f"TextArenaTask({self.env_id!r})"

"""Gymnasium registration: every id has a single-env and a vector entry point."""

from __future__ import annotations

import gymnasium as gym

__all__ = ["ENV_IDS", "register_envs"]

# id -> (task name, one-line description). Each id works with gymnasium.make and gymnasium.make_vec.
ENV_IDS: dict[str, tuple[str, str]] = {
    "tokengym/Arithmetic-v0": ("arithmetic", "multi-step integer arithmetic, one step per line; verifier + rule-based PRM"),
    "tokengym/Reverse-v0": ("reverse", "reverse a string of letters; exact-match reward"),
    "tokengym/Dataset-v0": ("dataset", "prompts from JSONL / list / datasets.Dataset (data=...), any reward"),
    "tokengym/Target-v0": ("target", "emit a fixed target string; the smallest learnable task, for agent smoke tests"),
    "tokengym/ReasoningGym-v0": ("reasoning_gym", "a reasoning-gym dataset (name=...), scored by its score_answer"),
}


def register_envs() -> None:
    """Register all tokengym ids (idempotent)."""
    for env_id, (task, _) in ENV_IDS.items():
        if env_id in gym.registry:
            continue
        gym.register(
            id=env_id,
            entry_point="tokengym.envs.token_env:TokenEnv",
            vector_entry_point="tokengym.envs.vector_env:TokenVectorEnv",
            kwargs={"task": task},
        )

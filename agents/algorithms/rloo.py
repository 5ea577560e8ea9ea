"""RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline, on the shared skeleton.

Each completion's advantage is its return minus the mean return of the other G - 1 completions of its prompt: an
unbiased baseline with no critic and no std scaling. The loss and every switch are the critic-free ones
(:class:`~tokengym.agents.algorithms.critic_free.CriticFreeConfig`); only the advantage differs from GRPO's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokengym.agents.algorithms.advantages import token_advantages
from tokengym.agents.algorithms.critic_free import CriticFreeConfig
from tokengym.agents.algorithms.grpo import GRPOAgent
from tokengym.agents.algorithms.registry import register
from tokengym.agents.engine.rollout import Rollout

__all__ = ["RLOOConfig", "RLOOAgent"]


@dataclass
class RLOOConfig(CriticFreeConfig):
    """Hyper-parameters of :class:`RLOOAgent`: the critic-free settings (token-level loss by default, as TRL's)."""

    aggregation: str = "token-mean"


class RLOOAgent(GRPOAgent):
    """RLOO on a ``group_size=G >= 2`` :class:`~tokengym.envs.TokenVectorEnv` (outcome rewards).

    Example:
        >>> import gymnasium as gym, tokengym.envs
        >>> from tokengym.agents import Policy
        >>> from tokengym.agents.algorithms.rloo import RLOOAgent, RLOOConfig
        >>> env = gym.make_vec("tokengym/Target-v0", num_envs=16, vectorization_mode="vector_entry_point",
        ...                    group_size=4, partial_credit=True)
        >>> len(RLOOAgent(Policy.from_pretrained("tiny"), RLOOConfig(steps=2)).learn(env))
        2
    """

    config_cls = RLOOConfig

    @staticmethod
    def needs_process_reward(config) -> bool:
        return False

    def advantages(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
        """The leave-one-out advantage of each episode's (shaped) return on every one of its action tokens (the
        ``rloo`` estimator, whatever ``advantage`` a subclass's config names)."""
        return token_advantages("rloo", ro, self.shaped_returns(ro), self.config, ref_logp)

    def why_groups(self) -> str | None:
        return "RLOO's baseline is the other completions of a prompt"


register("rloo", RLOOConfig, "RLOO: REINFORCE with a leave-one-out baseline over each prompt's G completions",
         agent=RLOOAgent, min_group=2, data_parallel=True)

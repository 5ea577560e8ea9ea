"""REINFORCE++ (Hu 2025): global batch-normalised advantages with a token-level KL penalty in the reward.

Each token's reward is the env's reward minus ``kl_coef`` times KL(pi_old || ref) at that token; its advantage is
the return-to-go, whitened over every action token of the batch (no critic, no per-prompt groups). The baseline
variant (``group_baseline``, "REINFORCE++-baseline") first subtracts each prompt's mean return, then whitens the
same way. The loss and the switches are the critic-free ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.runtime.config import check_config
from tokengym.agents.algorithms.grpo import CriticFreeConfig, GRPOAgent
from tokengym.agents.algorithms.registry import register
from tokengym.agents.engine.rollout import Rollout

__all__ = ["ReinforcePPConfig", "ReinforcePPAgent"]


@dataclass
class ReinforcePPConfig(CriticFreeConfig):
    """Hyper-parameters of :class:`ReinforcePPAgent`."""

    aggregation: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum."""
    kl_coef: float = 0.01
    """Weight of the token-level KL(pi_old || ref) in the reward (0 skips the reference model)."""
    kl_estimator: str = "k1"
    """KL estimator: k1 (the paper's, in the reward), k2 or k3."""
    gamma: float = 1.0
    """Discount of the return-to-go over the agent's tokens."""
    group_baseline: bool = False
    """REINFORCE++-baseline: subtract each prompt's mean return before whitening (needs group_size >= 2)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_config(self, {"kl_coef": self.kl_coef >= 0, "gamma": 0 <= self.gamma <= 1})


class ReinforcePPAgent(GRPOAgent):
    """REINFORCE++ on a :class:`~tokengym.envs.TokenVectorEnv` (any group size; >= 2 for the baseline variant).

    Example:
        >>> import gymnasium as gym, tokengym.envs
        >>> from tokengym.agents import Policy
        >>> from tokengym.agents.algorithms.reinforce_pp import ReinforcePPAgent, ReinforcePPConfig
        >>> env = gym.make_vec("tokengym/Target-v0", num_envs=16, vectorization_mode="vector_entry_point",
        ...                    partial_credit=True)
        >>> len(ReinforcePPAgent(Policy.from_pretrained("tiny"), ReinforcePPConfig(steps=2)).learn(env))
        2
    """

    config_cls = ReinforcePPConfig

    @staticmethod
    def needs_process_reward(config) -> bool:
        return False

    def uses_reference(self) -> bool:
        return self.config.beta > 0 or self.config.kl_coef > 0

    def advantages(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
        """Whitened returns-to-go of the env's rewards (and the overlong penalty) minus the KL penalty."""
        cfg, am = self.config, ro.action_mask
        rewards = ro.rewards.clone()
        if cfg.overlong_buffer > 0:  # the penalty joins the reward on the episode's last agent token
            last = (am.cumsum(1) == am.sum(1, keepdim=True)) & am.bool()
            rewards = rewards + last * (self.shaped_returns(ro) - ro.returns)[:, None]
        kl = F.kl_penalty(ro.logprobs, ref_logp, cfg.kl_estimator) * am if ref_logp is not None and cfg.kl_coef > 0 else None
        return V.reinforce_pp_advantages(rewards, am, kl, cfg.kl_coef if kl is not None else 0.0, cfg.gamma,
                                         ro.group_size if cfg.group_baseline else None)

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None):
        batch, stats = super().prepare(ro, old_logp, ref_logp)
        if self.config.beta == 0:  # the reference serves the reward's KL only
            batch.pop("ref_logp", None)
        return batch, stats

    def why_groups(self) -> str | None:
        return "group_baseline subtracts each prompt's mean return" if self.config.group_baseline else None


register("reinforce-pp", ReinforcePPConfig, "REINFORCE++: whitened returns with a token-level KL in the reward "
         "(group_baseline: REINFORCE++-baseline)", agent=ReinforcePPAgent, data_parallel=True)

"""REINFORCE++ (Hu 2025): global batch-normalised advantages with a token-level KL penalty in the reward.

Each token's reward is the env's reward minus ``beta`` times KL(pi_old || ref) at that token; its advantage is
the return-to-go, whitened over every action token of the batch (no critic, no per-prompt groups). The baseline
variant (``group_baseline``, "REINFORCE++-baseline") first subtracts each prompt's mean return, then whitens the
same way. With ``kl_in_reward=False`` the KL is a loss term instead, as GRPO's. The loss and the switches are the
critic-free ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.algorithms.critic_free import CriticFreeConfig
from tokengym.agents.algorithms.grpo import GRPOAgent
from tokengym.agents.algorithms.registry import register
from tokengym.agents.engine.rollout import Rollout

__all__ = ["ReinforcePPConfig", "ReinforcePPAgent"]


@dataclass
class ReinforcePPConfig(CriticFreeConfig, renames={"kl_coef": "beta"}):
    """Hyper-parameters of :class:`ReinforcePPAgent` (beta and kl_estimator: the paper's KL in the reward, k1)."""

    aggregation: str = "token-mean"
    beta: float = 0.01
    kl_estimator: str = "k1"
    kl_in_reward: bool = True
    """Where the beta term goes: a per-token penalty in the reward (the paper's, verl's use_kl_in_reward) or, with
    false, a KL term in the loss as GRPO's."""
    gamma: float = 1.0
    """Discount of the return-to-go over the agent's tokens."""
    group_baseline: bool = False
    """REINFORCE++-baseline: subtract each prompt's mean return before whitening (needs group_size >= 2)."""

    def checks(self) -> dict[str, bool]:
        return {**super().checks(), "gamma": 0 <= self.gamma <= 1}

    @classmethod
    def legacy_values(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Settings from before the rename, when ``beta`` weighted a KL term in the loss beside ``kl_coef``'s in the
        reward: one of them (the other 0) becomes ``beta`` with ``kl_in_reward`` to match."""
        if "kl_coef" not in values or "beta" not in values:
            return values
        values = dict(values)
        loss_kl, reward_kl = values.pop("beta"), values["kl_coef"]
        if _nonzero(loss_kl) and _nonzero(reward_kl):
            raise ValueError(f"ReinforcePPConfig: the old beta={loss_kl!r} (a KL term in the loss) with kl_coef="
                             f"{reward_kl!r} (a KL in the reward) is no longer supported; set beta and kl_in_reward")
        if _nonzero(loss_kl):
            values.update(kl_coef=loss_kl, kl_in_reward=False)
        return values


def _nonzero(value: Any) -> bool:
    """Whether a (possibly textual) KL coefficient is not 0."""
    try:
        return float(value) != 0
    except (TypeError, ValueError):
        return True


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

    def advantages(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
        """Whitened returns-to-go of the env's rewards (and the overlong penalty) minus the KL penalty."""
        cfg, am = self.config, ro.action_mask
        rewards = ro.rewards.clone()
        if cfg.overlong_buffer > 0:  # the penalty joins the reward on the episode's last agent token
            last = (am.cumsum(1) == am.sum(1, keepdim=True)) & am.bool()
            rewards = rewards + last * (self.shaped_returns(ro) - ro.returns)[:, None]
        kl = F.kl_penalty(ro.logprobs, ref_logp, cfg.kl_estimator) * am if ref_logp is not None and cfg.kl_in_reward else None
        return V.reinforce_pp_advantages(rewards, am, kl, cfg.beta if kl is not None else 0.0, cfg.gamma,
                                         ro.group_size if cfg.group_baseline else None)

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None):
        batch, stats = super().prepare(ro, old_logp, ref_logp)
        if self.config.kl_in_reward:  # the reference serves the reward's KL only
            batch.pop("ref_logp", None)
        return batch, stats

    def why_groups(self) -> str | None:
        return "group_baseline subtracts each prompt's mean return" if self.config.group_baseline else None


register("reinforce-pp", ReinforcePPConfig, "REINFORCE++: whitened returns with a token-level KL in the reward "
         "(group_baseline: REINFORCE++-baseline)", agent=ReinforcePPAgent, data_parallel=True)

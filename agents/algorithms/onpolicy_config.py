"""The settings every on-policy agent shares (GRPO, RLOO, REINFORCE++, PPO), each defined and checked once.

An algorithm's config extends :class:`OnPolicyConfig`: it redeclares a field only to change its default (the
docstring, which ``--help`` prints, stays the base's), adds its own fields after these, and adds their checks
through :meth:`~OnPolicyConfig.checks` and :meth:`~OnPolicyConfig.choices`. The skeleton
(:class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`) reads these fields directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tokengym.agents import functional as F
from tokengym.agents.runtime.config import check_config
from tokengym.agents.runtime.optim import LR_SCHEDULES
from tokengym.rewards.common import Renamed, check_field_types

__all__ = ["OnPolicyConfig"]


@dataclass
class OnPolicyConfig(Renamed, renames={"lr_schedule": "lr_scheduler_type"}):
    """Settings of the on-policy skeleton: the schedule, the update, the clipped loss, the KL to a reference."""

    lr: float = 1e-4
    """AdamW learning rate of the policy (the peak of lr_scheduler_type)."""
    lr_scheduler_type: str = "constant"
    """Learning-rate schedule over all iterations * steps sampling steps: constant, linear or cosine (both decay to 0)."""
    warmup_steps: int = 0
    """Sampling steps of linear learning-rate warmup before the schedule (0 = none)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the policy."""
    iterations: int = 1
    """Outer iterations; the reference model is reset to the policy at the start of each when reset_ref is on."""
    steps: int = 50
    """Sampling steps per outer iteration (one rollout batch and its update each)."""
    mu: int = 1
    """Optimisation epochs over each rollout batch."""
    minibatches: int = 1
    """Minibatches per epoch (rows are shuffled; a prompt's completions need not stay together)."""
    clip_eps: float = 0.2
    """Lower clip range of the ratio (and upper, unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper clip range ("clip-higher"); None = clip_eps."""
    beta: float = 0.0
    """KL coefficient: weight of the KL to the frozen reference model (a loss term for GRPO and RLOO, a per-token
    penalty in the reward for PPO and REINFORCE++); 0 skips the reference model entirely."""
    kl_estimator: str = "k3"
    """KL estimator of the beta term: k1, k2 or k3."""
    reset_ref: bool = False
    """Reset the reference model to the current policy at the start of every outer iteration."""
    aggregation: str = "seq-mean-token-mean"
    """Policy-loss aggregation: token-mean, seq-mean-token-mean (GRPO's paper) or seq-mean-token-sum."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm of each optimised model (PPO: the policy and the critic) (0 = off)."""
    recompute_old_logprobs: bool = False
    """Recompute pi_old log-probs with a forward pass instead of reusing the rollout's (needed only when sampling used top-k/top-p)."""
    bf16: bool = False
    """bf16 autocast in the rollout (the fast decoder multiplies bf16 weights) and the update's forward/backward (ratios are 1 only up to bf16 rounding)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: far less update memory for
    about a third more update compute (TRL's GRPOTrainer does this by default)."""
    eval_every: int = 10
    """Evaluate on held-out prompts every this many sampling steps when learn() gets eval samples (0 = only at the end)."""
    seed: int = 0
    """Seeds the env's prompt stream, the policy's sampler, minibatch shuffling and any freshly built head (PPO's critic)."""

    def __post_init__(self) -> None:
        check_field_types(self)  # types first: the bounds below compare values
        checks = {
            "lr": self.lr > 0, "warmup_steps": self.warmup_steps >= 0, "weight_decay": self.weight_decay >= 0,
            "iterations": self.iterations >= 1, "steps": self.steps >= 0, "mu": self.mu >= 1,
            "minibatches": self.minibatches >= 1, "clip_eps": self.clip_eps > 0,
            "clip_eps_high": self.clip_eps_high is None or self.clip_eps_high > 0, "beta": self.beta >= 0,
            "entropy_coef": self.entropy_coef >= 0, "max_grad_norm": self.max_grad_norm >= 0,
            "eval_every": self.eval_every >= 0,
        }
        choices = {"lr_scheduler_type": LR_SCHEDULES, "kl_estimator": F.KL_ESTIMATORS, "aggregation": F.AGGREGATIONS}
        check_config(self, {**checks, **self.checks()}, {**choices, **self.choices()})
        z = torch.zeros(1, 1)
        try:  # the loss's own argument checks (clip ranges) now, not after the first rollout
            F.policy_loss(z, z, z, z, self.clip_eps, self.clip_eps_high, self.aggregation)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None

    def checks(self) -> dict[str, bool]:
        """``{field: valid}`` bounds of a subclass's own fields, checked with the shared ones."""
        return {}

    def choices(self) -> dict[str, Iterable[Any]]:
        """``{field: valid values}`` of a subclass's choice-valued fields, checked with the shared ones."""
        return {}

    @property
    def reuse_rollout_logprobs(self) -> bool:
        """pi_old log-probs come from the rollout (no extra forward) unless a setting needs the trainer's own."""
        return not self.recompute_old_logprobs

"""The settings of the critic-free agents (GRPO, RLOO, REINFORCE++): the on-policy ones plus the loss kinds and the
2025-26 switches (GSPO, KL-Cov/Clip-Cov, DAPO's dynamic sampling and overlong shaping, rollout/trainer correction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from tokengym.agents.algorithms.losses import LOSSES, policy_loss
from tokengym.agents.algorithms.onpolicy_config import OnPolicyConfig

__all__ = ["CriticFreeConfig", "LOSSES"]


@dataclass
class CriticFreeConfig(OnPolicyConfig):
    """Settings every critic-free agent shares (GRPO, RLOO, REINFORCE++): :class:`OnPolicyConfig`'s and the
    switches below."""

    skip_zero_advantage: bool = True
    """With no KL term in the loss and entropy_coef = 0, run rows whose advantage is 0 on every token (groups with
    equal rewards) through the update's forward without autograd and leave them out of the backward: exact, as
    they add nothing to the loss or its gradient; the logged statistics still cover every row."""
    loss: str = "clip"
    """Policy loss (any registered one: tokengym.agents.algorithms.losses): clip (the clipped token-level surrogate of
    PPO/GRPO), gspo (a sequence-level ratio, clipped per sequence; use clip ranges near 3e-4/4e-4), kl-cov or
    clip-cov (unclipped, with the highest-covariance tokens held by a KL term or detached, keeping entropy up)."""
    cov_select_ratio: float = 2e-3
    """kl-cov / clip-cov: fraction of the batch's tokens selected by covariance."""
    cov_kl_coef: float = 1.0
    """kl-cov: weight of |log pi - log pi_old| on the selected tokens."""
    cov_low: float = 1.0
    """clip-cov: lower bound of the covariance window tokens are drawn from."""
    cov_high: float = 5.0
    """clip-cov: upper bound of the covariance window."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more until the batch has as many groups as one
    rollout (at most max_extra_rollouts more rollouts per step; the kept fraction is logged)."""
    max_extra_rollouts: int = 4
    """Dynamic sampling: the cap on extra rollout batches per step (the step trains on what it has then)."""
    overlong_buffer: float = 0.0
    """DAPO soft overlong punishment: the last fraction of the token budget over which a linear penalty grows to
    overlong_penalty (0 = off)."""
    overlong_penalty: float = 1.0
    """The penalty at the token budget (soft overlong punishment)."""
    mask_truncated: bool = False
    """DAPO overlong filtering: episodes cut at the token budget take no part in the loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name, loss = type(self).__name__, policy_loss(self.loss)
        if loss.aggregation is not None and self.aggregation != loss.aggregation:
            raise ValueError(f"{name}: loss={self.loss!r} takes aggregation={loss.aggregation!r}; aggregation="
                             f"{self.aggregation!r} does not apply to it (use aggregation={loss.aggregation!r})")
        if self.dynamic_sampling and self.async_mode != "off":
            raise ValueError(f"{name}: dynamic_sampling draws extra rollouts within a step, which the async workers' "
                             "one-rollout-per-step schedule does not serve; use async_mode='off' or drop dynamic_sampling")
        if self.correction not in ("none", "auto") and not loss.takes_weights:
            raise ValueError(f"{name}: correction={self.correction!r} weights a loss's tokens (clip's); it does not "
                             f"combine with loss={self.loss!r}")

    def checks(self) -> dict[str, bool]:
        return {"cov_select_ratio": 0 < self.cov_select_ratio <= 1, "cov_high": self.cov_high >= self.cov_low,
                "max_extra_rollouts": self.max_extra_rollouts >= 0, "overlong_buffer": 0 <= self.overlong_buffer < 1,
                "overlong_penalty": self.overlong_penalty >= 0}

    def choices(self) -> dict[str, Iterable[Any]]:
        return {"loss": LOSSES}  # a live view: a loss registered later is a choice

    @property
    def correction_mode(self) -> str:
        """The correction in force: ``auto`` is tis in async modes with a loss that takes its weights (clip)."""
        auto_off = self.correction == "auto" and not policy_loss(self.loss).takes_weights
        return "none" if auto_off else super().correction_mode

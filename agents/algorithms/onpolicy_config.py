"""The settings every on-policy agent shares (GRPO, RLOO, REINFORCE++, PPO), each defined and checked once.

An algorithm's config extends :class:`OnPolicyConfig`: it redeclares a field only to change its default (the
docstring, which ``--help`` prints, stays the base's), adds its own fields after these, and adds their checks
through :meth:`~OnPolicyConfig.checks` and :meth:`~OnPolicyConfig.choices`
(:class:`~tokengym.rewards.common.FieldChecks`). The shared fields are declared in the bases: the optimiser's and
the training loop's in :mod:`tokengym.rewards.training`, the rollout engine's in
:mod:`tokengym.agents.engine.config`. The skeleton (:class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`)
reads these fields directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.engine.config import EngineConfig
from tokengym.agents.runtime.optim import ScheduledOptimConfig, TrainLoopConfig
from tokengym.rewards.common import Renamed

__all__ = ["OnPolicyConfig"]


@dataclass
class OnPolicyConfig(EngineConfig, TrainLoopConfig, ScheduledOptimConfig, Renamed,
                     renames={"lr_schedule": "lr_scheduler_type"}):
    """Settings of the on-policy skeleton: the optimiser's and the training loop's (shared with every trainer,
    :mod:`tokengym.rewards.training`), the rollout engine's (:class:`~tokengym.agents.engine.config.EngineConfig`),
    and below them the schedule, the update, the clipped loss, the KL to a reference."""

    eval_every: int = 10
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
    recompute_old_logprobs: bool = False
    """Recompute pi_old log-probs with a forward pass instead of reusing the rollout's (needed only when sampling used top-k/top-p)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: far less update memory for
    about a third more update compute (TRL's GRPOTrainer does this by default)."""
    mask_training: str = "masked"
    """Where the env masks its actions (a grammar): masked scores pi_old, pi_theta and the reference under the allowed
    set each token was sampled under (exact ratios); unmasked scores them over the whole vocabulary (what a trainer that
    only passes the grammar to its sampler does), for comparison."""
    correction: str = "auto"
    """Rollout/trainer correction: none, tis (truncated importance sampling) or mis (masked), or auto (tis in async
    modes and with sampler=vllm, none otherwise). pi_old is then recomputed by the trainer (the proximal policy the ratio is clipped
    against) and each token's loss is weighted by min(pi_old/pi_behaviour, cap) (tis) or dropped above the cap (mis),
    pi_behaviour being the sampler's log-probs (in async modes: the worker's, of an older policy version)."""
    correction_level: str = "token"
    """Importance ratio of the correction per token or per sequence (the product over its tokens)."""
    correction_cap: float = 2.0
    """Cap of the correction's importance ratio."""
    eval_k: int = 0
    """Also log eval/pass@k, eval/maj@k and eval/mean@k at every held-out evaluation, from eval_n sampled completions
    per held-out prompt at the run's temperature (0 = off). The draws come from a seed of their own (the same at
    every evaluation), so the training streams and results are those of a run without them."""
    eval_n: int | None = None
    """Sampled completions per held-out prompt that eval_k's metrics are estimated from (>= eval_k; None = eval_k)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # every field's checks (a subclass's too: checks() and choices()), the engine's
        if self.eval_n is not None and not 1 <= self.eval_k <= self.eval_n:
            raise ValueError(f"{type(self).__name__}: eval_n={self.eval_n} needs 1 <= eval_k <= eval_n (eval_n sampled "
                             f"completions per held-out prompt estimate pass@k, maj@k and mean@k), got eval_k={self.eval_k}")
        z = torch.zeros(1, 1)
        try:  # the loss's own argument checks (clip ranges) now, not after the first rollout
            F.policy_loss(z, z, z, z, self.clip_eps, self.clip_eps_high, self.aggregation)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None

    def checks(self) -> dict[str, bool]:
        """``{field: valid}`` bounds of the fields a class declares (a subclass's own are checked with these)."""
        return {"iterations": self.iterations >= 1, "steps": self.steps >= 0, "mu": self.mu >= 1,
                "minibatches": self.minibatches >= 1, "clip_eps": self.clip_eps > 0,
                "clip_eps_high": self.clip_eps_high is None or self.clip_eps_high > 0, "beta": self.beta >= 0,
                "entropy_coef": self.entropy_coef >= 0, "correction_cap": self.correction_cap >= 1,
                "eval_k": self.eval_k >= 0}

    def choices(self) -> dict[str, Iterable[Any]]:
        """``{field: valid values}`` of the choice-valued fields a class declares (checked with these)."""
        return {"kl_estimator": F.KL_ESTIMATORS, "aggregation": F.AGGREGATIONS,
                "correction": ("auto", "none", *V.CORRECTION_MODES), "correction_level": V.CORRECTION_LEVELS,
                "mask_training": ("masked", "unmasked")}

    @property
    def eval_samples_per_prompt(self) -> int:
        """n of the held-out pass@k / maj@k / mean@k: ``eval_n``, else ``eval_k`` (0: those metrics are off)."""
        return self.eval_k if self.eval_n is None else self.eval_n

    @property
    def correction_mode(self) -> str:
        """The correction in force (``auto`` resolved): none, tis or mis."""
        if self.correction == "auto":  # the sampler's log-probs are another engine's, or another version's
            return "tis" if self.async_mode != "off" or self.sampler != "tokengym" else "none"
        return self.correction

    @property
    def reuse_rollout_logprobs(self) -> bool:
        """pi_old log-probs come from the rollout (no extra forward) unless recompute or a correction asks for the
        trainer's own."""
        return not (self.recompute_old_logprobs or self.correction_mode != "none")

"""Policy losses of the critic-free agents by name: what ``loss=`` (:attr:`CriticFreeConfig.loss
<tokengym.agents.algorithms.critic_free.CriticFreeConfig.loss>`) chooses. A new loss is one file that decorates its
function with :func:`register_loss` (and its tests); the config's choices and checks and ``GRPOAgent.policy_terms``
read this registry when they run.

A loss function takes a :class:`LossInputs` (one minibatch) and returns ``(loss, stats)``: a scalar the agent adds to
its terms with the config's ``aggregation``, and a dict of detached statistics to log. Its metadata tells the agent
and the config what it needs (see :class:`PolicyLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.engine.registry import Names, Registry

__all__ = ["LOSSES", "LossInputs", "PolicyLoss", "policy_loss", "register_loss", "unregister_loss", "POLICY_LOSSES"]


@dataclass(frozen=True)
class LossInputs:
    """One minibatch's tensors for a policy loss (``[B, M]`` each, over the minibatch's rows)."""

    logp: torch.Tensor
    """The current policy's log-probs of the sampled tokens (with gradient)."""
    old_logp: torch.Tensor
    """pi_old's log-probs (the ratio's denominator)."""
    adv: torch.Tensor
    """Per-token advantages (0 off the mask)."""
    mask: torch.Tensor
    """The tokens that take part in the loss."""
    config: Any
    """The agent's config (clip ranges, aggregation, the loss's own settings)."""
    weights: torch.Tensor | None = None
    """The rollout correction's per-token weights (only for a loss registered with ``takes_weights``; else None)."""
    generator: torch.Generator | None = None
    """The agent's shuffle generator (what a loss that draws, such as kl-cov's tie-breaking, draws from)."""


@dataclass(frozen=True)
class PolicyLoss:
    """One registered policy loss and what it needs."""

    name: str
    fn: Callable[[LossInputs], tuple[torch.Tensor, dict[str, Any]]]
    proportional_to_advantage: bool = False
    """Its gradient is proportional to the advantage, so a row whose advantage is 0 on every token adds nothing
    (``skip_zero_advantage`` leaves such rows out of the backward)."""
    sequence_level: bool = False
    """It takes one advantage per sequence: it needs one outcome per episode (not ``advantage='process'``, nor a
    teacher's per-token rewards)."""
    takes_weights: bool = False
    """It applies the rollout correction's per-token weights (``correction`` other than none needs such a loss)."""
    aggregation: str | None = None
    """The ``aggregation`` it requires (None: any)."""
    help: str = ""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "loss")
"""Every registered policy loss by name."""

LOSSES = Names(POLICY_LOSSES)
"""The registered losses' names (a live view; once the tuple of the bundled four)."""


def register_loss(name: str, fn: Callable | None = None, *, proportional_to_advantage: bool = False,
                  sequence_level: bool = False, takes_weights: bool = False, aggregation: str | None = None,
                  help: str = ""):
    """Register ``fn`` as policy loss ``name``; without ``fn``, a decorator. Returns ``fn``."""
    def decorate(f: Callable) -> Callable:
        POLICY_LOSSES.add(name, PolicyLoss(name, f, proportional_to_advantage, sequence_level, takes_weights,
                                           aggregation, help))
        return f

    return decorate if fn is None else decorate(fn)


def unregister_loss(name: str) -> PolicyLoss:
    """Remove policy loss ``name`` (what a test registered)."""
    return POLICY_LOSSES.remove(name)


def policy_loss(name: str) -> PolicyLoss:
    """Policy loss ``name``; an unknown one is a one-line ``ValueError`` naming the registered ones."""
    return POLICY_LOSSES.get(name)


@register_loss("clip", proportional_to_advantage=True, takes_weights=True,
               help="the clipped token-level surrogate of PPO/GRPO")
def clip_loss(x: LossInputs):
    cfg = x.config
    return F.policy_loss(x.logp, x.old_logp, x.adv, x.mask, cfg.clip_eps, cfg.clip_eps_high, cfg.aggregation, x.weights)


@register_loss("gspo", proportional_to_advantage=True, sequence_level=True, aggregation="seq-mean-token-mean",
               help="a sequence-level ratio, clipped per sequence")
def gspo_loss(x: LossInputs):
    seq_adv = x.adv.sum(1) / x.mask.sum(1).clamp(min=1)  # outcome advantages are the same on every token of a row
    return V.gspo_loss(x.logp, x.old_logp, seq_adv, x.mask, x.config.clip_eps, x.config.clip_eps_high)


def _cov_loss(mode: str) -> Callable[[LossInputs], Any]:
    def loss(x: LossInputs):
        cfg = x.config
        return V.cov_policy_loss(x.logp, x.old_logp, x.adv, x.mask, mode, cfg.cov_select_ratio, cfg.cov_kl_coef,
                                 (cfg.cov_low, cfg.cov_high), cfg.aggregation, x.generator)

    loss.__name__ = loss.__qualname__ = f"{mode.replace('-', '_')}_loss"
    return loss


register_loss("kl-cov", _cov_loss("kl-cov"), help="unclipped; the highest-covariance tokens held by a KL term")
register_loss("clip-cov", _cov_loss("clip-cov"), help="unclipped; the highest-covariance tokens detached")

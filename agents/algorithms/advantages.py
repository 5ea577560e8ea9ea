"""Advantage estimators of the group-based agents by name: what ``advantage=`` (:attr:`GRPOConfig.advantage
<tokengym.agents.algorithms.grpo.GRPOConfig.advantage>`) chooses. A new estimator is one file that decorates its
function with :func:`register_advantage` (and its tests); the config's choices and checks, the agent's
``needs_process_reward`` and ``GRPOAgent.advantages`` read this registry when they run.

An estimator takes an :class:`AdvantageInputs` (one rollout) and returns the advantages: ``[N]`` (one per episode,
put on every one of its action tokens) or ``[N, M]`` (per token); :func:`token_advantages` zeroes them off the
action mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.engine.registry import Names, Registry
from tokengym.agents.engine.rollout import Rollout

__all__ = ["ADVANTAGES", "AdvantageEstimator", "AdvantageInputs", "advantage_estimator", "register_advantage",
           "token_advantages", "unregister_advantage", "ADVANTAGE_ESTIMATORS"]


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads."""

    rollout: Rollout
    returns: torch.Tensor
    """Each episode's return ``[N]``, shaped (DAPO's soft overlong penalty, when the config sets it)."""
    config: Any
    """The agent's config (e.g. ``scale_rewards``)."""
    ref_logp: torch.Tensor | None = None
    """The reference's log-probs ``[N, M]`` when the agent has a reference, else None."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registered estimator and what it needs."""

    name: str
    fn: Callable[[AdvantageInputs], torch.Tensor]
    needs_process_reward: bool = False
    """It reads the env's per-step (PRM) rewards: the env must have a process reward."""
    per_episode: bool = True
    """One advantage per episode, from its (shaped) return; False (per-token advantages) rules out the overlong
    penalty and sequence-level losses, which need one outcome per episode."""
    help: str = ""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "advantage")
"""Every registered estimator by name."""

ADVANTAGES = Names(ADVANTAGE_ESTIMATORS)
"""The registered estimators' names (a live view)."""


def register_advantage(name: str, fn: Callable | None = None, *, needs_process_reward: bool = False,
                       per_episode: bool = True, help: str = ""):
    """Register ``fn`` as advantage estimator ``name``; without ``fn``, a decorator. Returns ``fn``."""
    def decorate(f: Callable) -> Callable:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name, f, needs_process_reward, per_episode, help))
        return f

    return decorate if fn is None else decorate(fn)


def unregister_advantage(name: str) -> AdvantageEstimator:
    """Remove estimator ``name`` (what a test registered)."""
    return ADVANTAGE_ESTIMATORS.remove(name)


def advantage_estimator(name: str) -> AdvantageEstimator:
    """Estimator ``name``; an unknown one is a one-line ``ValueError`` naming the registered ones."""
    return ADVANTAGE_ESTIMATORS.get(name)


def token_advantages(name: str, ro: Rollout, returns: torch.Tensor, config: Any,
                     ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages ``[N, M]`` of estimator ``name`` on a rollout (0 off the action mask)."""
    adv = advantage_estimator(name).fn(AdvantageInputs(ro, returns, config, ref_logp))
    if adv.dim() == 1:
        adv = adv[:, None].expand(-1, ro.action_mask.shape[1])
    return adv * ro.action_mask


@register_advantage("outcome", help="each episode's return normalised within its group (scale_rewards)")
def outcome_advantages(x: AdvantageInputs) -> torch.Tensor:
    return F.group_advantages(x.returns, x.rollout.group_size, scale=x.config.scale_rewards)


@register_advantage("process", needs_process_reward=True, per_episode=False,
                    help="the PRM's step rewards, normalised within each group, summed to go")
def process_advantages(x: AdvantageInputs) -> torch.Tensor:
    ro = x.rollout
    step_rewards, step_ends = ro.step_rewards()
    return F.process_advantages(step_rewards, step_ends, ro.group_size, ro.action_mask.shape[1])


@register_advantage("rloo", help="each episode's return minus the mean return of the other completions of its prompt")
def rloo_advantages(x: AdvantageInputs) -> torch.Tensor:
    return V.rloo_advantages(x.returns, x.rollout.group_size)

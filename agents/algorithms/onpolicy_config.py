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
from tokengym.agents import variants as V
from tokengym.agents.engine.generation import SAMPLERS
from tokengym.agents.engine.packing import PACKING
from tokengym.agents.engine.workers import ASYNC_MODES
from tokengym.agents.runtime.config import check_config
from tokengym.agents.runtime.weight_sync import WeightSync
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
    packing: str = "auto"
    """Update forwards (pi_old, the reference, the update, PPO's critic) over the real tokens packed into bins of the
    longest row's width instead of the padded batch: off, bins, or auto (bins when they hold at most 80% of the padded
    tokens). Log-probs and values are equal up to float rounding (tokengym.agents.engine.packing)."""
    mask_training: str = "masked"
    """Where the env masks its actions (a grammar): masked scores pi_old, pi_theta and the reference under the allowed
    set each token was sampled under (exact ratios); unmasked scores them over the whole vocabulary (what a trainer that
    only passes the grammar to its sampler does), for comparison."""
    eval_every: int = 10
    """Evaluate on held-out prompts every this many sampling steps when learn() gets eval samples (0 = only at the end)."""
    seed: int = 0
    """Seeds the env's prompt stream, the policy's sampler, minibatch shuffling and any freshly built head (PPO's critic)."""
    correction: str = "auto"
    """Rollout/trainer correction: none, tis (truncated importance sampling) or mis (masked), or auto (tis in async
    modes and with sampler=vllm, none otherwise). pi_old is then recomputed by the trainer (the proximal policy the ratio is clipped
    against) and each token's loss is weighted by min(pi_old/pi_behaviour, cap) (tis) or dropped above the cap (mis),
    pi_behaviour being the sampler's log-probs (in async modes: the worker's, of an older policy version)."""
    correction_level: str = "token"
    """Importance ratio of the correction per token or per sequence (the product over its tokens)."""
    correction_cap: float = 2.0
    """Cap of the correction's importance ratio."""
    sampler: str = "tokengym"
    """Rollout backend: tokengym (the policy's own fast decoder, in process) or vllm (an in-process vLLM engine,
    pip install 'tokengym[vllm]': the policy's weights are loaded into it by name after every update, its log-probs
    are the behaviour log-probs, and correction=auto is tis)."""
    async_mode: str = "off"
    """Rollouts in worker processes while the learner updates: off, one-step (each rollout sampled by the policy one
    update older: a fixed schedule, deterministic and exactly resumable) or bounded (the newest weights a worker
    holds, at most max_staleness updates old); see tokengym.agents.engine.workers."""
    max_staleness: int = 1
    """Async: the most policy updates a rollout may lag the update it trains (one-step: 1; bounded: 0 = synchronous
    training through the workers, bit for bit)."""
    rollout_workers: int = 1
    """Async: rollout worker processes (worker i samples rollouts i, i + n, ...; its prompts and samples use seed + i);
    the command line's --rollout-workers also takes host:port,... of `tokengym worker` servers (remote_workers)."""
    worker_threads: int = 1
    """Async: torch CPU threads of each rollout worker."""
    sync_timeout: float = 300.0
    """Async: seconds a weight sync may wait for a worker before the run stops with an error naming it (1 s to 7 days)."""
    rollout_timeout: float = 1800.0
    """Async: seconds the learner waits for the rollout it needs before the run stops with an error naming the worker
    (a task's sample() or reward(), or a tool, that never returns; 1 s to 7 days)."""

    remote_workers: str = ""
    """Async: host:port,... of `tokengym worker` servers that sample the rollouts, one worker each, instead of local
    worker processes (the CLI's --rollout-workers takes a count or these addresses; the secret: worker_secret_file
    or $TOKENGYM_SECRET)."""
    min_workers: int = 0
    """Async, remote workers: the run goes on while at least this many remain when one is lost, and a lost one that
    answers again rejoins (0: every worker; a lost one stops the run in one line)."""
    worker_secret_file: str = ""
    """Async, remote workers: a file whose first line is the workers' shared secret (empty: $TOKENGYM_SECRET)."""
    sync_host: str = ""
    """Async, remote workers: the address the workers reach this learner's weight store at (empty: this machine's
    address on the route to the first worker)."""
    sync_port: int = 0
    """Async, remote workers: the weight store's TCP port (0: a free port)."""
    sync_dir: str = ""
    """Async, remote workers: a folder the learner and every worker can read (a shared filesystem); each version goes
    there as a safetensors file instead of over a weight group, for networks where no group can be formed."""
    sync_bucket_mb: float = 16.0
    """Async: MiB per weight-sync bucket; the learner's extra memory for syncs is one bucket (kept between them) and,
    during one, one gathered tensor."""

    @property
    def worker_addresses(self) -> list[str]:
        """The remote workers' addresses (empty: local workers)."""
        return [a.strip() for a in self.remote_workers.split(",") if a.strip()]

    @property
    def worker_count(self) -> int:
        """How many rollout workers: the remote addresses, else ``rollout_workers``."""
        return len(self.worker_addresses) or self.rollout_workers

    def __post_init__(self) -> None:
        check_field_types(self)  # types first: the bounds below compare values
        checks = {
            "lr": self.lr > 0, "warmup_steps": self.warmup_steps >= 0, "weight_decay": self.weight_decay >= 0,
            "iterations": self.iterations >= 1, "steps": self.steps >= 0, "mu": self.mu >= 1,
            "minibatches": self.minibatches >= 1, "clip_eps": self.clip_eps > 0,
            "clip_eps_high": self.clip_eps_high is None or self.clip_eps_high > 0, "beta": self.beta >= 0,
            "entropy_coef": self.entropy_coef >= 0, "max_grad_norm": self.max_grad_norm >= 0,
            "eval_every": self.eval_every >= 0, "correction_cap": self.correction_cap >= 1,
            "max_staleness": self.max_staleness >= 0, "rollout_workers": self.rollout_workers >= 1,
            "worker_threads": self.worker_threads >= 1,
            "sync_timeout": 1 <= self.sync_timeout <= WeightSync.WORKER_TIMEOUT,  # what a TCPStore and gloo can take
            "rollout_timeout": 1 <= self.rollout_timeout <= WeightSync.WORKER_TIMEOUT,
            "min_workers": 0 <= self.min_workers <= max(1, len(self.worker_addresses)),
            "sync_port": 0 <= self.sync_port <= 65535, "sync_bucket_mb": self.sync_bucket_mb > 0,
        }
        choices = {"lr_scheduler_type": LR_SCHEDULES, "kl_estimator": F.KL_ESTIMATORS, "aggregation": F.AGGREGATIONS,
                   "correction": ("auto", "none", *V.CORRECTION_MODES), "correction_level": V.CORRECTION_LEVELS,
                   "async_mode": ASYNC_MODES, "sampler": SAMPLERS, "packing": PACKING,
                   "mask_training": ("masked", "unmasked")}
        check_config(self, {**checks, **self.checks()}, {**choices, **self.choices()})
        if self.remote_workers:
            from tokengym.agents.engine.remote import parse_address

            for a in self.worker_addresses or [self.remote_workers]:
                try:
                    parse_address(a)
                except ValueError as e:
                    raise ValueError(f"{type(self).__name__}: remote_workers: {e}; give host:port,host:port,...") from None
        if self.async_mode == "one-step" and self.max_staleness != 1:
            raise ValueError(f"{type(self).__name__}: async_mode='one-step' samples each rollout exactly one update "
                             f"behind (max_staleness=1), not max_staleness={self.max_staleness}; use async_mode='bounded'")
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

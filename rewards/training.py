"""The optimiser step every training loop of tokengym takes: AdamW, its learning-rate schedules, and
:class:`OptimizerStep` (zero_grad; then, after the caller's backward, gradient sync -> clipping -> step).

It lives in ``rewards``, the lowest package, because ``rewards`` trains models of its own (reward models and
PRMs, public API) and may import nothing above it, while every agent may import ``rewards``: one step here
serves both. ``tokengym.agents.runtime.optim`` re-exports it for the agents. Data-parallel gradient sync is
injected (``sync``), since ``rewards`` knows nothing of how a run sets up ``torch.distributed``.

The settings every trainer shares are declared here once, for the same reason: :class:`OptimConfig` (and
:class:`ScheduledOptimConfig`, with a learning-rate schedule) and :class:`TrainLoopConfig` (seed, evaluation,
packing). A trainer's config extends them and redeclares a field only to change its default; the docstring,
which ``--help`` prints, stays the base's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from tokengym.rewards.common import PACKING, FieldChecks

__all__ = ["adamw", "LR_SCHEDULES", "lr_factor", "OptimizerStep", "OptimConfig", "ScheduledOptimConfig", "SeedConfig",
           "TrainLoopConfig"]


def adamw(params: Iterable[Any], lr: float, weight_decay: float = 0.0, **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW, fused where this torch build has it (on CPU much faster than the per-tensor loop: ``bench/RESULTS.md``).

    ``params`` may be tensors or param-group dicts; tensors without ``requires_grad`` are dropped.
    """
    params = list(params)
    if params and isinstance(params[0], torch.Tensor):
        params = [p for p in params if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)


LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}
"""Learning-rate multiplier as a function of the fraction of the decay already done (0 at its first step)."""


def lr_factor(step: int, total: int, schedule: str, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimiser step ``step`` (0-based) of ``total``: a linear
    warmup over ``warmup`` steps, then ``schedule`` decaying from 1 to ``min_ratio`` by the last step."""
    if step < warmup:
        return (step + 1) / warmup
    f = LR_SCHEDULES[schedule](min((step - warmup) / max(total - warmup, 1), 1.0))
    return f if schedule == "constant" or not min_ratio else min_ratio + (1 - min_ratio) * f


# ---------------------------------------------------------------------------------------------- shared settings
@dataclass
class OptimConfig(FieldChecks):
    """The optimiser's settings: AdamW's learning rate and weight decay, and gradient clipping."""

    lr: float = 1e-4
    """AdamW learning rate of the trained model (the peak of the learning-rate schedule, reached after warmup, where
    the trainer has one)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (SFT: of matrices only, not of norms or biases)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm of each optimised model (PPO: the policy and the critic, each on its own) (0 = off)."""

    def checks(self) -> dict[str, bool]:
        return {"lr": self.lr > 0, "weight_decay": self.weight_decay >= 0,
                "max_grad_norm": self.max_grad_norm >= 0}


@dataclass
class ScheduledOptimConfig(OptimConfig):
    """The optimiser's settings with a learning-rate schedule (:func:`lr_factor`): a linear warmup, then a decay."""

    lr_scheduler_type: str = "constant"
    """Learning-rate decay after warmup: constant, linear or cosine (both to 0, or to min_lr_ratio * lr where the
    trainer has min_lr_ratio); the on-policy agents' schedule spans all iterations * steps sampling steps."""
    warmup_steps: int = 0
    """Steps (the on-policy agents': sampling steps) of linear learning-rate warmup before the decay (0 = none)."""

    def checks(self) -> dict[str, bool]:
        return {"warmup_steps": self.warmup_steps >= 0}

    def choices(self) -> dict[str, Iterable[Any]]:
        return {"lr_scheduler_type": LR_SCHEDULES}


@dataclass
class SeedConfig(FieldChecks):
    """The seed of a run (its own base: the training loop and the agents' rollout engine both read it)."""

    seed: int = 0
    """Seeds the run: data shuffling and held-out splits; for the on-policy agents also the env's prompt stream, the
    policy's sampler (rollout worker i: seed + i) and any freshly built head (PPO's critic)."""


@dataclass
class TrainLoopConfig(SeedConfig):
    """The training loop's settings every trainer shares: its seed, how often it evaluates, how it packs forwards."""

    eval_every: int = 0
    """Evaluate on held-out data (prompts, pairs or examples, where the run has them) every this many steps (the
    on-policy agents': sampling steps); 0 = only at the end (SFT: before and after training)."""
    packing: str = "auto"
    """Forwards over the real tokens packed into bins of the longest row's width instead of the padded batch: off,
    bins, or auto (bins when they hold at most 80% of the padded tokens); results are equal up to float rounding
    (tokengym.rewards.packing). On-policy agents pack pi_old, the reference, the update and PPO's critic;
    DPO its plain (not prefix-shared) stacks."""

    def checks(self) -> dict[str, bool]:
        return {"eval_every": self.eval_every >= 0}

    def choices(self) -> dict[str, Iterable[Any]]:
        return {"packing": PACKING}


class OptimizerStep:
    """One or more optimisers stepped as one: learning-rate schedule, gradient sync, clipping, checkpoint state.

    Use: ``set_lr(step, total)`` (when scheduled), ``zero_grad()``, the caller's backward, ``step()``.
    :meth:`step` syncs the gradients of every optimiser's parameters at once (one call of ``sync``), then clips
    each optimiser's parameters to ``max_grad_norm`` on its own (``None`` or <= 0: off, clipping to inf so
    the norm is still measured), then steps each optimiser in order.

    Args:
        optimizers: an optimiser or a sequence of them (PPO: policy, then critic).
        lr: peak learning rate of the first optimiser; the schedule sets only the first one's (the others
            keep their own, e.g. PPO's critic).
        schedule, warmup, min_ratio: the schedule of :func:`lr_factor` (``schedule`` a key of :data:`LR_SCHEDULES`).
        max_grad_norm: clipping norm (``None`` or <= 0: no clipping).
        sync: sums gradients over data-parallel ranks in place: a callable taking the parameter list, or an
            object with ``sync_gradients(params)``; None: a single process.
        names: each optimiser's key in :meth:`state_dict` (the checkpoint's keys).
        norm_names: each optimiser's key of its gradient norm in :meth:`step`'s report.
        clip_params: the parameters clipped together for each optimiser, in this order (the order of the
            total norm's sum); default: the optimiser's own, group by group.
    """

    def __init__(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], lr: float, *,
                 schedule: str = "constant", warmup: int = 0, min_ratio: float = 0.0, max_grad_norm: float | None = None,
                 sync: Any = None, names: Sequence[str] = ("optimizer",), norm_names: Sequence[str] = ("grad_norm",),
                 clip_params: Sequence[Iterable[torch.nn.Parameter]] | None = None):
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if clip_params is None:
            clip_params = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]
        self.clip_params = [list(ps) for ps in clip_params]
        for what, seq in (("names", names), ("norm_names", norm_names), ("clip_params", self.clip_params)):
            if len(seq) != len(self.optimizers):
                raise ValueError(f"OptimizerStep: {len(self.optimizers)} optimisers but {len(seq)} {what}")
        if schedule not in LR_SCHEDULES:
            raise ValueError(f"OptimizerStep: unknown schedule {schedule!r}; choose one of {sorted(LR_SCHEDULES)}")
        self.peak_lr, self.schedule, self.warmup, self.min_ratio = lr, schedule, warmup, min_ratio
        self.max_grad_norm = max_grad_norm
        self.sync = getattr(sync, "sync_gradients", sync)
        self.names, self.norm_names = tuple(names), tuple(norm_names)

    @classmethod
    def adamw(cls, params: Iterable[Any], lr: float, weight_decay: float = 0.0, *, fused: bool = True,
              betas: tuple[float, float] | None = None, **kwargs: Any) -> "OptimizerStep":
        """A step of one AdamW over ``params`` (tensors or param-group dicts): :func:`adamw` (fused where
        available) or, with ``fused=False``, plain ``torch.optim.AdamW``; ``kwargs`` go to the constructor."""
        opt_kw = {} if betas is None else {"betas": betas}
        opt = adamw(params, lr, weight_decay, **opt_kw) if fused else \
            torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **opt_kw)
        return cls(opt, lr, **kwargs)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Every optimiser's clipped parameters, in order (what ``sync`` receives)."""
        return [p for ps in self.clip_params for p in ps]

    @property
    def lr(self) -> float:
        """The first optimiser's current learning rate."""
        return self.optimizers[0].param_groups[0]["lr"]

    def set_lr(self, step: int, total: int) -> float:
        """Set and return the first optimiser's learning rate at optimiser step ``step`` (0-based) of ``total``."""
        lr = self.peak_lr * lr_factor(step, total, self.schedule, self.warmup, self.min_ratio)
        for group in self.optimizers[0].param_groups:
            group["lr"] = lr
        return lr

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def step(self) -> dict[str, Any]:
        """Sync, clip, step; return ``{"lr": ..., <norm name>: pre-clip total gradient norm (0-dim tensor), ...}``."""
        if self.sync is not None:
            self.sync(self.params)  # one call for all optimisers: every rank then clips and steps alike
        max_norm = self.max_grad_norm if self.max_grad_norm is not None and self.max_grad_norm > 0 else math.inf
        report: dict[str, Any] = {"lr": self.lr}
        for name, ps in zip(self.norm_names, self.clip_params):
            norm = torch.nn.utils.clip_grad_norm_(ps, max_norm)
            report[name] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded: the reduced total
        for opt in self.optimizers:
            opt.step()
        return report

    def state_dict(self) -> dict[str, Any]:
        """``{name: optimiser state}`` for each optimiser (keys as in ``names``)."""
        return {name: opt.state_dict() for name, opt in zip(self.names, self.optimizers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (extra keys are ignored, so a whole checkpoint state may be passed)."""
        missing = [name for name in self.names if name not in state]
        if missing:
            raise ValueError(f"optimiser state is missing {missing}; pass what state_dict() returned")
        for name, opt in zip(self.names, self.optimizers):
            opt.load_state_dict(state[name])

"""The optimiser every agent uses, and its learning-rate schedules (one table for all of them)."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

__all__ = ["adamw", "LR_SCHEDULES", "lr_factor"]


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

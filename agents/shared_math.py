"""Helpers that :mod:`~tokengym.agents.functional` and :mod:`~tokengym.agents.variants` share: argument checks
(shapes, dimensions, registry choices, clip ranges), dtype promotion, masked reductions and group centring.

Pure functions on torch tensors, in the conventions of :mod:`~tokengym.agents.functional`.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["as_bool", "centre_groups", "check_choice", "check_dim", "check_same_shape", "clip_range", "compute_dtype",
           "float_dtype", "masked_mean", "masked_sum", "shape_of"]


def shape_of(x: Tensor) -> Tuple[int, ...]:
    """``x``'s shape as a plain tuple (for error messages)."""
    return tuple(x.shape)


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """ValueError naming both tensors and their shapes when ``a`` and ``b`` differ in shape."""
    if a.shape != b.shape:
        raise ValueError(
            f"shape mismatch: {name_a} has shape {shape_of(a)} but {name_b} has shape {shape_of(b)}; "
            "they must be equal"
        )


def check_dim(name: str, x: Tensor, dim: int, layout: str) -> None:
    """ValueError when ``x`` is not ``dim``-D (``layout`` names the expected one, e.g. ``"[B, T]"``)."""
    if x.dim() != dim:
        raise ValueError(f"{name} must be {layout} ({dim}-D), got shape {shape_of(x)}")


def check_choice(kind: str, name: str, registry: Dict[str, Callable]) -> Callable:
    """``registry[name]``; ValueError listing the valid choices for an unknown ``name``."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown {kind} {name!r}; valid choices are: {', '.join(map(repr, registry))}"
        ) from None


def as_bool(mask: Tensor) -> Tensor:
    """A float, integer or bool mask as a bool tensor (non-zero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def float_dtype(*xs: Tensor) -> torch.dtype:
    """Promoted floating dtype of the inputs (default dtype if none is floating)."""
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Internal accumulation dtype: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def masked_sum(x: Tensor, valid: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Sum of ``x`` over the ``valid`` entries (all, or along ``dim``); masked values never leak."""
    xm = torch.where(valid, x, torch.zeros_like(x))
    return xm.sum() if dim is None else xm.sum(dim=dim, keepdim=keepdim)


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean over valid entries; 0 if there are none."""
    return masked_sum(x, valid) / valid.sum().clamp(min=1).to(x.dtype)


def clip_range(clip_eps: float, clip_eps_high: Optional[float]) -> Tuple[float, float]:
    """``(low, high)`` clip ranges of a ratio, checked: ``clip_eps_high`` defaults to ``clip_eps``."""
    eps_low = float(clip_eps)
    eps_high = eps_low if clip_eps_high is None else float(clip_eps_high)
    if not (0.0 <= eps_low <= 1.0):
        raise ValueError(f"clip_eps must be in [0, 1], got {clip_eps}")
    if eps_high < 0.0:
        raise ValueError(f"clip_eps_high must be >= 0, got {clip_eps_high}")
    return eps_low, eps_high


def centre_groups(grouped: Tensor) -> Tensor:
    """``r - group_mean`` per row of ``[G, n]``, exactly 0 when a group's rewards are identical."""
    # Subtract a member first: identical rewards give exact zeros (torch.mean alone would not
    # guarantee that, e.g. mean([0.1] * 3) != 0.1), and it improves conditioning.
    shifted = grouped - grouped[:, :1]
    return shifted - shifted.mean(dim=-1, keepdim=True)

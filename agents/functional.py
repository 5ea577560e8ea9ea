"""Advantage estimators and losses for RL post-training of language models.

Everything here is a pure function on batched torch tensors. Conventions:

* Token-level tensors are ``[B, T]`` (batch of sequences, time steps).
* ``mask`` is ``[B, T]``, non-zero (``1``/``True``) on action tokens that take part in the
  computation and zero on padding / prompt tokens. Float, integer and bool masks are accepted.
* Results live on the inputs' device and in the inputs' floating dtype. Half-precision inputs are
  computed internally in float32 and cast back.
* Shape mismatches raise :class:`ValueError` with a message naming both shapes.
* Padding is neutralised with ``torch.where`` (never by multiplying with the mask), so arbitrary
  values at masked positions (even ``inf``/``nan``) never leak into valid positions or gradients.

Variants (advantage scales, KL estimators, loss aggregations, DPO losses) are registered in small
dictionaries of functions; unknown names raise :class:`ValueError` listing the valid choices.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# on-policy distillation's per-token reverse KL, defined beside the teacher reward that uses it (rewards never import agents)
from tokengym.rewards.teacher import reverse_kl, sampled_reverse_kl

from tokengym.agents.shared_math import (as_bool, centre_groups, check_choice, check_dim, check_same_shape, clip_range,
                                         compute_dtype, float_dtype, masked_mean, shape_of)

__all__ = [
    "gae",
    "whiten",
    "group_advantages",
    "process_advantages",
    "kl_penalty",
    "sampled_reverse_kl",
    "reverse_kl",
    "masked_aggregate",
    "policy_loss",
    "value_loss",
    "dpo_loss",
    "token_logprobs",
    "entropy",
    "GROUP_SCALES",
    "KL_ESTIMATORS",
    "AGGREGATIONS",
    "DPO_LOSSES",
]

# Largest |log-ratio| fed to exp() by the k3 KL estimator (see ``kl_penalty``).
K3_MAX_LOG_RATIO = 20.0
_WHITEN_EPS = 1e-8


# ---------------------------------------------------------------------------------------------
# numeric helpers
# ---------------------------------------------------------------------------------------------


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, else 0 (no NaN in values or gradients)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _masked_var(x: Tensor, valid: Tensor) -> Tensor:
    """Unbiased variance over valid entries; 0 if fewer than 2."""
    n = valid.sum()
    mean = masked_mean(x, valid)
    dev = torch.where(valid, x - mean, torch.zeros_like(x))
    var = (dev * dev).sum() / (n - 1).clamp(min=1).to(x.dtype)
    return torch.where(n >= 2, var, torch.zeros_like(var))


# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    last_values: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the valid tokens of each row.

    The recursion only visits positions with ``mask != 0``; the "next" position of a valid token
    is the next valid position of the same row, wherever padding sits (left, middle or right)::

        delta_t = r_t + gamma * V(next valid) - V_t
        A_t     = delta_t + gamma * lam * A(next valid)

    For the last valid token of row ``b``, ``V(next) = last_values[b]`` and ``A(next) = 0``.

    Args:
        rewards: ``[B, T]`` per-token rewards.
        values: ``[B, T]`` critic values ``V_t``.
        mask: ``[B, T]`` non-zero on valid (action) tokens.
        gamma: Discount factor in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]`` (0: one-step TD error, 1: Monte-Carlo return minus V).
        last_values: ``[B]`` bootstrap value after each row's last valid token: ``V(s_T)`` for a
            truncated row, 0 for a terminated one. ``None`` means zeros (every row terminated).

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, detached, in the inputs' dtype, with
        ``returns = values + advantages`` on valid positions and both 0 at masked positions.
        Values at masked positions (even ``nan``) never influence valid positions.

    Raises:
        ValueError: on shape mismatch or ``gamma``/``lam`` outside ``[0, 1]``.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.tensor([[0.5, 0.5, 0.5]])
        >>> adv, ret = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
        >>> adv
        tensor([[0.5000, 0.5000, 0.5000]])
        >>> ret
        tensor([[1., 1., 1.]])
    """
    check_dim("rewards", rewards, 2, "[B, T]")
    check_same_shape("rewards", rewards, "values", values)
    check_same_shape("rewards", rewards, "mask", mask)
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not (0.0 <= lam <= 1.0):
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    B, T = rewards.shape
    if last_values is not None and shape_of(last_values) != (B,):
        raise ValueError(
            f"shape mismatch: last_values has shape {shape_of(last_values)} but rewards has shape "
            f"{shape_of(rewards)}; last_values must be ({B},)"
        )
    out_dtype = float_dtype(rewards, values)
    dt = compute_dtype(out_dtype)
    valid = as_bool(mask)
    with torch.no_grad():
        r = rewards.detach().to(dt)
        v = values.detach().to(dt)
        next_v = (
            torch.zeros(B, dtype=dt, device=r.device)
            if last_values is None
            else last_values.detach().to(device=r.device, dtype=dt)
        )
        next_a = torch.zeros(B, dtype=dt, device=r.device)
        adv = torch.zeros(B, T, dtype=dt, device=r.device)
        zero = torch.zeros(B, dtype=dt, device=r.device)
        for t in range(T - 1, -1, -1):
            m = valid[:, t]
            v_t = v[:, t]
            a_t = r[:, t] + gamma * next_v - v_t + (gamma * lam) * next_a
            adv[:, t] = torch.where(m, a_t, zero)
            # Padding is skipped: the carried "next" state only moves on valid tokens.
            next_v = torch.where(m, v_t, next_v)
            next_a = torch.where(m, a_t, next_a)
        ret = torch.where(valid, v + adv, torch.zeros_like(adv))
    return adv.to(out_dtype), ret.to(out_dtype)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise ``x`` with the mean and unbiased variance of its valid entries.

    ``out = (x - mean) * rsqrt(var + 1e-8)`` (plus ``mean`` again if ``shift_mean`` is False),
    with the statistics taken over all valid entries of the whole tensor.

    Defined behaviour for degenerate masks (never NaN): with fewer than 2 valid entries the
    variance is undefined, so the entries are centred but not scaled (scale 1), i.e. the single
    valid entry becomes 0 (or is returned unchanged if ``shift_mean`` is False); with no valid
    entry the result is all zeros.

    Args:
        x: ``[B, T]`` (any shape) values to normalise.
        mask: Same shape as ``x``; non-zero on valid entries.
        shift_mean: If False, keep the original mean (only rescale).

    Returns:
        Tensor shaped like ``x``, 0 at masked positions. Differentiable.

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
        >>> whiten(x, torch.tensor([[1, 1, 1, 0]]))
        tensor([[-1.,  0.,  1.,  0.]])
    """
    check_same_shape("x", x, "mask", mask)
    valid = as_bool(mask)
    n = valid.sum()
    mean = masked_mean(x, valid)
    dev = torch.where(valid, x - mean, torch.zeros_like(x))
    var = _masked_var(x, valid)
    scale = torch.where(n >= 2, torch.rsqrt(var + _WHITEN_EPS), torch.ones_like(var))
    out = dev * scale
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros_like(out))


def _sample_std(dev: Tensor, count: Tensor) -> Tensor:
    """Bessel-corrected std from deviations (already 0 at invalid entries); 0 if count < 2."""
    var = (dev * dev).sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1).to(dev.dtype)
    return torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))


def _scale_group(grouped: Tensor, eps: float) -> Tensor:
    dev = centre_groups(grouped)
    n = torch.full_like(dev[:, :1], grouped.shape[1])
    return _safe_div(dev, _sample_std(dev, n) + eps)


def _scale_batch(grouped: Tensor, eps: float) -> Tensor:
    dev = centre_groups(grouped)
    flat = grouped.reshape(1, -1)
    batch_dev = flat - flat.mean()
    std = _sample_std(batch_dev, torch.full_like(flat[:, :1], flat.shape[1]))
    return _safe_div(dev, std + eps)


def _scale_none(grouped: Tensor, eps: float) -> Tensor:
    return centre_groups(grouped)


GROUP_SCALES: Dict[str, Callable[[Tensor, float], Tensor]] = {
    "group": _scale_group,
    "batch": _scale_batch,
    "none": _scale_none,
}


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO outcome-supervision advantages: rewards normalised within groups of completions.

    ``rewards`` holds ``n_groups * group_size`` scalars, each group (completions of one prompt)
    contiguous. With ``mean``/``std`` the group's mean and sample (Bessel-corrected) std:

    * ``"group"``: ``(r - mean) / (std + eps)``
    * ``"batch"``: ``(r - mean) / (std of the whole batch + eps)``
    * ``"none"``:  ``r - mean``

    A group of identical rewards gets exactly 0 (never NaN, also with ``eps=0``); the sample std
    of a single element (``group_size=1``) is taken as 0.

    Args:
        rewards: ``[B]`` scalar rewards, ``B = n_groups * group_size``.
        group_size: Completions per prompt.
        scale: One of ``"group"``, ``"batch"``, ``"none"``.
        eps: Non-negative constant added to the std.

    Returns:
        ``[B]`` advantages in the rewards' (floating) dtype.

    Raises:
        ValueError: if ``B`` is not divisible by ``group_size``, or ``scale`` is unknown.

    Example:
        >>> import torch
        >>> group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2, eps=0.0)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    fn = check_choice("scale", scale, GROUP_SCALES)
    check_dim("rewards", rewards, 1, "[B]")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    B = rewards.shape[0]
    if B % group_size != 0:
        raise ValueError(
            f"number of rewards B={B} (shape {shape_of(rewards)}) is not divisible by "
            f"group_size={group_size}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out_dtype = float_dtype(rewards)
    grouped = rewards.to(compute_dtype(out_dtype)).reshape(B // group_size, group_size)
    return fn(grouped, eps).reshape(B).to(out_dtype)


def process_advantages(
    step_rewards: Tensor,
    step_ends: Tensor,
    group_size: int,
    seq_len: int,
    eps: float = 1e-4,
) -> Tensor:
    """GRPO process-supervision advantages (DeepSeekMath): per-step rewards to per-token values.

    All valid step rewards of a group (``group_size`` contiguous responses) are normalised
    together, ``r_hat = (r - mean) / (std + eps)`` with the group's mean and sample std over
    valid steps (std taken as 0 with fewer than 2 valid steps; identical rewards give exactly 0).
    Token ``t`` of response ``b`` then gets the sum of ``r_hat`` over that response's steps that
    end at or after ``t`` (``step_ends >= t``); tokens after the last step end get 0.

    Args:
        step_rewards: ``[B, S]`` float reward of step ``j`` of response ``b``.
        step_ends: ``[B, S]`` integer token index (``0..seq_len-1``) where the step ends, or
            ``-1`` for "no step" (padding for responses with fewer steps). Step order within a
            row does not matter.
        group_size: Responses per prompt; ``B`` must be divisible by it.
        seq_len: Number of token positions ``T`` of the output.
        eps: Non-negative constant added to the std.

    Returns:
        ``[B, seq_len]`` advantages in the step rewards' dtype.

    Raises:
        ValueError: on shape mismatch, non-integer ``step_ends``, ``step_ends >= seq_len`` or
            ``< -1``, or ``B`` not divisible by ``group_size``.

    Example:
        >>> import torch
        >>> r = torch.tensor([[2.0, 0.0], [1.0, 9.0]])
        >>> ends = torch.tensor([[0, 2], [1, -1]])  # response 1 has a single step
        >>> # valid rewards 2, 0, 1: mean 1, sample std 1 -> normalised 1, -1, 0
        >>> process_advantages(r, ends, group_size=2, seq_len=4, eps=0.0)
        tensor([[ 0., -1., -1.,  0.],
                [ 0.,  0.,  0.,  0.]])
    """
    check_dim("step_rewards", step_rewards, 2, "[B, S]")
    check_same_shape("step_rewards", step_rewards, "step_ends", step_ends)
    if step_ends.dtype.is_floating_point or step_ends.dtype == torch.bool:
        raise ValueError(f"step_ends must be an integer tensor, got dtype {step_ends.dtype}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    B, S = step_rewards.shape
    if B % group_size != 0:
        raise ValueError(
            f"number of responses B={B} (step_rewards shape {shape_of(step_rewards)}) is not "
            f"divisible by group_size={group_size}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if step_ends.numel() > 0:
        lo, hi = int(step_ends.min()), int(step_ends.max())
        if hi >= seq_len:
            raise ValueError(f"step_ends contains {hi} >= seq_len={seq_len}")
        if lo < -1:
            raise ValueError(f"step_ends contains {lo}; use -1 (only) to mark missing steps")

    out_dtype = float_dtype(step_rewards)
    dt = compute_dtype(out_dtype)
    G = B // group_size
    valid = (step_ends >= 0).reshape(G, group_size * S)
    r = step_rewards.to(dt).reshape(G, group_size * S)
    count = valid.sum(dim=-1, keepdim=True)
    # Centre on a member of the group (exact zeros for identical rewards), then on the mean.
    if S == 0:
        return torch.zeros(B, seq_len, dtype=out_dtype, device=step_rewards.device)
    ref = torch.where(valid, r, torch.full_like(r, math.inf)).amin(dim=-1, keepdim=True)
    ref = torch.where(count > 0, ref, torch.zeros_like(ref))
    shifted = torch.where(valid, r - ref, torch.zeros_like(r))
    mean = shifted.sum(dim=-1, keepdim=True) / count.clamp(min=1).to(dt)
    dev = torch.where(valid, shifted - mean, torch.zeros_like(r))
    normed = _safe_div(dev, _sample_std(dev, count) + eps).reshape(B, S)

    # Scatter each step's normalised reward onto its end token, then a reverse cumulative sum
    # gives sum over steps with end >= t. Missing steps carry exactly 0 (index clamped to 0).
    per_end = torch.zeros(B, seq_len, dtype=dt, device=step_rewards.device)
    per_end.scatter_add_(1, step_ends.clamp(min=0).to(torch.long), normed)
    adv = per_end.flip(-1).cumsum(-1).flip(-1)
    return adv.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# KL penalty
# ---------------------------------------------------------------------------------------------


def _k1(d: Tensor) -> Tensor:
    return d


def _k2(d: Tensor) -> Tensor:
    return 0.5 * d * d


def _k3(d: Tensor) -> Tensor:
    # exp(-d) - 1 + d with d clamped from below so exp(-d) <= exp(K3_MAX_LOG_RATIO) stays finite
    # (also in float16, where the bound is lowered to fit). Clamping d itself (not only the
    # exponent) keeps the estimator >= 0; beyond the clamp its value is constant (zero gradient).
    bound = min(K3_MAX_LOG_RATIO, math.log(torch.finfo(d.dtype).max) - 1.0)
    dc = d.clamp(min=-bound)
    return torch.expm1(-dc) + dc


KL_ESTIMATORS: Dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of ``KL(pi || ref)`` from tokens sampled from ``pi``.

    With ``d = logp - ref_logp`` (log-probs of the sampled tokens under the policy and the
    reference model):

    * ``"k1"``: ``d`` (unbiased, can be negative)
    * ``"k2"``: ``d**2 / 2`` (biased, low variance, >= 0)
    * ``"k3"``: ``exp(-d) - 1 + d`` (Schulman's unbiased, >= 0 estimator), computed with
      ``expm1``. ``d`` is clamped to ``>= -20`` (``K3_MAX_LOG_RATIO``; lower for float16) so
      ``exp(-d)`` never overflows: the value is finite and >= 0 for any finite input, e.g.
      ``d = -1000`` gives ``expm1(20) - 20``, and the gradient is 0 below the clamp.

    Args:
        logp: ``[B, T]`` policy log-probs of the sampled tokens.
        ref_logp: ``[B, T]`` reference log-probs of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        ``[B, T]`` tensor, differentiable w.r.t. both inputs.

    Example:
        >>> import torch
        >>> logp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> ref = torch.log(torch.tensor([[0.25, 0.5]]))
        >>> kl_penalty(logp, ref, "k3")
        tensor([[0.1931, 0.3069]])
    """
    fn = check_choice("KL estimator", estimator, KL_ESTIMATORS)
    check_same_shape("logp", logp, "ref_logp", ref_logp)
    return fn(logp - ref_logp)


# ---------------------------------------------------------------------------------------------
# aggregation and policy / value losses
# ---------------------------------------------------------------------------------------------


def _agg_token_mean(xm: Tensor, valid: Tensor) -> Tensor:
    return xm.sum() / valid.sum().clamp(min=1).to(xm.dtype)


def _agg_seq_mean_token_mean(xm: Tensor, valid: Tensor) -> Tensor:
    n_tok = valid.sum(dim=-1)
    per_row = xm.sum(dim=-1) / n_tok.clamp(min=1).to(xm.dtype)
    has = n_tok > 0
    return torch.where(has, per_row, torch.zeros_like(per_row)).sum() / has.sum().clamp(min=1).to(
        xm.dtype
    )


def _agg_seq_mean_token_sum(xm: Tensor, valid: Tensor) -> Tensor:
    return xm.sum(dim=-1).mean()


AGGREGATIONS: Dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
}


def masked_aggregate(x: Tensor, mask: Tensor, aggregation: str = "token-mean") -> Tensor:
    """Reduce a per-token ``[B, T]`` tensor to a scalar over valid tokens.

    * ``"token-mean"``: ``sum(x * mask) / sum(mask)`` (every token weighs the same).
    * ``"seq-mean-token-mean"``: mean over rows with at least one valid token of the row's
      token mean (GRPO's ``1/G sum_i 1/|o_i| sum_t``).
    * ``"seq-mean-token-sum"``: mean over all ``B`` rows of the row's masked token sum.

    Empty masks give 0 (no NaN). Masked entries of ``x`` get zero gradient.

    Args:
        x: ``[B, T]`` per-token values.
        mask: ``[B, T]`` non-zero on valid tokens.
        aggregation: One of the names above.

    Returns:
        0-dim tensor.

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> masked_aggregate(x, m, "token-mean"), masked_aggregate(x, m, "seq-mean-token-mean")
        (tensor(1.7500), tensor(2.5000))
        >>> masked_aggregate(x, m, "seq-mean-token-sum")
        tensor(3.5000)
    """
    fn = check_choice("aggregation", aggregation, AGGREGATIONS)
    check_dim("x", x, 2, "[B, T]")
    check_same_shape("x", x, "mask", mask)
    valid = as_bool(mask)
    return fn(torch.where(valid, x, torch.zeros_like(x)), valid)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    aggregation: str = "token-mean",
    weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO / GRPO clipped surrogate loss with optional asymmetric ("clip-higher") bounds.

    ``ratio = exp(logp - old_logp)``; per token
    ``l = max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps_high))``, aggregated over
    valid tokens with :func:`masked_aggregate`. ``old_logp`` and ``advantages`` are treated as
    constants (detached). Log-ratios are not clamped; padding positions are neutralised before
    ``exp`` so they cannot produce inf/NaN values or gradients.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy.
        old_logp: ``[B, T]`` log-probs under the behaviour (sampling) policy.
        advantages: ``[B, T]`` per-token, or ``[B]`` per-sequence (broadcast over tokens).
        mask: ``[B, T]`` non-zero on valid (action) tokens.
        clip_eps: Lower clip range: ratio is clipped below at ``1 - clip_eps``.
        clip_eps_high: Upper clip range (``1 + clip_eps_high``); defaults to ``clip_eps``.
        aggregation: See :func:`masked_aggregate`.
        weights: Optional ``[B, T]`` per-token multipliers of the clipped loss before aggregation,
            detached; e.g. TIS/MIS rollout corrections (``variants.importance_weights``).

    Returns:
        ``(loss, stats)``: a 0-dim loss and a dict of detached 0-dim tensors (no host sync):
        ``clipfrac_low`` (fraction of valid tokens with ``A < 0`` and ``ratio < 1 - clip_eps``),
        ``clipfrac_high`` (``A > 0`` and ``ratio > 1 + clip_eps_high``), ``clipfrac`` (their sum),
        ``approx_kl`` (masked mean of the k3 estimator of ``KL(old || new)`` under samples from
        the old policy: ``ratio - 1 - log(ratio)``), ``ratio_mean`` and ``ratio_max`` over valid
        tokens. All stats are 0 when no token is valid.

    Example:
        >>> import torch
        >>> logp = torch.log(torch.tensor([[0.6, 0.3]]))
        >>> old = torch.log(torch.tensor([[0.4, 0.3]]))
        >>> loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
        >>> loss  # ratio 1.5 is clipped to 1.2: mean(-1.2, -1.0)
        tensor(-1.1000)
        >>> stats["clipfrac_high"]
        tensor(0.5000)
    """
    agg = check_choice("aggregation", aggregation, AGGREGATIONS)
    check_dim("logp", logp, 2, "[B, T]")
    check_same_shape("logp", logp, "old_logp", old_logp)
    check_same_shape("logp", logp, "mask", mask)
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(
                f"shape mismatch: advantages has shape {shape_of(advantages)} but logp has shape "
                f"{shape_of(logp)}; advantages must be [B] or [B, T]"
            )
        advantages = advantages[:, None]
    else:
        check_same_shape("advantages", advantages, "logp", logp)
    eps_low, eps_high = clip_range(clip_eps, clip_eps_high)
    if weights is not None:
        check_same_shape("weights", weights, "logp", logp)

    valid = as_bool(mask)
    adv = advantages.detach().to(logp.dtype).expand_as(logp)
    log_ratio = torch.where(valid, logp - old_logp.detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        w = weights.detach().to(logp.dtype)
        per_token = per_token * torch.where(valid, w, torch.ones_like(w))
    loss = agg(torch.where(valid, per_token, torch.zeros_like(per_token)), valid)

    with torch.no_grad():
        r = ratio.detach()
        low = ((adv < 0) & (r < 1.0 - eps_low)).to(r.dtype)
        high = ((adv > 0) & (r > 1.0 + eps_high)).to(r.dtype)
        lr = log_ratio.detach()
        ratio_max = torch.where(valid, r, torch.full_like(r, -math.inf)).amax()
        stats = {
            "clipfrac_low": masked_mean(low, valid),
            "clipfrac_high": masked_mean(high, valid),
            "approx_kl": masked_mean(torch.expm1(lr) - lr, valid),
            "ratio_mean": masked_mean(r, valid),
            "ratio_max": torch.where(valid.any(), ratio_max, torch.zeros_like(ratio_max)),
        }
        stats["clipfrac"] = stats["clipfrac_low"] + stats["clipfrac_high"]
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: Optional[float] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Critic regression loss ``0.5 * (V - R)^2`` (token-mean over valid tokens).

    With ``clip_eps``, ``V_clip = old_values + clamp(values - old_values, -clip_eps, clip_eps)``
    and the per-token loss is ``0.5 * max((V - R)^2, (V_clip - R)^2)`` (PPO value clipping).
    ``old_values`` and ``returns`` are treated as constants (detached).

    Args:
        values: ``[B, T]`` current critic values (differentiable).
        old_values: ``[B, T]`` critic values at rollout time.
        returns: ``[B, T]`` regression targets (e.g. ``gae(...)[1]``).
        mask: ``[B, T]`` non-zero on valid tokens.
        clip_eps: Optional value clip range (> 0).

    Returns:
        ``(loss, stats)`` with detached 0-dim stats: ``vf_clipfrac`` (fraction of valid tokens
        where the clipped term is strictly larger, i.e. the gradient is blocked; 0 without
        clipping), ``value_mean`` (masked mean of ``values``) and ``explained_variance``
        (``1 - Var(R - V) / Var(R)`` over valid tokens with unbiased variances; defined as 0 when
        ``Var(R)`` is 0 or negligible (``<= eps * Var(R - V)``) or fewer than 2 tokens are valid).

    Example:
        >>> import torch
        >>> v = torch.tensor([[1.0, 2.0]])
        >>> loss, stats = value_loss(v, v, torch.tensor([[2.0, 2.0]]), torch.ones(1, 2))
        >>> loss  # 0.5 * mean((1 - 2)^2, 0)
        tensor(0.2500)
    """
    check_dim("values", values, 2, "[B, T]")
    check_same_shape("values", values, "old_values", old_values)
    check_same_shape("values", values, "returns", returns)
    check_same_shape("values", values, "mask", mask)
    if clip_eps is not None and not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0 or None, got {clip_eps}")
    valid = as_bool(mask)
    R = returns.detach().to(values.dtype)
    err = (values - R) ** 2
    if clip_eps is None:
        per_token = 0.5 * err
        clip_active = torch.zeros_like(err, dtype=torch.bool)
    else:
        ov = old_values.detach().to(values.dtype)
        delta = values - ov
        inside = delta.detach().abs() <= clip_eps
        # Inside the clip range use `values` itself (old + (v - old) can differ from v by an ulp).
        v_clip = torch.where(inside, values, ov + torch.clamp(delta, -clip_eps, clip_eps))
        err_clip = (v_clip - R) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clip_active = ~inside & (err_clip.detach() > err.detach())
    loss = masked_aggregate(per_token, valid, "token-mean")

    with torch.no_grad():
        v = values.detach()
        var_r = _masked_var(R, valid)
        var_res = _masked_var(R - v, valid)
        stats = {
            "vf_clipfrac": masked_mean(clip_active.to(v.dtype), valid),
            "value_mean": masked_mean(v, valid),
            # Var(R) at or below eps * Var(R - V) makes the ratio overflow (a denormal Var(R) gave -inf):
            # the returns are constant up to rounding, so the statistic is undefined and reported as 0.
            "explained_variance": torch.where(
                var_r > torch.finfo(var_r.dtype).eps * var_res,
                1.0 - _safe_div(var_res, var_r),
                torch.zeros_like(var_r),
            ),
        }
    return loss, stats


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------


def _dpo_sigmoid(z: Tensor, h: Tensor, beta: float, ls: float) -> Tensor:
    return -(1.0 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)


def _dpo_ipo(z: Tensor, h: Tensor, beta: float, ls: float) -> Tensor:
    return (h - 1.0 / (2.0 * beta)) ** 2


def _dpo_hinge(z: Tensor, h: Tensor, beta: float, ls: float) -> Tensor:
    return torch.relu(1.0 - z)


def _dpo_robust(z: Tensor, h: Tensor, beta: float, ls: float) -> Tensor:
    return ((1.0 - ls) * (-F.logsigmoid(z)) + ls * F.logsigmoid(-z)) / (1.0 - 2.0 * ls)


DPO_LOSSES: Dict[str, Callable[[Tensor, Tensor, float, float], Tensor]] = {
    "sigmoid": _dpo_sigmoid,
    "ipo": _dpo_ipo,
    "hinge": _dpo_hinge,
    "robust": _dpo_robust,
}
_DPO_USES_LABEL_SMOOTHING = {"sigmoid", "robust"}


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Direct Preference Optimisation losses per preference pair.

    Inputs are sequence log-probs (summed over completion tokens). With the margin
    ``h = (pc - rc) - (pr - rr)`` and ``z = beta * h``:

    * ``"sigmoid"``: ``-(1 - ls) * logsigmoid(z) - ls * logsigmoid(-z)`` (DPO; conservative DPO
      with label smoothing ``ls``).
    * ``"ipo"``: ``(h - 1 / (2 * beta))**2``. The formula is applied to whatever log-probs are
      given: IPO's length-averaged log-probs are the caller's job (pass mean instead of summed
      token log-probs).
    * ``"hinge"``: ``relu(1 - z)`` (SLiC).
    * ``"robust"``: ``((1 - ls) * -logsigmoid(z) + ls * logsigmoid(-z)) / (1 - 2 * ls)``
      (unbiased estimator under label noise rate ``ls``; equals ``"sigmoid"`` at ``ls = 0``).

    ``"ipo"`` and ``"hinge"`` do not use label smoothing and reject ``label_smoothing != 0``.

    Args:
        policy_chosen_logps: ``[B]`` policy log-probs of the chosen completions.
        policy_rejected_logps: ``[B]`` policy log-probs of the rejected completions.
        ref_chosen_logps: ``[B]`` reference log-probs of the chosen completions.
        ref_rejected_logps: ``[B]`` reference log-probs of the rejected completions.
        beta: Inverse temperature, > 0.
        loss_type: ``"sigmoid"``, ``"ipo"``, ``"hinge"`` or ``"robust"``.
        label_smoothing: Assumed label-flip probability in ``[0, 0.5)``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``[B]``; ``losses`` is
        differentiable, the implicit rewards ``beta * (policy - ref)`` are detached.

    Example:
        >>> import torch
        >>> lp = torch.tensor([-5.0])
        >>> losses, ch, rj = dpo_loss(lp, lp, lp, lp)  # policy == reference
        >>> losses  # log(2)
        tensor([0.6931])
    """
    fn = check_choice("loss_type", loss_type, DPO_LOSSES)
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if not (0.0 <= label_smoothing < 0.5):
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if label_smoothing != 0.0 and loss_type not in _DPO_USES_LABEL_SMOOTHING:
        raise ValueError(
            f"loss_type {loss_type!r} does not support label_smoothing (got {label_smoothing}); "
            f"use one of {sorted(_DPO_USES_LABEL_SMOOTHING)}"
        )
    pc, pr, rc, rr = policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    check_same_shape("policy_chosen_logps", pc, "policy_rejected_logps", pr)
    check_same_shape("policy_chosen_logps", pc, "ref_chosen_logps", rc)
    check_same_shape("policy_chosen_logps", pc, "ref_rejected_logps", rr)
    rc, rr = rc.detach(), rr.detach()
    chosen_logratio = pc - rc
    rejected_logratio = pr - rr
    h = chosen_logratio - rejected_logratio
    losses = fn(beta * h, h, float(beta), float(label_smoothing))
    return losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach()


# ---------------------------------------------------------------------------------------------
# chunked log-probs and entropy
# ---------------------------------------------------------------------------------------------


def _chunks(x: Tensor, chunk_size: int):
    """Yield ``(flat_slice, chunk_view)`` covering ``x[B, T, V]`` as ``B*T`` rows without a copy.

    If ``x`` can be viewed as ``[B*T, V]`` the rows are chunked directly; otherwise (e.g. a
    ``logits[:, :-1]`` slice) each batch row is chunked separately.
    """
    B, T, V = x.shape
    try:
        flat = x.view(B * T, V)
    except RuntimeError:
        for b in range(B):
            for s in range(0, T, chunk_size):
                e = min(s + chunk_size, T)
                yield slice(b * T + s, b * T + e), x[b, s:e]
        return
    for s in range(0, B * T, chunk_size):
        e = min(s + chunk_size, B * T)
        yield slice(s, e), flat[s:e]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked ``log_softmax(logits).gather(labels)`` that saves only logits (by reference)
    and the ``[N]`` log-normalisers, recomputing softmax chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk_size: int, index: Tensor | None = None,
                table: Tensor | None = None) -> Tensor:
        B, T, V = logits.shape
        dt = compute_dtype(logits.dtype)
        flat_labels = labels.reshape(B * T, 1).to(torch.long)
        out = torch.empty(B * T, dtype=dt, device=logits.device)
        lse = torch.empty(B * T, dtype=dt, device=logits.device)
        for sl, chunk in _chunks(logits, chunk_size):
            z = _masked(chunk.to(dt), sl, index, table)
            lse[sl] = torch.logsumexp(z, dim=-1)
            out[sl] = z.gather(-1, flat_labels[sl])[:, 0] - lse[sl]
        ctx.save_for_backward(logits, flat_labels, lse, index, table)
        ctx.chunk_size = chunk_size
        return out.view(B, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, flat_labels, lse, index, table = ctx.saved_tensors
        B, T, V = logits.shape
        g = grad_out.reshape(B * T, 1).to(lse.dtype)
        grad = torch.empty((B * T, V), dtype=logits.dtype, device=logits.device)
        for sl, chunk in _chunks(logits, ctx.chunk_size):
            # d/dz [z_y - logsumexp(z)] = onehot(y) - softmax(z); a masked-out z gets 0 (softmax 0 there)
            gz = torch.sub(_masked(chunk.to(lse.dtype), sl, index, table), lse[sl, None]).exp_().mul_(-g[sl])
            gz.scatter_add_(-1, flat_labels[sl], g[sl])
            grad[sl] = gz
        return grad.view(B, T, V), None, None, None, None


class _Entropy(torch.autograd.Function):
    """Chunked entropy of ``softmax(logits)``; backward ``dH/dz = -p * (log p + H)``."""

    @staticmethod
    def forward(ctx, logits: Tensor, chunk_size: int, index: Tensor | None = None, table: Tensor | None = None) -> Tensor:
        B, T, V = logits.shape
        dt = compute_dtype(logits.dtype)
        out = torch.empty(B * T, dtype=dt, device=logits.device)
        lse = torch.empty(B * T, dtype=dt, device=logits.device)
        for sl, chunk in _chunks(logits, chunk_size):
            z = _masked(chunk.to(dt), sl, index, table)
            lse[sl] = torch.logsumexp(z, dim=-1)
            logp = z - lse[sl, None]
            p = logp.exp()
            # p * log p with the 0 * log 0 = 0 convention (logits may contain -inf); in place
            # to keep the number of chunk-sized temporaries at two.
            out[sl] = -logp.mul_(p).masked_fill_(p == 0, 0.0).sum(-1)
        ctx.save_for_backward(logits, lse, out, index, table)
        ctx.chunk_size = chunk_size
        return out.view(B, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, H, index, table = ctx.saved_tensors
        B, T, V = logits.shape
        g = grad_out.reshape(B * T, 1).to(lse.dtype)
        grad = torch.empty((B * T, V), dtype=logits.dtype, device=logits.device)
        for sl, chunk in _chunks(logits, ctx.chunk_size):
            logp = torch.sub(_masked(chunk.to(lse.dtype), sl, index, table), lse[sl, None])
            p = logp.exp()
            grad[sl] = logp.add_(H[sl, None]).mul_(p).masked_fill_(p == 0, 0.0).mul_(-g[sl])
        return grad.view(B, T, V), None, None, None


def _masked(z: Tensor, sl: slice, index: Tensor | None, table: Tensor | None) -> Tensor:
    """Chunk ``z`` (rows ``sl`` of ``[B*T, V]``) with ``-inf`` outside each row's allowed set ``table[index[row]]``."""
    if index is None:
        return z
    return z.masked_fill(~table[index[sl]], float("-inf"))


def _allowed_pair(allowed: Any, logits: Tensor, labels: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """``allowed`` (``None``, a bool ``[B, T, V]``, or ``(index[B, T], table[U, V])``) as a flat index ``[B*T]`` and a
    bool table, checked: every set non-empty, and every label inside its own set."""
    if allowed is None:
        return None, None
    B, T, V = logits.shape
    if isinstance(allowed, Tensor):
        if allowed.shape != logits.shape or allowed.dtype != torch.bool:
            raise ValueError(f"allowed must be a bool tensor of the logits' shape {shape_of(logits)}, got {allowed.dtype} "
                             f"{shape_of(allowed)}")
        index, table = torch.arange(B * T, device=logits.device), allowed.reshape(B * T, V)
    else:
        index, table = allowed
        if index.shape != (B, T) or table.dim() != 2 or table.dtype != torch.bool:
            raise ValueError(f"allowed must be (index {shape_of(logits)[:2]}, bool table [U, V]), got index "
                             f"{shape_of(index)} and table {table.dtype} {shape_of(table)}")
        if table.shape[1] != V:  # a head wider than the tokenizer: its extra ids are never allowed
            if table.shape[1] > V:
                raise ValueError(f"the allowed sets cover {table.shape[1]} tokens but the logits only {V}")
            table = torch.nn.functional.pad(table, (0, V - table.shape[1]))
        index = index.reshape(B * T).long()
    if table.shape[0] and not bool(table.any(1).all()):
        raise ValueError("an allowed set is empty: a masked distribution needs at least one allowed token")
    if labels is not None and labels.numel() and not bool(table[index, labels.reshape(-1).long()].all()):
        at = int((~table[index, labels.reshape(-1).long()]).nonzero()[0])
        raise ValueError(f"label {int(labels.reshape(-1)[at])} at position {divmod(at, T)} is outside its allowed set")
    return index, table.to(logits.device)


def _check_logits(logits: Tensor, chunk_size: int) -> None:
    check_dim("logits", logits, 3, "[B, T, V]")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def token_logprobs(logits: Tensor, labels: Tensor, chunk_size: int = 128, allowed: Any = None) -> Tensor:
    """Log-probabilities of ``labels`` under ``softmax(logits)``, computed in row chunks.

    Equal to ``log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]``, but the
    ``B*T`` rows are processed ``chunk_size`` at a time (each chunk upcast to float32), and a
    custom autograd function saves no per-chunk activations (backward recomputes the softmax
    per chunk), so the extra memory is about ``chunk_size * V`` floats instead of a full
    ``[B, T, V]`` float32 copy. The gradient w.r.t. ``logits`` equals the naive version's; it is
    once-differentiable (no double backward).

    There is no ignore index: every label must be in ``[0, V)``. Put any valid id (e.g. 0) at
    padding positions and mask the result.

    Args:
        logits: ``[B, T, V]`` unnormalised scores (any floating dtype).
        labels: ``[B, T]`` integer token ids in ``[0, V)``.
        chunk_size: Rows of ``B*T`` processed at a time.
        allowed: an action mask: the log-probs are of the masked, renormalised distribution
            ``log_softmax(logits masked to -inf outside the allowed set)``, which an env's grammar samples from.
            ``None`` (no mask), a bool ``[B, T, V]``, or the compact ``(index[B, T], table[U, V] bool)`` (position
            ``(b, t)`` allows ``table[index[b, t]]``; :meth:`tokengym.envs.masks.TokenMasks.pair`). Each label must be
            allowed. Masked entries get zero gradient.

    Returns:
        ``[B, T]`` float32 log-probs (float64 for float64 logits).

    Raises:
        ValueError: on shape mismatch, non-integer labels or labels outside ``[0, V)``.

    Example:
        >>> import torch
        >>> logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
        >>> token_logprobs(logits, torch.tensor([[0, 2]])).exp()
        tensor([[0.5000, 0.8000]])
    """
    _check_logits(logits, chunk_size)
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"shape mismatch: labels has shape {shape_of(labels)} but logits has shape "
            f"{shape_of(logits)}; labels must be {shape_of(logits)[:2]}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    V = logits.shape[-1]
    if labels.numel() > 0 and bool(((labels < 0) | (labels >= V)).any()):
        raise ValueError(
            f"labels must be in [0, {V}) (vocabulary size); got values in "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return _TokenLogprobs.apply(logits, labels, chunk_size, *_allowed_pair(allowed, logits, labels))


def entropy(logits: Tensor, mask: Optional[Tensor] = None, chunk_size: int = 128, allowed: Any = None) -> Tensor:
    """Per-token entropy ``-sum_v p_v log p_v`` of ``softmax(logits)``, computed in row chunks.

    Memory behaves like :func:`token_logprobs` (no per-chunk activations saved; differentiable
    once). Vocabulary entries with ``-inf`` logits contribute 0.

    Args:
        logits: ``[B, T, V]`` unnormalised scores.
        mask: Optional ``[B, T]``; the result is 0 (with zero gradient) where it is 0.
        chunk_size: Rows of ``B*T`` processed at a time.
        allowed: an action mask, as :func:`token_logprobs` takes it: the entropy of the masked distribution.

    Returns:
        ``[B, T]`` float32 entropies (float64 for float64 logits).

    Example:
        >>> import torch
        >>> logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens: entropy log(4)
        >>> entropy(logits, mask=torch.tensor([[1, 0]]))
        tensor([[1.3863, 0.0000]])
    """
    _check_logits(logits, chunk_size)
    H = _Entropy.apply(logits, chunk_size, *_allowed_pair(allowed, logits, None))
    if mask is None:
        return H
    if mask.shape != logits.shape[:2]:
        raise ValueError(
            f"shape mismatch: mask has shape {shape_of(mask)} but logits has shape "
            f"{shape_of(logits)}; mask must be {shape_of(logits)[:2]}"
        )
    return torch.where(as_bool(mask), H, torch.zeros_like(H))

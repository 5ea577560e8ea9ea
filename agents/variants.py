"""Policy-gradient variants of 2024-26 as pure functions, in the conventions of :mod:`.functional`.

``[B, T]`` token tensors with a ``mask`` (non-zero on valid tokens; padding neutralised with
``torch.where``, so garbage at masked positions never leaks), shape errors naming both shapes, and
small registries whose unknown names raise :class:`ValueError` listing the choices.

* :func:`rloo_advantages`: leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics").
* :func:`reinforce_pp_advantages`: REINFORCE++ and REINFORCE++-baseline (Hu 2025).
* :func:`gspo_loss`: sequence-level ratio and clipping (GSPO, Zheng et al. 2025).
* :func:`group_has_signal`, :func:`overlong_penalty`: DAPO's dynamic sampling filter and soft
  overlong punishment (Yu et al. 2025).
* :func:`logprob_mismatch`, :func:`importance_weights`: sampler/trainer log-prob mismatch and its
  truncated / masked importance-sampling corrections (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"); pass the weights to
  ``functional.policy_loss(..., weights=...)``.
* :func:`token_covariance`, :func:`cov_policy_loss`: KL-Cov and Clip-Cov (Cui et al. 2025, "The
  Entropy Mechanism of Reinforcement Learning for Reasoning Language Models").
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .functional import gae, masked_aggregate, whiten
from .shared_math import (as_bool, centre_groups, check_choice, check_dim, check_same_shape, clip_range, compute_dtype,
                          float_dtype, masked_mean, shape_of)

__all__ = [
    "rloo_advantages",
    "reinforce_pp_advantages",
    "gspo_loss",
    "group_has_signal",
    "overlong_penalty",
    "logprob_mismatch",
    "importance_weights",
    "token_covariance",
    "cov_policy_loss",
    "CORRECTION_MODES",
    "CORRECTION_LEVELS",
    "COV_MODES",
]


def _check_groups(
    name: str, n: int, shape: Tuple[int, ...], group_size: int, minimum: int = 1
) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < minimum:
        raise ValueError(f"group_size must be an int >= {minimum}, got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(
            f"number of {name} N={n} (shape {shape}) is not divisible by group_size={group_size}"
        )


def _ratio_stats(ratio: Tensor, valid: Tensor) -> Dict[str, Tensor]:
    """``ratio_mean`` and ``ratio_max`` over valid entries (0 when none is valid)."""
    r_max = torch.where(valid, ratio, torch.full_like(ratio, -math.inf)).amax()
    return {
        "ratio_mean": masked_mean(ratio, valid),
        "ratio_max": torch.where(valid.any(), r_max, torch.zeros_like(r_max)),
    }


# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages: each reward minus the mean of the *other* rewards of its group.

    ``A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group)``: an unbiased baseline
    (it does not depend on sample ``i``), unlike GRPO's group mean. Groups of ``group_size``
    completions of one prompt are contiguous; identical rewards give exactly 0.

    Args:
        rewards: ``[N]`` scalar rewards, ``N = n_groups * group_size``.
        group_size: Completions per prompt, ``>= 2`` (a leave-one-out mean needs another sample).

    Returns:
        ``[N]`` advantages in the rewards' (floating) dtype, detached.

    Raises:
        ValueError: for ``group_size < 2`` or ``N`` not divisible by it.

    Example:
        >>> import torch
        >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 3.0]), group_size=3)
        tensor([ 1.0000, -0.5000, -0.5000,  0.0000,  0.0000,  0.0000])
    """
    check_dim("rewards", rewards, 1, "[N]")
    _check_groups("rewards", rewards.shape[0], shape_of(rewards), group_size, minimum=2)
    out_dtype = float_dtype(rewards)
    grouped = rewards.detach().to(compute_dtype(out_dtype)).reshape(-1, group_size)
    adv = centre_groups(grouped) * (group_size / (group_size - 1))
    return adv.reshape(-1).to(out_dtype)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    kl: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_size: Optional[int] = None,
) -> Tensor:
    """REINFORCE++ advantages: critic-free returns-to-go, whitened over the whole batch.

    Per valid token ``r_t - kl_coef * kl_t``; its discounted return-to-go over the row's valid
    tokens (padding is skipped, as in :func:`.functional.gae` with zero values and ``lam = 1``);
    then :func:`.functional.whiten` over all valid tokens of the batch (global normalisation
    instead of a critic). With ``group_size`` (REINFORCE++-baseline) each row's group mean of the
    summed env reward is first subtracted at the row's last valid token, before the KL term.

    Args:
        rewards: ``[N, T]`` per-token env rewards (e.g. the outcome reward at the last token).
        mask: ``[N, T]`` non-zero on valid tokens.
        kl: Optional ``[N, T]`` per-token KL estimate to the reference (see ``kl_penalty``).
        kl_coef: Weight of ``kl`` (``>= 0``); non-zero needs ``kl``.
        gamma: Discount in ``[0, 1]``.
        group_size: Contiguous completions per prompt for the baseline variant, or ``None``.
            Rows without valid tokens are left out of their group's mean.

    Returns:
        ``[N, T]`` detached advantages in the rewards' dtype, 0 off the mask.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        >>> reinforce_pp_advantages(r, torch.ones(2, 2))  # returns 1, 1, 0, 0 whitened
        tensor([[ 0.8660,  0.8660],
                [-0.8660, -0.8660]])
    """
    check_dim("rewards", rewards, 2, "[N, T]")
    check_same_shape("rewards", rewards, "mask", mask)
    if kl is not None:
        check_same_shape("kl", kl, "rewards", rewards)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef != 0 and kl is None:
        raise ValueError(f"kl_coef={kl_coef} needs a kl tensor")
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    N, T = rewards.shape
    if group_size is not None:
        _check_groups("rows", N, shape_of(rewards), group_size)
    out_dtype = float_dtype(rewards)
    dt = compute_dtype(out_dtype)
    valid = as_bool(mask)
    with torch.no_grad():
        zero = torch.zeros((), dtype=dt, device=rewards.device)
        r = torch.where(valid, rewards.detach().to(dt), zero)
        if group_size is not None:
            has = valid.any(-1).reshape(-1, group_size)
            total = r.sum(-1).reshape(-1, group_size)
            baseline = total.sum(-1) / has.sum(-1).clamp(min=1).to(dt)
            baseline = baseline.repeat_interleave(group_size)
            pos = torch.arange(T, device=r.device)
            last = torch.where(valid, pos, torch.full_like(pos, -1)).amax(-1)  # -1: empty row
            r = r - torch.where(pos == last[:, None], baseline[:, None], torch.zeros_like(r))
        if kl is not None and kl_coef != 0:
            k = torch.where(valid, kl.detach().to(dt), torch.zeros_like(r))
            r = r - kl_coef * k
        returns = gae(r, torch.zeros_like(r), valid, gamma=gamma, lam=1.0)[0]
        return whiten(returns, valid).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: Optional[float] = 4e-4,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GSPO: PPO clipping on the length-normalised *sequence* ratio instead of token ratios.

    ``s_i = exp(mean over valid tokens of (logp - old_logp))`` (geometric mean of the token
    ratios); ``loss = mean_i max(-A_i s_i, -A_i clamp(s_i, 1 - clip_eps, 1 + clip_eps_high))``
    over rows with at least one valid token. The gradient flows through ``s_i``, so every token
    of a sequence gets the same weight ``s_i / |y_i|`` (hence the tiny default clip ranges).

    Args:
        logp: ``[N, T]`` current log-probs of the sampled tokens.
        old_logp: ``[N, T]`` behaviour log-probs (detached).
        advantages: ``[N]`` per-sequence advantages (detached).
        mask: ``[N, T]`` non-zero on valid tokens.
        clip_eps: Lower clip range, in ``[0, 1]``.
        clip_eps_high: Upper clip range ``>= 0``; ``None`` means ``clip_eps``.

    Returns:
        ``(loss, stats)``; detached 0-dim stats over sequences with a valid token:
        ``clipfrac_low``, ``clipfrac_high``, ``clipfrac`` (fractions of sequences clipped, as in
        ``policy_loss``), ``ratio_mean``, ``ratio_max`` (of ``s_i``), and ``approx_kl`` (token
        masked mean of ``ratio - 1 - log ratio``). All 0 without valid tokens.

    Example:
        >>> import torch
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> loss, stats = gspo_loss(logp, torch.tensor([[-1.2, -1.8]]), torch.tensor([1.0]),
        ...                         torch.ones(1, 2))
        >>> loss.item(), stats["ratio_mean"].item()  # token log-ratios +0.2, -0.2: s = exp(0)
        (-1.0, 1.0)
    """
    check_dim("logp", logp, 2, "[N, T]")
    check_same_shape("logp", logp, "old_logp", old_logp)
    check_same_shape("logp", logp, "mask", mask)
    if shape_of(advantages) != (logp.shape[0],):
        raise ValueError(
            f"shape mismatch: advantages has shape {shape_of(advantages)} but logp has shape "
            f"{shape_of(logp)}; advantages must be [N] (one per sequence)"
        )
    eps_low, eps_high = clip_range(clip_eps, clip_eps_high)

    valid = as_bool(mask)
    n_tok = valid.sum(-1)
    has = n_tok > 0
    log_ratio = torch.where(valid, logp - old_logp.detach(), torch.zeros_like(logp))
    seq_ratio = torch.exp(log_ratio.sum(-1) / n_tok.clamp(min=1).to(logp.dtype))
    adv = advantages.detach().to(logp.dtype)
    unclipped = -adv * seq_ratio
    clipped = -adv * torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_seq = torch.where(has, torch.maximum(unclipped, clipped), torch.zeros_like(unclipped))
    loss = per_seq.sum() / has.sum().clamp(min=1).to(logp.dtype)

    with torch.no_grad():
        s = seq_ratio.detach()
        lr = log_ratio.detach()
        stats = {
            "clipfrac_low": masked_mean(((adv < 0) & (s < 1.0 - eps_low)).to(s.dtype), has),
            "clipfrac_high": masked_mean(((adv > 0) & (s > 1.0 + eps_high)).to(s.dtype), has),
            "approx_kl": masked_mean(torch.expm1(lr) - lr, valid),
            **_ratio_stats(s, has),
        }
        stats["clipfrac"] = stats["clipfrac_low"] + stats["clipfrac_high"]
    return loss, stats


# ---------------------------------------------------------------------------------------------
# DAPO
# ---------------------------------------------------------------------------------------------


def group_has_signal(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: which groups have rewards that are not all equal.

    A group whose completions all got the same reward has zero group-relative advantage and
    therefore no policy gradient; DAPO drops such groups and samples more prompts.

    Args:
        rewards: ``[N]`` rewards, groups of ``group_size`` contiguous.
        group_size: Completions per prompt.

    Returns:
        ``[N // group_size]`` bool, True where ``max != min`` within the group.

    Example:
        >>> import torch
        >>> group_has_signal(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2)
        tensor([False,  True])
    """
    check_dim("rewards", rewards, 1, "[N]")
    _check_groups("rewards", rewards.shape[0], shape_of(rewards), group_size)
    grouped = rewards.detach().reshape(-1, group_size)
    return grouped.amax(-1) != grouped.amin(-1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the reward of over-long completions.

    With ``start = max_len - buffer``: 0 for ``L <= start``, a linear ramp
    ``-penalty * (L - start) / buffer`` for ``start < L <= max_len``, and ``-penalty`` beyond
    ``max_len``; a smooth signal instead of a cliff at the truncation length.

    Args:
        lengths: ``[N]`` completion lengths (tokens).
        max_len: Length at which the full penalty is reached.
        buffer: Width of the ramp, ``1 <= buffer <= max_len``.
        penalty: Full penalty, ``>= 0``.

    Returns:
        ``[N]`` penalties in ``[-penalty, 0]`` (floating dtype of ``lengths``, default dtype for
        integer lengths).

    Example:
        >>> import torch
        >>> overlong_penalty(torch.tensor([16, 17, 18, 20, 21]), max_len=20, buffer=4)
        tensor([ 0.0000, -0.2500, -0.5000, -1.0000, -1.0000])
    """
    check_dim("lengths", lengths, 1, "[N]")
    if not (isinstance(buffer, int) and 1 <= buffer <= max_len):
        raise ValueError(f"buffer must be an int in [1, max_len={max_len}], got {buffer!r}")
    if not penalty >= 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    start = max_len - buffer
    L = lengths.detach().to(float_dtype(lengths))
    ramp = -penalty * (L - start) / buffer
    full = torch.full_like(L, -penalty)
    return torch.where(L <= start, torch.zeros_like(L), torch.where(L <= max_len, ramp, full))


# ---------------------------------------------------------------------------------------------
# rollout / trainer mismatch
# ---------------------------------------------------------------------------------------------


def logprob_mismatch(sampler_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> Dict[str, Tensor]:
    """How far the trainer's log-probs of the sampled tokens are from the sampler's (e.g. vLLM).

    Returns detached 0-dim tensors over valid tokens: ``abs_gap_mean`` and ``abs_gap_max`` of
    ``|trainer - sampler|``, and ``ratio_outside_frac``, the fraction of tokens whose ratio
    ``exp(trainer - sampler)`` is outside ``[0.5, 2]``. All 0 when no token is valid.

    Example:
        >>> import torch
        >>> s = torch.tensor([[-1.0, -1.0, -1.0]])
        >>> t = torch.tensor([[-0.9, -1.8, -0.5]])
        >>> stats = logprob_mismatch(s, t, torch.ones(1, 3))
        >>> stats["abs_gap_max"], stats["ratio_outside_frac"]  # exp(-0.8) = 0.45 < 0.5
        (tensor(0.8000), tensor(0.3333))
    """
    check_dim("sampler_logp", sampler_logp, 2, "[N, T]")
    check_same_shape("sampler_logp", sampler_logp, "trainer_logp", trainer_logp)
    check_same_shape("sampler_logp", sampler_logp, "mask", mask)
    valid = as_bool(mask)
    with torch.no_grad():
        d = trainer_logp.detach() - sampler_logp.detach()
        gap = torch.where(valid, d.abs(), torch.zeros_like(d))
        ratio = torch.exp(torch.where(valid, d, torch.zeros_like(d)))
        outside = (ratio < 0.5) | (ratio > 2.0)
        return {
            "abs_gap_mean": masked_mean(gap, valid),
            "abs_gap_max": gap.amax() if gap.numel() else gap.sum(),
            "ratio_outside_frac": masked_mean(outside.to(d.dtype), valid),
        }


def _token_log_ratio(d: Tensor, valid: Tensor) -> Tensor:
    return d


def _sequence_log_ratio(d: Tensor, valid: Tensor) -> Tensor:
    return d.sum(-1, keepdim=True).expand_as(d)  # d is 0 off the mask


def _tis(ratio: Tensor, cap: float) -> Tensor:
    return torch.clamp(ratio, max=cap)


def _mis(ratio: Tensor, cap: float) -> Tensor:
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


CORRECTION_LEVELS: Dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}
CORRECTION_MODES: Dict[str, Callable[[Tensor, float], Tensor]] = {"tis": _tis, "mis": _mis}


def importance_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
) -> Tensor:
    """Importance weights correcting for tokens sampled by a different engine than the trainer.

    ``ratio = exp(trainer_logp - sampler_logp)`` per token (``level="token"``) or, for
    ``level="sequence"``, the product over the row's valid tokens (a sum of log-ratios), given to
    all its tokens. ``mode="tis"`` (truncated IS) uses ``min(ratio, cap)``; ``mode="mis"``
    (masked IS) uses ``ratio`` where ``ratio <= cap`` and drops the rest (weight 0).

    Args:
        trainer_logp: ``[N, T]`` trainer log-probs of the sampled tokens (before the update).
        sampler_logp: ``[N, T]`` log-probs the sampler reported.
        mask: ``[N, T]`` non-zero on valid tokens.
        mode: ``"tis"`` or ``"mis"``.
        level: ``"token"`` or ``"sequence"``.
        cap: Truncation / rejection threshold, ``>= 1``.

    Returns:
        ``[N, T]`` detached weights, 1 off the mask; pass as ``policy_loss(..., weights=w)``.

    Example:
        >>> import torch
        >>> t = torch.log(torch.tensor([[3.0, 0.5, 1.5]]))
        >>> importance_weights(t, torch.zeros(1, 3), torch.ones(1, 3), "tis")
        tensor([[2.0000, 0.5000, 1.5000]])
        >>> importance_weights(t, torch.zeros(1, 3), torch.ones(1, 3), "mis", "sequence")
        tensor([[0., 0., 0.]])
    """
    mode_fn = check_choice("correction mode", mode, CORRECTION_MODES)
    level_fn = check_choice("correction level", level, CORRECTION_LEVELS)
    check_dim("trainer_logp", trainer_logp, 2, "[N, T]")
    check_same_shape("trainer_logp", trainer_logp, "sampler_logp", sampler_logp)
    check_same_shape("trainer_logp", trainer_logp, "mask", mask)
    if not (isinstance(cap, (int, float)) and cap >= 1):
        raise ValueError(f"cap must be a number >= 1, got {cap!r}")
    valid = as_bool(mask)
    out_dtype = float_dtype(trainer_logp, sampler_logp)
    dt = compute_dtype(out_dtype)
    with torch.no_grad():
        d = trainer_logp.detach().to(dt) - sampler_logp.detach().to(dt)
        d = torch.where(valid, d, torch.zeros_like(d))
        w = mode_fn(torch.exp(level_fn(d, valid)), float(cap))
        return torch.where(valid, w, torch.ones_like(w)).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# KL-Cov / Clip-Cov
# ---------------------------------------------------------------------------------------------


def token_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-token contribution to ``Cov(log pi, A)`` over the batch's valid tokens.

    ``(logp - mean logp) * (A - mean A)`` with both means over all valid tokens. Cui et al. show
    the entropy change of a policy-gradient step is driven by this covariance: a few tokens with
    large positive covariance collapse entropy, so KL-Cov / Clip-Cov restrain exactly those.

    Returns:
        ``[N, T]`` detached, 0 off the mask.

    Example:
        >>> import torch
        >>> token_covariance(torch.tensor([[0.0, -2.0, 9.0]]), torch.tensor([[1.0, -1.0, 5.0]]),
        ...                  torch.tensor([[1, 1, 0]]))
        tensor([[1., 1., 0.]])
    """
    check_dim("logp", logp, 2, "[N, T]")
    check_same_shape("logp", logp, "advantages", advantages)
    check_same_shape("logp", logp, "mask", mask)
    valid = as_bool(mask)
    out_dtype = float_dtype(logp, advantages)
    dt = compute_dtype(out_dtype)
    with torch.no_grad():
        zero = torch.zeros((), dtype=dt, device=logp.device)
        lp = torch.where(valid, logp.detach().to(dt), zero)
        adv = torch.where(valid, advantages.detach().to(dt), zero)
        cov = (lp - masked_mean(lp, valid)) * (adv - masked_mean(adv, valid))
        return torch.where(valid, cov, zero).to(out_dtype)


def _select_kl_cov(cov: Tensor, valid: Tensor, k: int, bounds, generator) -> Tensor:
    """The ``k`` valid tokens with the largest covariance."""
    flat = torch.where(valid, cov, torch.full_like(cov, -math.inf)).reshape(-1)
    selected = torch.zeros_like(flat, dtype=torch.bool)
    selected[torch.topk(flat, k).indices] = True
    return selected.view_as(cov)


def _select_clip_cov(cov: Tensor, valid: Tensor, k: int, bounds, generator) -> Tensor:
    """Up to ``k`` valid tokens drawn uniformly among those with covariance in ``bounds``."""
    low, high = bounds
    candidates = torch.nonzero((valid & (cov >= low) & (cov <= high)).reshape(-1))[:, 0]
    device = "cpu" if generator is None else generator.device
    perm = torch.randperm(candidates.numel(), generator=generator, device=device)
    selected = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    selected[candidates[perm[:k].to(candidates.device)]] = True
    return selected.view_as(cov)


COV_MODES: Dict[str, Callable] = {"kl-cov": _select_kl_cov, "clip-cov": _select_clip_cov}


def cov_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    mode: str = "kl-cov",
    select_ratio: float = 2e-3,
    kl_coef: float = 1.0,
    cov_bounds: Tuple[float, float] = (1.0, 5.0),
    aggregation: str = "token-mean",
    generator: Optional[torch.Generator] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """KL-Cov / Clip-Cov: the unclipped surrogate ``-A * ratio``, restrained on a few tokens.

    ``k = max(1, int(select_ratio * n_valid))`` tokens are selected by :func:`token_covariance`:

    * ``"kl-cov"``: the top-``k`` by covariance get ``+ kl_coef * |logp - old_logp|``.
    * ``"clip-cov"``: ``k`` drawn uniformly (with ``generator``) among the tokens with covariance
      in ``[low, high] = cov_bounds`` (fewer if fewer qualify) are detached: same loss value, no
      gradient through them.

    Aggregated with :func:`.functional.masked_aggregate`. Selection needs ``n_valid`` on the host
    (one sync). Unlike verl's Clip-Cov there is no PPO clipping on top, selected tokens keep their
    loss value, and the bounds are inclusive.

    Args:
        logp: ``[N, T]``.
        old_logp: ``[N, T]``, detached.
        advantages: ``[N, T]``, detached.
        mask: ``[N, T]``.
        mode: ``"kl-cov"`` or ``"clip-cov"``.
        select_ratio: Fraction of valid tokens to select, in ``(0, 1]``.
        kl_coef: Weight of the ``|log-ratio|`` penalty (kl-cov), ``>= 0``.
        cov_bounds: ``(low, high)`` covariance window of clip-cov, ``low <= high``.
        aggregation: See :func:`.functional.masked_aggregate`.
        generator: Random generator of clip-cov's draw (default: torch's global one).

    Returns:
        ``(loss, stats)``; detached 0-dim stats: ``cov_selected_frac`` (selected / valid tokens),
        ``ratio_mean``, ``ratio_max`` and ``approx_kl`` as in ``policy_loss``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[0.0, -1.0, -2.0, -5.0]])
        >>> adv = torch.tensor([[1.0, 0.5, -0.5, -1.0]])  # covariances 2, 0.5, 0, 3
        >>> loss, stats = cov_policy_loss(lp, lp - torch.tensor([[0.0, 0.0, 0.0, 0.2]]), adv,
        ...                               torch.ones(1, 4), select_ratio=0.25)
        >>> loss  # (-1 - 0.5 + 0.5 + exp(0.2) + |0.2|) / 4 on the top-covariance token
        tensor(0.1054)
    """
    select = check_choice("covariance mode", mode, COV_MODES)
    check_dim("logp", logp, 2, "[N, T]")
    check_same_shape("logp", logp, "old_logp", old_logp)
    check_same_shape("logp", logp, "advantages", advantages)
    check_same_shape("logp", logp, "mask", mask)
    if not (0.0 < select_ratio <= 1.0):
        raise ValueError(f"select_ratio must be in (0, 1], got {select_ratio}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    low, high = (float(b) for b in cov_bounds)
    if not low <= high:
        raise ValueError(f"cov_bounds must be (low, high) with low <= high, got {cov_bounds}")

    valid = as_bool(mask)
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(valid, logp - old_logp.detach(), zero)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    per_token = -adv * ratio

    n_valid = int(valid.sum())
    if n_valid > 0:
        k = max(1, int(select_ratio * n_valid))
        selected = select(token_covariance(logp, adv, valid), valid, k, (low, high), generator)
    else:
        selected = torch.zeros_like(valid)
    if mode == "kl-cov":
        per_token = per_token + torch.where(selected, kl_coef * log_ratio.abs(), zero)
    else:
        per_token = torch.where(selected, per_token.detach(), per_token)
    loss = masked_aggregate(per_token, valid, aggregation)

    with torch.no_grad():
        lr = log_ratio.detach()
        stats = {
            "cov_selected_frac": masked_mean(selected.to(lr.dtype), valid),
            "approx_kl": masked_mean(torch.expm1(lr) - lr, valid),
            **_ratio_stats(ratio.detach(), valid),
        }
    return loss, stats

"""Properties of `tokengym.agents.variants` (RLOO, REINFORCE++, GSPO, DAPO, TIS/MIS, KL-Cov/Clip-Cov)
and of `policy_loss(..., weights=...)`.

Tolerances are derived from float64 arithmetic: a computation of ``n`` roundings on values of
magnitude ``m`` is off by at most about ``n * EPS * m`` (EPS = 2**-52), so each test bounds
``n`` and ``m`` for its computation and allows a small factor on top.
"""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tokengym.agents.functional import AGGREGATIONS, masked_aggregate, policy_loss
from tokengym.agents.variants import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    cov_policy_loss,
    group_has_signal,
    gspo_loss,
    importance_weights,
    logprob_mismatch,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    token_covariance,
)

F64 = torch.float64
EPS = torch.finfo(F64).eps
AGGS = list(AGGREGATIONS)
reals = st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False)
# Rewards on a 1/8 grid: sums and differences of a few of them are exact in float64.
grid = st.integers(-40, 40).map(lambda k: k / 8)
nonzero = st.one_of(st.floats(0.05, 3.0), st.floats(-3.0, -0.05))


def mask_row(T):
    return st.one_of(st.lists(st.booleans(), min_size=T, max_size=T), st.just([True] * T), st.just([False] * T))


@st.composite
def token_batch(draw, max_b=4, max_t=8, values=reals, n=1, min_b=1):
    """[B, T] bool mask plus ``n`` [B, T] float64 tensors."""
    B = draw(st.integers(min_b, max_b))
    T = draw(st.integers(1, max_t))
    mask = torch.tensor([draw(mask_row(T)) for _ in range(B)], dtype=torch.bool).view(B, T)
    xs = [
        torch.tensor(draw(st.lists(values, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
        for _ in range(n)
    ]
    return (mask, *xs)


def with_garbage(x, mask, fill):
    return torch.where(mask, x, torch.full_like(x, fill))


# ---------------------------------------------------------------------------------------------
# RLOO
# ---------------------------------------------------------------------------------------------


@st.composite
def groups_of(draw, elements=grid, min_size=2):
    n_groups = draw(st.integers(1, 4))
    G = draw(st.integers(min_size, 6))
    r = draw(st.lists(elements, min_size=n_groups * G, max_size=n_groups * G))
    return torch.tensor(r, dtype=F64), G


def test_rloo_hand_computed():
    # group [1, 0, 0]: A_0 = 1 - (0 + 0)/2 = 1 ; A_1 = 0 - (1 + 0)/2 = -0.5 ; A_2 = -0.5
    # group [3, 3, 3]: every reward equals its leave-one-out mean -> 0
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 3.0], dtype=F64), group_size=3)
    assert adv.tolist() == [1.0, -0.5, -0.5, 0.0, 0.0, 0.0]


@given(groups_of())
def test_rloo_is_leave_one_out_and_scaled_group_centring(data):
    r, G = data
    adv = rloo_advantages(r, G)
    assert adv.shape == r.shape and adv.dtype == F64
    scale = max(float(r.abs().max()), 1.0)
    # a mean of G exact grid values (1 rounding), a difference (1), the factor G/(G-1) (2): ~4 EPS
    tol = 8 * EPS * scale * G / (G - 1)
    for g_r, g_a in zip(r.view(-1, G).tolist(), adv.view(-1, G).tolist()):
        total = sum(map(Fraction, g_r))
        mean = total / G
        for i in range(G):
            loo = Fraction(g_r[i]) - (total - Fraction(g_r[i])) / (G - 1)  # exact definition
            assert abs(g_a[i] - float(loo)) <= tol
            assert abs(g_a[i] - float(Fraction(G, G - 1) * (Fraction(g_r[i]) - mean))) <= tol
        assert abs(sum(g_a)) <= G * tol  # zero-sum per group


@given(groups_of(), st.data())
def test_rloo_invariant_to_a_constant_per_group(data, draw):
    r, G = data
    n_groups = r.numel() // G
    shifts = torch.tensor(draw.draw(st.lists(grid, min_size=n_groups, max_size=n_groups)), dtype=F64)
    # grid values: r + c and (r_i + c) - (r_0 + c) are exact, so the result is identical
    assert torch.equal(rloo_advantages(r + shifts.repeat_interleave(G), G), rloo_advantages(r, G))


@given(st.floats(-1e6, 1e6), st.integers(2, 7), st.integers(1, 3))
def test_rloo_equal_rewards_give_exact_zeros(value, G, n_groups):
    adv = rloo_advantages(torch.full((G * n_groups,), value, dtype=F64), G)
    assert torch.equal(adv, torch.zeros_like(adv))


def test_rloo_errors():
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="N=5.*group_size=2"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        rloo_advantages(torch.zeros(2, 2), 2)


# ---------------------------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    # kl_coef = 0.5, gamma = 0.5; row 1 has padding in the middle (skipped) with garbage there.
    # row 0: r - 0.5 kl = [0 - 0.1, 0, 1]  -> returns t2 = 1, t1 = 0 + 0.5*1 = 0.5, t0 = -0.1 + 0.25 = 0.15
    # row 1: [0, -, 1 - 0.2 = 0.8]         -> returns t2 = 0.8, t0 = 0 + 0.5*0.8 = 0.4
    # valid returns 0.15, 0.5, 1, 0.4, 0.8: mean 2.85/5 = 0.57, deviations -0.42 -0.07 0.43 -0.17 0.23
    # unbiased var = (0.1764 + 0.0049 + 0.1849 + 0.0289 + 0.0529) / 4 = 0.448 / 4 = 0.112
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, math.nan, 1.0]], dtype=F64)
    kl = torch.tensor([[0.2, 0.0, 0.0], [0.0, math.inf, 0.4]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    adv = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=0.5, gamma=0.5)
    dev = torch.tensor([[-0.42, -0.07, 0.43], [-0.17, 0.0, 0.23]], dtype=F64)
    torch.testing.assert_close(adv, dev / math.sqrt(0.112 + 1e-8), rtol=0, atol=1e-14)


def test_reinforce_pp_baseline_hand_computed():
    # group_size 2: row sums 1 and 0 -> group mean 0.5, subtracted at each row's last valid token
    # (row 1's is t1: t2 is padding): rewards [0, 0, 0.5] and [0, -0.5]; gamma 1 -> returns
    # 0.5, 0.5, 0.5, -0.5, -0.5: mean 0.1, deviations 0.4 x3, -0.6 x2,
    # unbiased var = (3 * 0.16 + 2 * 0.36) / 4 = 0.3
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask, group_size=2)
    dev = torch.tensor([[0.4, 0.4, 0.4], [-0.6, -0.6, 0.0]], dtype=F64)
    torch.testing.assert_close(adv, dev / math.sqrt(0.3 + 1e-8), rtol=0, atol=1e-14)
    # a row without valid tokens is left out of its group's mean: group [row 0, empty row 1] has
    # baseline 1 (not 0.5), so row 0 [1, 0] -> [1, -1] with returns 0, -1; group 2 is all zeros.
    # valid returns 0, -1, 0, 0, 0, 0: mean -1/6, deviations 1/6, -5/6, 1/6 x4, var = (5/36 + 25/36) / 5 = 1/6
    rewards = torch.tensor([[1.0, 0.0], [math.nan, math.inf], [0.0, 0.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [0, 0], [1, 1], [1, 1]])
    adv = reinforce_pp_advantages(rewards, mask, group_size=2)
    dev = torch.tensor([[1 / 6, -5 / 6], [0.0, 0.0], [1 / 6, 1 / 6], [1 / 6, 1 / 6]], dtype=F64)
    torch.testing.assert_close(adv, dev / math.sqrt(1 / 6 + 1e-8), rtol=0, atol=1e-14)


def returns_to_go(rewards, mask, gamma):
    """Loop reference: discounted sum of the later valid rewards of the row."""
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        acc = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                acc = float(rewards[b, t]) + gamma * acc
                out[b, t] = acc
    return out


@given(token_batch(n=2), st.sampled_from([0.0, 0.3]), st.sampled_from([1.0, 0.9, 0.5, 0.0]))
def test_reinforce_pp_whitened_returns(batch, kl_coef, gamma):
    mask, rewards, kl = batch
    adv = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=kl_coef, gamma=gamma)
    assert adv.dtype == F64 and not adv.requires_grad
    assert torch.all(adv[~mask] == 0)
    n = int(mask.sum())
    ret = returns_to_go(rewards - kl_coef * kl, mask, gamma)[mask]
    # |returns| <= T * 3.9: sums of up to 8 terms, whitening rounds ~n times more
    tol = 16 * (n + 8) * EPS
    if n >= 2:
        var = float(ret.var())
        expected = (ret - ret.mean()) / math.sqrt(var + 1e-8)
        torch.testing.assert_close(adv[mask], expected, rtol=0, atol=tol * (1 + 40 / math.sqrt(var + 1e-8)))
        assert abs(float(adv[mask].mean())) <= tol * (1 + 40 / math.sqrt(var + 1e-8))
        if var > 1e-4:  # unit std up to the whitening eps: 1 - sqrt(v / (v + 1e-8)) <= 1e-8 / (2 v)
            assert abs(float(adv[mask].std()) - 1.0) <= 1e-8 / (2 * var) + 1e-9
    else:
        assert torch.all(adv == 0)  # one valid token is centred, not scaled


@given(token_batch(n=2, min_b=2), st.sampled_from([0.5, 0.9]), st.sampled_from([None, 2]), st.data())
def test_reinforce_pp_skips_padding_wherever_it_sits(batch, gamma, group_size, data):
    mask, rewards, kl = batch
    assume(group_size is None or mask.shape[0] % group_size == 0)
    B, T = mask.shape
    # spread the columns out with padding columns (garbage, masked) in between
    gaps = data.draw(st.lists(st.integers(0, 2), min_size=T, max_size=T))
    cols = torch.tensor([sum(gaps[: t + 1]) + t for t in range(T)])
    width = int(cols[-1]) + 1
    wide = [torch.full((B, width), math.nan, dtype=F64) for _ in range(2)]
    wide_mask = torch.zeros(B, width, dtype=torch.bool)
    wide[0][:, cols], wide[1][:, cols], wide_mask[:, cols] = rewards, kl, mask
    kw = dict(kl_coef=0.3, gamma=gamma, group_size=group_size)
    got = reinforce_pp_advantages(wide[0], wide_mask, kl=wide[1], **kw)
    want = reinforce_pp_advantages(rewards, mask, kl=kl, **kw)
    assert torch.all(got[~wide_mask] == 0)
    # the same arithmetic except the order of the whitening sums (n terms of size <= |adv| ~ sqrt(n))
    n = max(int(mask.sum()), 1)
    torch.testing.assert_close(got[:, cols], want, rtol=0, atol=16 * n * EPS * math.sqrt(n) * 4)


@given(token_batch(n=2), st.sampled_from([math.inf, -math.inf, math.nan]), st.sampled_from([None, 1, 2]))
def test_reinforce_pp_ignores_masked_garbage(batch, fill, group_size):
    mask, rewards, kl = batch
    assume(group_size is None or mask.shape[0] % group_size == 0)
    clean = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=0.1, group_size=group_size)
    dirty_r, dirty_kl = with_garbage(rewards, mask, fill), with_garbage(kl, mask, fill)
    dirty = reinforce_pp_advantages(dirty_r, mask, kl=dirty_kl, kl_coef=0.1, group_size=group_size)
    assert torch.equal(clean, dirty)


@given(token_batch(values=grid), st.sampled_from([None, 1, 2]))
def test_reinforce_pp_outcome_reward_is_shared_by_all_tokens_of_a_row(batch, group_size):
    mask, rewards = batch
    assume(group_size is None or mask.shape[0] % group_size == 0)
    # keep only a reward at each row's last valid token (an outcome reward)
    pos = torch.arange(mask.shape[1])
    last = torch.where(mask, pos, -1).amax(-1, keepdim=True)
    outcome = torch.where(pos == last, rewards, 0.0)
    adv = reinforce_pp_advantages(outcome, mask, group_size=group_size)
    for b in range(mask.shape[0]):
        row = adv[b][mask[b]]
        assert torch.all(row == row[0]) if row.numel() else True


@given(token_batch(values=grid, n=2, min_b=2), st.data())
def test_reinforce_pp_baseline_matches_loops_and_ignores_a_group_constant(batch, data):
    mask, rewards, kl = batch
    B, T = mask.shape
    G = data.draw(st.sampled_from([g for g in (1, 2, 3, 4) if B % g == 0]))
    group = data.draw(st.integers(0, B // G - 1))
    c = data.draw(grid)
    pos = torch.arange(T)
    last = torch.where(mask, pos, -1).amax(-1, keepdim=True)
    # loop reference: subtract the group mean (over rows with a valid token) of the summed reward
    adjusted = rewards.clone()
    for g in range(B // G):
        rows = [b for b in range(g * G, (g + 1) * G) if mask[b].any()]
        mean = sum(float(rewards[b][mask[b]].sum()) for b in rows) / max(len(rows), 1)
        for b in rows:
            adjusted[b, int(last[b])] -= mean
    ret = returns_to_go(adjusted - 0.25 * kl, mask, 1.0)[mask]
    n = int(mask.sum())
    assume(n >= 2)
    std = math.sqrt(float(ret.var()) + 1e-8)
    # |rewards| <= 5: row sums <= 40, baselines <= 45, returns <= 40 + 45 + 8 * 1.25 < 100; the
    # returns take <= T + 3 roundings and whitening ~n more, all divided by the std
    tol = 16 * (T + n + 3) * EPS * 100 / std
    before = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=0.25, group_size=G)
    torch.testing.assert_close(before[mask], (ret - ret.mean()) / std, rtol=0, atol=tol)
    # adding c to the outcome (last valid reward) of every row of one group changes nothing
    in_group = (torch.arange(B) // G == group)[:, None]
    shifted = rewards + torch.where(in_group & (pos == last), c, 0.0)
    after = reinforce_pp_advantages(shifted, mask, kl=kl, kl_coef=0.25, group_size=G)
    torch.testing.assert_close(after, before, rtol=0, atol=2 * tol)


def test_reinforce_pp_errors():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        reinforce_pp_advantages(r, torch.ones(2, 2))
    with pytest.raises(ValueError, match="kl"):
        reinforce_pp_advantages(r, torch.ones(2, 3), kl_coef=0.1)
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp_advantages(r, torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="divisible"):
        reinforce_pp_advantages(r, torch.ones(2, 3), group_size=3)


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def test_gspo_hand_computed():
    # clip_eps 0.02 (s >= 0.98), clip_eps_high 0.04 (s <= 1.04)
    # row 0: log-ratios 0.2, -0.1 -> mean 0.05, s = e^0.05 = 1.0512711 > 1.04, A = +1: clipped,
    #        loss -1.04, no gradient
    # row 1: log-ratios -0.03, -0.03, 0 -> mean -0.02, s = e^-0.02 = 0.9801987 >= 0.98, A = -2:
    #        inside, loss 2 * 0.9801987 = 1.9603973 ; d/dlogp_t = -A * s / 3 per token
    # row 2: no valid token (garbage) -> left out of the mean over sequences
    # loss = (-1.04 + 1.9603973) / 2 = 0.4601987 ; row-1 gradient = 2 * 0.9801987 / 3 / 2 = 0.3267329
    old = torch.full((3, 3), -1.0, dtype=F64)
    log_ratio = torch.tensor([[0.2, -0.1, 0.0], [-0.03, -0.03, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    logp = (old + log_ratio).requires_grad_()
    old = old.clone()
    old[2] = math.inf
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    loss, stats = gspo_loss(logp, old, torch.tensor([1.0, -2.0, 5.0], dtype=F64), mask, 0.02, 0.04)
    s1 = math.exp(-0.02)
    assert loss.item() == pytest.approx((-1.04 + 2 * s1) / 2, abs=1e-15)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 3] * 3, [0.0] * 3], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-15)
    assert stats["clipfrac_high"].item() == 0.5 and stats["clipfrac_low"].item() == 0.0
    assert stats["clipfrac"].item() == 0.5
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(0.05) + s1) / 2, abs=1e-15)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.05), abs=1e-15)


@st.composite
def gspo_case(draw, log_ratios=st.floats(-0.05, 0.05)):
    mask, old = draw(token_batch(values=st.floats(-5.0, 0.0)))
    B, T = mask.shape
    lr = torch.tensor(draw(st.lists(log_ratios, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    adv = torch.tensor(draw(st.lists(reals, min_size=B, max_size=B)), dtype=F64)
    eps_low = draw(st.sampled_from([0.0, 3e-4, 0.005, 0.02]))
    eps_high = draw(st.sampled_from([None, 4e-4, 0.01, 0.03]))
    return mask, old, lr, adv, eps_low, eps_high


@given(gspo_case(log_ratios=st.floats(-0.7, 0.7)), st.data())
def test_gspo_equals_policy_loss_with_one_token_per_row(case, data):
    mask, old, lr, adv, eps_low, eps_high = case
    B, T = mask.shape
    mask = torch.zeros_like(mask)
    mask[torch.arange(B), torch.tensor([data.draw(st.integers(0, T - 1)) for _ in range(B)])] = True
    logp_a = (old + lr).requires_grad_()
    logp_b = (old + lr).requires_grad_()
    got, stats = gspo_loss(logp_a, old, adv, mask, eps_low, eps_high)
    ref, ref_stats = policy_loss(logp_b, old, adv, mask, eps_low, eps_high)
    # s = exp(x / 1) vs exp(x): same number; the means divide the same sum by B
    assert got.item() == pytest.approx(ref.item(), abs=4 * EPS * B * 3 * 2)
    got.backward()
    ref.backward()
    torch.testing.assert_close(logp_a.grad, logp_b.grad, rtol=4 * EPS, atol=0)
    for key in ("clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "ratio_max", "approx_kl"):
        assert stats[key].item() == pytest.approx(ref_stats[key].item(), abs=8 * EPS * 3)


@given(gspo_case())
def test_gspo_ratio_one_is_minus_mean_advantage(case):
    mask, old, _, adv, eps_low, eps_high = case
    loss, stats = gspo_loss(old.clone(), old, adv, mask, eps_low, eps_high)
    has = mask.any(-1)
    expected = float(adv[has].mean()) if has.any() else 0.0
    assert loss.item() == pytest.approx(-expected, abs=4 * EPS * 3 * mask.shape[0])
    assert stats["clipfrac"].item() == 0.0
    assert stats["ratio_mean"].item() == (1.0 if has.any() else 0.0)


@given(gspo_case())
def test_gspo_gradient_is_the_sequence_level_one(case):
    mask, old, lr, adv, eps_low, eps_high = case
    hi = eps_low if eps_high is None else eps_high
    logp = (old + lr).requires_grad_()
    loss, stats = gspo_loss(logp, old, adv, mask, eps_low, eps_high)
    loss.backward()
    rows = [b for b in range(mask.shape[0]) if mask[b].any()]
    # independent objective: s_i as the geometric mean prod(ratio_t) ** (1 / L), row by row
    logp2 = (old + lr).requires_grad_()
    total, clipped = 0.0, 0
    for b in rows:
        s = torch.prod(torch.exp(logp2[b][mask[b]] - old[b][mask[b]])) ** (1.0 / int(mask[b].sum()))
        sv = float(s.detach())
        assume(abs(sv - (1 - eps_low)) > 1e-12 and abs(sv - (1 + hi)) > 1e-12)  # no ties at the bounds
        a = float(adv[b])
        total = total + torch.maximum(-a * s, -a * torch.clamp(s, 1 - eps_low, 1 + hi))
        clipped += (a > 0 and sv > 1 + hi) or (a < 0 and sv < 1 - eps_low)
    if not rows:
        assert loss.item() == 0.0 and torch.all(logp.grad == 0)
        return
    (total / len(rows)).backward()
    # prod of <= 8 exps, a root, a few products: ~20 roundings on gradients of size <= 3 * 1.05
    torch.testing.assert_close(logp.grad, logp2.grad, rtol=0, atol=64 * EPS * 3.2)
    assert torch.all(logp.grad[~mask] == 0)
    assert stats["clipfrac"].item() == pytest.approx(clipped / len(rows), abs=1e-15)
    # analytic: every valid token of an unclipped row i gets -A_i s_i / (L_i * n_rows)
    for b in rows:
        L = int(mask[b].sum())
        s = math.exp(float(lr[b][mask[b]].sum()) / L)
        a = float(adv[b])
        blocked = (a > 0 and s > 1 + hi) or (a < 0 and s < 1 - eps_low)
        want = 0.0 if blocked else -a * s / (L * len(rows))
        want = torch.full((L,), want, dtype=F64)
        torch.testing.assert_close(logp.grad[b][mask[b]], want, rtol=0, atol=64 * EPS * 3.2)


def test_gspo_gradient_differs_from_token_level_ppo():
    # log-ratios +0.1, -0.1, A = 1, no clipping in reach: s = exp(0) = 1, so GSPO gives each token
    # -A * s / 2 = -0.5; token-level PPO gives -A * ratio_t / 2 = -exp(+-0.1) / 2 = -0.5526, -0.4524
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    lr = torch.tensor([[0.1, -0.1]], dtype=F64)
    a, b = (old + lr).requires_grad_(), (old + lr).requires_grad_()
    gspo_loss(a, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 2), 1.0, 10.0)[0].backward()
    policy_loss(b, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 2), 1.0, 10.0)[0].backward()
    torch.testing.assert_close(a.grad, torch.tensor([[-0.5, -0.5]], dtype=F64), rtol=0, atol=4 * EPS)
    torch.testing.assert_close(b.grad, -torch.exp(lr) / 2, rtol=0, atol=4 * EPS)
    assert abs(float(a.grad[0, 0] - b.grad[0, 0])) > 0.05


@given(gspo_case(), st.sampled_from([math.inf, -math.inf, math.nan]))
def test_gspo_empty_rows_contribute_nothing(case, fill):
    mask, old, lr, adv, eps_low, eps_high = case
    logp = (old + lr).requires_grad_()
    loss, stats = gspo_loss(logp, old, adv, mask, eps_low, eps_high)
    # append an all-masked row full of garbage with a huge advantage
    T = mask.shape[1]
    logp_x = torch.cat([(old + lr), torch.full((1, T), fill, dtype=F64)]).requires_grad_()
    old_x = torch.cat([old, torch.full((1, T), fill, dtype=F64)])
    mask_x = torch.cat([mask, torch.zeros(1, T, dtype=torch.bool)])
    adv_x = torch.cat([adv, torch.tensor([1e6], dtype=F64)])
    loss_x, stats_x = gspo_loss(logp_x, old_x, adv_x, mask_x, eps_low, eps_high)
    # the same terms, but torch may block a longer sum differently: B*T roundings of terms <= 3.2
    tol = 8 * mask.numel() * EPS * 3.2
    assert loss_x.item() == pytest.approx(loss.item(), abs=tol)
    loss.backward()
    loss_x.backward()
    assert torch.equal(logp_x.grad[:-1], logp.grad) and torch.all(logp_x.grad[-1] == 0)
    assert all(stats_x[k].item() == pytest.approx(stats[k].item(), abs=tol) for k in stats)


def test_gspo_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 3\)|\(2,\)"):
        gspo_loss(x, x, torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3\)"):
        gspo_loss(x, x, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        gspo_loss(x, torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_eps"):
        gspo_loss(x, x, torch.zeros(2), torch.ones(2, 3), clip_eps=1.5)
    with pytest.raises(ValueError, match="clip_eps_high"):
        gspo_loss(x, x, torch.zeros(2), torch.ones(2, 3), clip_eps_high=-0.1)


# ---------------------------------------------------------------------------------------------
# DAPO: dynamic sampling and soft overlong punishment
# ---------------------------------------------------------------------------------------------


def test_group_has_signal_hand_computed():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    assert group_has_signal(r, 3).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="divisible"):
        group_has_signal(r, 2)


@given(groups_of(elements=st.sampled_from([0.0, 1.0, 0.5, -1.0]), min_size=1))
def test_group_has_signal_iff_not_all_equal(data):
    r, G = data
    got = group_has_signal(r, G)
    assert got.dtype == torch.bool and got.shape == (r.numel() // G,)
    assert got.tolist() == [max(g) != min(g) for g in r.view(-1, G).tolist()]


def test_overlong_penalty_hand_computed():
    # max_len 20, buffer 4 -> ramp starts after 16: 17 -> -1/4, 18 -> -2/4, 20 -> -4/4, 21 -> full
    got = overlong_penalty(torch.tensor([0, 16, 17, 18, 20, 21, 100]), max_len=20, buffer=4, penalty=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    # penalty 0.5 and float lengths: 16.5 -> -0.5 * 0.5 / 4 = -0.0625
    got = overlong_penalty(torch.tensor([16.5], dtype=F64), 20, 4, penalty=0.5)
    assert got.tolist() == [-0.0625]


@given(
    st.lists(st.integers(0, 80), min_size=1, max_size=20),
    st.integers(1, 60),
    st.data(),
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_overlong_penalty_monotone_bounded_continuous(lengths, max_len, data, penalty):
    buffer = data.draw(st.integers(1, max_len))
    L = torch.tensor(sorted(lengths))
    p = overlong_penalty(L, max_len, buffer, penalty)
    assert torch.all(p[1:] <= p[:-1])  # non-increasing in L
    assert torch.all((p >= -penalty) & (p <= 0))
    start = max_len - buffer
    # continuous at the ramp start: 0 at start, -penalty * d / buffer just after it
    edge = overlong_penalty(torch.tensor([float(start), start + 1e-6], dtype=F64), max_len, buffer, penalty)
    assert edge[0].item() == 0.0
    assert abs(edge[1].item() + penalty * 1e-6 / buffer) <= 4 * EPS * max(max_len, 1) * penalty / buffer
    # and at max_len the ramp meets the full penalty
    # (-penalty * buffer) / buffer: exact for these small penalties
    assert overlong_penalty(torch.tensor([max_len]), max_len, buffer, penalty).item() == -penalty


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=11)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=2, penalty=-1.0)


# ---------------------------------------------------------------------------------------------
# sampler / trainer mismatch: logprob_mismatch, importance_weights, policy_loss(weights=...)
# ---------------------------------------------------------------------------------------------


def test_logprob_mismatch_hand_computed():
    # gaps 0.1, -0.8, 0.5 (t3 masked with garbage): mean |gap| = 1.4 / 3, max 0.8,
    # ratios exp(0.1) = 1.105, exp(-0.8) = 0.449 (< 0.5: outside), exp(0.5) = 1.649 -> 1/3 outside
    s = torch.tensor([[-1.0, -1.0, -1.0, -math.inf]], dtype=F64)
    t = torch.tensor([[-0.9, -1.8, -0.5, math.nan]], dtype=F64)
    stats = logprob_mismatch(s, t, torch.tensor([[1, 1, 1, 0]]))
    assert stats["abs_gap_mean"].item() == pytest.approx(1.4 / 3, abs=4 * EPS)
    assert stats["abs_gap_max"].item() == pytest.approx(0.8, abs=4 * EPS)
    assert stats["ratio_outside_frac"].item() == pytest.approx(1 / 3, abs=EPS)
    empty = logprob_mismatch(s, t, torch.zeros(1, 4))
    assert all(v.item() == 0.0 for v in empty.values())


@given(token_batch(n=2))
def test_logprob_mismatch_matches_loops(batch):
    mask, s, t = batch
    stats = logprob_mismatch(s, t, mask)
    gaps = [float(t[b, i] - s[b, i]) for b in range(mask.shape[0]) for i in range(mask.shape[1]) if mask[b, i]]
    n = max(len(gaps), 1)
    assert stats["abs_gap_mean"].item() == pytest.approx(sum(map(abs, gaps)) / n, abs=4 * n * EPS * 6)
    assert stats["abs_gap_max"].item() == max(map(abs, gaps), default=0.0)
    outside = sum(not (0.5 <= math.exp(g) <= 2.0) for g in gaps)
    assert stats["ratio_outside_frac"].item() == pytest.approx(outside / n, abs=EPS)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_importance_weights_hand_computed():
    # row 0: ratios 3, 0.5, 1.5 (product 2.25); row 1: ratios 1.2, 0.5 (product 0.6), t2 masked
    t = torch.log(torch.tensor([[3.0, 0.5, 1.5], [1.2, 0.5, 9.0]], dtype=F64))
    s = torch.zeros(2, 3, dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    expect = {
        ("tis", "token"): [[2.0, 0.5, 1.5], [1.2, 0.5, 1.0]],  # min(ratio, 2)
        ("mis", "token"): [[0.0, 0.5, 1.5], [1.2, 0.5, 1.0]],  # ratio 3 > 2 dropped
        ("tis", "sequence"): [[2.0, 2.0, 2.0], [0.6, 0.6, 1.0]],  # min(2.25, 2) ; 0.6
        ("mis", "sequence"): [[0.0, 0.0, 0.0], [0.6, 0.6, 1.0]],  # 2.25 > 2 drops the row
    }
    for (mode, level), want in expect.items():
        got = importance_weights(t, s, m, mode=mode, level=level, cap=2.0)
        torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=8 * EPS, atol=0)


@given(
    token_batch(n=2, values=st.floats(-3.0, 3.0)),
    st.sampled_from(list(CORRECTION_MODES)),
    st.sampled_from(list(CORRECTION_LEVELS)),
    st.sampled_from([1.0, 1.5, 2.0, 10.0]),
    st.sampled_from([math.inf, math.nan]),
)
def test_importance_weights_properties(batch, mode, level, cap, fill):
    mask, t, s = batch
    t = t.clone().requires_grad_()
    w = importance_weights(with_garbage(t, mask, fill), with_garbage(s, mask, -fill), mask, mode, level, cap)
    assert not w.requires_grad and w.dtype == F64
    assert torch.all(w[~mask] == 1)
    t = t.detach()
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero()[:, 0].tolist()
        log_prod = sum(float(t[b, i] - s[b, i]) for i in idx)
        for i in idx:
            lr = float(t[b, i] - s[b, i]) if level == "token" else log_prod
            ratio = math.exp(lr)
            want = min(ratio, cap) if mode == "tis" else (ratio if ratio <= cap else 0.0)
            got = float(w[b, i])
            # exp of a sum of <= 8 differences: relative error ~ (8 + 2) EPS * |log-ratio| + EPS
            if mode == "mis" and abs(ratio - cap) <= 64 * EPS * cap * (abs(lr) + 1):
                continue  # the rejection threshold itself is within rounding
            assert got == pytest.approx(want, rel=32 * EPS * (abs(lr) + 1), abs=0)
            assert 0.0 <= got <= cap


def test_importance_weights_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="'tis'.*'mis'"):
        importance_weights(x, x, x, mode="is")
    with pytest.raises(ValueError, match="'token'.*'sequence'"):
        importance_weights(x, x, x, level="batch")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(x, x, x, cap=0.5)
    with pytest.raises(ValueError, match=r"\(1, 2\).*\(1, 3\)"):
        importance_weights(x, torch.zeros(1, 3), x)


@st.composite
def loss_case(draw):
    mask, old, adv = draw(token_batch(n=2))
    B, T = mask.shape
    lr = torch.tensor(draw(st.lists(st.floats(-0.7, 0.7), min_size=B * T, max_size=B * T)), dtype=F64)
    lr = lr.view(B, T)
    eps_high = draw(st.sampled_from([None, 0.28]))
    return mask, old, adv, lr, eps_high


@given(loss_case(), st.sampled_from(AGGS))
def test_policy_loss_unit_weights_are_no_weights(case, agg):
    mask, old, adv, lr, eps_high = case
    a, b = (old + lr).requires_grad_(), (old + lr).requires_grad_()
    plain, stats = policy_loss(a, old, adv, mask, clip_eps_high=eps_high, aggregation=agg)
    ones = torch.where(mask, 1.0, math.nan).to(F64)  # garbage off the mask is ignored
    weighted, wstats = policy_loss(b, old, adv, mask, clip_eps_high=eps_high, aggregation=agg, weights=ones)
    assert torch.equal(plain, weighted)
    plain.backward()
    weighted.backward()
    assert torch.equal(a.grad, b.grad)
    assert all(torch.equal(stats[k], wstats[k]) for k in stats)


@given(
    loss_case(),
    st.sampled_from(AGGS),
    st.sampled_from(list(CORRECTION_MODES)),
    st.sampled_from(list(CORRECTION_LEVELS)),
    st.sampled_from([1.0, 2.0]),
)
def test_correction_is_identity_when_sampler_and_trainer_agree(case, agg, mode, level, cap):
    mask, old, adv, lr, eps_high = case
    w = importance_weights(old, old.clone(), mask, mode=mode, level=level, cap=cap)
    assert torch.all(w == 1)  # exp(0) = 1 <= cap, sums of zeros are 0
    a, b = (old + lr).requires_grad_(), (old + lr).requires_grad_()
    plain, _ = policy_loss(a, old, adv, mask, clip_eps_high=eps_high, aggregation=agg)
    corrected, _ = policy_loss(b, old, adv, mask, clip_eps_high=eps_high, aggregation=agg, weights=w)
    assert torch.equal(plain, corrected)
    plain.backward()
    corrected.backward()
    assert torch.equal(a.grad, b.grad)


@given(loss_case(), st.sampled_from(AGGS), st.data())
def test_policy_loss_weights_scale_each_token(case, agg, data):
    mask, old, adv, lr, eps_high = case
    B, T = mask.shape
    w = torch.tensor(data.draw(st.lists(st.floats(0.0, 2.0), min_size=B * T, max_size=B * T)), dtype=F64)
    w = w.view(B, T)
    a, b = (old + lr).requires_grad_(), (old + lr).requires_grad_()
    plain, _ = policy_loss(a, old, adv, mask, clip_eps_high=eps_high, aggregation=agg)
    w.requires_grad_()
    weighted, _ = policy_loss(b, old, adv, mask, clip_eps_high=eps_high, aggregation=agg, weights=w)
    plain.backward()
    weighted.backward()
    assert w.grad is None  # weights are constants
    # per-token gradients are multiplied by w (one extra rounding; absolute below float64's normals)
    torch.testing.assert_close(b.grad, w.detach() * a.grad, rtol=4 * EPS, atol=torch.finfo(F64).tiny)
    # the value is the aggregate of w times the per-token clipped loss
    hi = 0.2 if eps_high is None else eps_high
    ratio = lr.exp()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1 + hi))
    want = masked_aggregate(w.detach() * per_token, mask, agg)
    assert weighted.item() == pytest.approx(want.item(), abs=16 * B * T * EPS * 3 * 2.1 * 2)
    with pytest.raises(ValueError, match=rf"weights.*\({B}, {T + 1}\).*logp.*\({B}, {T}\)"):
        policy_loss(a, old, adv, mask, weights=torch.ones(B, T + 1))


# ---------------------------------------------------------------------------------------------
# KL-Cov / Clip-Cov
# ---------------------------------------------------------------------------------------------


def cov_reference(logp, adv, mask):
    """Loop reference: (logp - mean) * (A - mean) with means over valid tokens."""
    idx = mask.nonzero().tolist()
    out = torch.zeros_like(logp)
    if not idx:
        return out
    mlp = sum(float(logp[b, t]) for b, t in idx) / len(idx)
    ma = sum(float(adv[b, t]) for b, t in idx) / len(idx)
    for b, t in idx:
        out[b, t] = (float(logp[b, t]) - mlp) * (float(adv[b, t]) - ma)
    return out


@given(token_batch(n=2), st.sampled_from([math.inf, math.nan]))
def test_token_covariance_matches_loops(batch, fill):
    mask, logp, adv = batch
    logp = logp.clone().requires_grad_()
    cov = token_covariance(with_garbage(logp, mask, fill), with_garbage(adv, mask, fill), mask)
    assert not cov.requires_grad and torch.all(cov[~mask] == 0)
    n = max(int(mask.sum()), 1)
    # means of n values <= 3 (n roundings), two differences and a product of values <= 6
    ref = cov_reference(logp.detach(), adv, mask)
    torch.testing.assert_close(cov, ref, rtol=0, atol=8 * (n + 3) * EPS * 36)
    # the token values average to the population covariance
    if mask.any():
        x, y = logp.detach()[mask], adv[mask]
        pop = float(((x - x.mean()) * (y - y.mean())).mean())
        assert float(cov[mask].mean()) == pytest.approx(pop, abs=16 * (n + 3) * EPS * 36)


CASE_LP = [[0.0, -1.0, -2.0, -5.0]]
CASE_ADV = [[1.0, 0.5, -0.5, -1.0]]
CASE_LR = [[0.1, 0.0, 0.0, 0.2]]


def test_cov_policy_loss_hand_computed():
    # logp 0, -1, -2, -5: mean -2, deviations 2, 1, 0, -3 ; A 1, 0.5, -0.5, -1: mean 0
    # covariances 2, 0.5, 0, 3 ; log-ratios 0.1, 0, 0, 0.2 -> ratios e^0.1 = 1.1051709, 1, 1, e^0.2 = 1.2214028
    # surrogate -A * ratio: -1.1051709, -0.5, 0.5, 1.2214028 (sum 0.1162318)
    # kl-cov, select_ratio 0.25 -> k = 1 token, the top covariance t3: + |0.2|
    #   loss = (0.1162318 + 0.2) / 4 = 0.0790580 ; grad t3 = (e^0.2 * 1 + 1 * sign(0.2)) / 4 = 0.5553507
    # clip-cov, bounds [1.5, 2.5] -> only t0 (cov 2) qualifies: detached, value unchanged
    #   loss = 0.1162318 / 4 = 0.0290580 ; grads 0, -0.5/4, 0.5/4, e^0.2/4
    lp = torch.tensor(CASE_LP, dtype=F64)
    adv = torch.tensor(CASE_ADV, dtype=F64)
    lr = torch.tensor(CASE_LR, dtype=F64)
    m = torch.ones(1, 4)
    torch.testing.assert_close(token_covariance(lp, adv, m), torch.tensor([[2.0, 0.5, 0.0, 3.0]], dtype=F64))
    e1, e2 = math.exp(0.1), math.exp(0.2)
    surrogate = -e1 - 0.5 + 0.5 + e2

    logp = lp.clone().requires_grad_()
    loss, stats = cov_policy_loss(logp, lp - lr, adv, m, "kl-cov", select_ratio=0.25)
    assert loss.item() == pytest.approx((surrogate + 0.2) / 4, abs=8 * EPS)
    assert stats["cov_selected_frac"].item() == 0.25
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-e1 / 4, -0.125, 0.125, (e2 + 1) / 4]], dtype=F64))

    logp = lp.clone().requires_grad_()
    loss, stats = cov_policy_loss(logp, lp - lr, adv, m, "clip-cov", select_ratio=0.25, cov_bounds=(1.5, 2.5))
    assert loss.item() == pytest.approx(surrogate / 4, abs=8 * EPS)
    assert stats["cov_selected_frac"].item() == 0.25
    assert stats["ratio_max"].item() == pytest.approx(e2, abs=4 * EPS)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, 0.125, e2 / 4]], dtype=F64))


def agg_weight(mask, agg):
    """d(aggregate)/dx per token: the aggregation's token weight."""
    x = torch.zeros(mask.shape, dtype=F64, requires_grad=True)
    masked_aggregate(x, mask, agg).backward()
    return x.grad


def plain_grad(logp, old, adv, mask, agg):
    x = logp.detach().clone().requires_grad_()
    masked_aggregate(-adv * torch.exp(torch.where(mask, x - old, 0.0)), mask, agg).backward()
    return x.grad


@st.composite
def cov_case(draw):
    mask, logp, adv = draw(token_batch(n=2, values=st.floats(-3.0, 0.0)))
    B, T = mask.shape
    adv = torch.tensor(draw(st.lists(nonzero, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    # |log-ratio| >= 0.05 so the |.| term always has a gradient of size kl_coef * weight
    mag = draw(st.lists(st.floats(0.05, 0.5), min_size=B * T, max_size=B * T))
    sign = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=B * T, max_size=B * T))
    lr = (torch.tensor(mag, dtype=F64) * torch.tensor(sign, dtype=F64)).view(B, T)
    ratio = draw(st.one_of(st.floats(1e-6, 1.0), st.just(1e-9)))
    return mask, logp, adv, lr, ratio


@given(cov_case(), st.sampled_from(AGGS))
def test_kl_cov_selects_exactly_the_top_k_covariances(case, agg):
    mask, logp, adv, lr, ratio = case
    n = int(mask.sum())
    assume(n > 0)
    old = logp - lr
    x = logp.clone().requires_grad_()
    loss, stats = cov_policy_loss(x, old, adv, mask, "kl-cov", select_ratio=ratio, kl_coef=1.0, aggregation=agg)
    loss.backward()
    k = max(1, int(ratio * n))
    w = agg_weight(mask, agg)
    # the penalty adds kl_coef * sign(lr) * weight to the selected tokens' gradient, nothing elsewhere
    extra = x.grad - plain_grad(logp, old, adv, mask, agg)
    selected = mask & (extra.abs() > 0.5 * w)
    torch.testing.assert_close(extra[selected], (torch.sign(lr) * w)[selected], rtol=0, atol=64 * EPS)
    assert torch.all(extra[~selected].abs() <= 64 * EPS)
    assert int(selected.sum()) == k  # at least one even for a tiny select_ratio
    assert stats["cov_selected_frac"].item() == pytest.approx(k / n, abs=EPS)
    cov = cov_reference(logp, adv, mask)
    tol = 8 * (n + 3) * EPS * 9 * 6
    rest = cov[mask & ~selected]
    assert float(cov[selected].min()) >= (float(rest.max()) if rest.numel() else -math.inf) - tol
    # the value is the surrogate plus |log-ratio| on the selected tokens
    want = masked_aggregate(-adv * lr.exp() + torch.where(selected, lr.abs(), 0.0), mask, agg)
    assert loss.item() == pytest.approx(want.item(), abs=32 * (n + 8) * EPS * 5)


@given(token_batch(n=2), st.sampled_from(AGGS), st.sampled_from(["kl-cov", "clip-cov"]), st.floats(1e-4, 1.0))
def test_cov_losses_at_ratio_one_are_minus_mean_advantage(batch, agg, mode, ratio):
    mask, logp, adv = batch
    loss, stats = cov_policy_loss(
        logp, logp.clone(), adv, mask, mode, select_ratio=ratio, cov_bounds=(-10.0, 10.0), aggregation=agg
    )
    want = masked_aggregate(-adv, mask, agg)
    assert loss.item() == pytest.approx(want.item(), abs=8 * EPS * 3 * mask.numel())
    if mask.any():
        assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0
        assert stats["cov_selected_frac"].item() > 0  # at least one token selected


@given(cov_case(), st.sampled_from(AGGS), st.floats(-2.0, 2.0), st.floats(0.0, 4.0), st.integers(0, 2**31))
def test_clip_cov_detaches_selected_tokens_only(case, agg, low, width, seed):
    mask, logp, adv, lr, ratio = case
    n = int(mask.sum())
    assume(n > 0)
    cov = cov_reference(logp, adv, mask)
    tol = 8 * (n + 3) * EPS * 9 * 6
    in_window = mask & (cov >= low - tol) & (cov <= low + width + tol)
    near_edge = ((cov - low).abs() <= tol) | ((cov - low - width).abs() <= tol)
    assume(not torch.any(mask & near_edge))
    old = logp - lr
    x = logp.clone().requires_grad_()
    kw = dict(select_ratio=ratio, cov_bounds=(low, low + width), aggregation=agg)
    loss, stats = cov_policy_loss(x, old, adv, mask, "clip-cov", **kw, generator=torch.Generator().manual_seed(seed))
    loss.backward()
    g0 = plain_grad(logp, old, adv, mask, agg)
    selected = mask & (x.grad == 0)  # A != 0 and a positive token weight: only detaching gives 0
    assert torch.all(g0[mask] != 0)
    torch.testing.assert_close(x.grad[mask & ~selected], g0[mask & ~selected], rtol=8 * EPS, atol=0)
    assert torch.all(selected <= in_window)  # only tokens inside the covariance window
    assert int(selected.sum()) == min(max(1, int(ratio * n)), int(in_window.sum()))
    assert stats["cov_selected_frac"].item() == pytest.approx(int(selected.sum()) / n, abs=EPS)
    # the value is the plain surrogate's
    want = masked_aggregate(-adv * lr.exp(), mask, agg).item()
    assert loss.item() == pytest.approx(want, abs=32 * (n + 8) * EPS * 5)
    # the same generator state draws the same tokens
    y = logp.clone().requires_grad_()
    cov_policy_loss(y, old, adv, mask, "clip-cov", **kw, generator=torch.Generator().manual_seed(seed))[0].backward()
    assert torch.equal(x.grad, y.grad)


def test_clip_cov_draws_uniformly():
    # covariances 2, 0.5, 0, 3 (see the hand case): with bounds [0.4, 3.5] three tokens qualify
    # and k = 1 is drawn; over 600 draws each count is Binomial(600, 1/3): mean 200, sd 11.5
    lp = torch.tensor(CASE_LP, dtype=F64)
    adv = torch.tensor(CASE_ADV, dtype=F64)
    gen = torch.Generator().manual_seed(0)
    old = lp - torch.tensor(CASE_LR, dtype=F64)
    counts = torch.zeros(4)
    for _ in range(600):
        x = lp.clone().requires_grad_()
        loss, _ = cov_policy_loss(x, old, adv, torch.ones(1, 4), "clip-cov", 0.25, cov_bounds=(0.4, 3.5), generator=gen)
        loss.backward()
        counts += (x.grad[0] == 0).float()
    assert counts[2] == 0 and counts.sum() == 600
    assert torch.all((counts[[0, 1, 3]] - 200).abs() < 5 * 11.55)


def test_cov_policy_loss_errors_and_empty_mask():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="'kl-cov'.*'clip-cov'"):
        cov_policy_loss(x, x, x, x, mode="cov")
    with pytest.raises(ValueError, match="select_ratio"):
        cov_policy_loss(x, x, x, x, select_ratio=0.0)
    with pytest.raises(ValueError, match="cov_bounds"):
        cov_policy_loss(x, x, x, x, mode="clip-cov", cov_bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match="kl_coef"):
        cov_policy_loss(x, x, x, x, kl_coef=-1.0)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        cov_policy_loss(x, x, torch.zeros(2, 2), x)
    logp = torch.full((2, 3), math.nan, requires_grad=True)
    for mode in ("kl-cov", "clip-cov"):
        loss, stats = cov_policy_loss(logp, x, x, x, mode)
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())
        loss.backward()
        assert torch.all(logp.grad == 0)

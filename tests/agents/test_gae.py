"""Properties of `gae` and `whiten`, checked against slow, obviously-correct references."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tokengym.agents.functional import gae, value_loss, whiten

F64 = torch.float64
reals = st.floats(-5.0, 5.0, allow_nan=False, allow_infinity=False)
unit = st.floats(0.0, 1.0)
# Padding garbage: valid positions must not care what sits in the padding, not even inf/nan.
garbage = st.one_of(reals, st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30]))


@st.composite
def gae_batch(draw, max_b=4, max_t=10):
    """Random [B, T] rewards/values/mask (mask anywhere), bootstrap values, gamma and lambda."""
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    # rows biased towards the edge cases: random, empty, full
    row = st.one_of(
        st.lists(st.booleans(), min_size=T, max_size=T), st.just([False] * T), st.just([True] * T)
    )
    mask = draw(st.lists(row, min_size=B, max_size=B))
    r = draw(st.lists(st.lists(reals, min_size=T, max_size=T), min_size=B, max_size=B))
    v = draw(st.lists(st.lists(reals, min_size=T, max_size=T), min_size=B, max_size=B))
    last = draw(st.lists(reals, min_size=B, max_size=B))
    return (
        torch.tensor(r, dtype=F64),
        torch.tensor(v, dtype=F64),
        torch.tensor(mask),
        torch.tensor(last, dtype=F64),
        draw(unit),
        draw(unit),
    )


def compact(x, mask_row):
    """The values of a row at its valid positions, as a Python list."""
    return [float(a) for a, m in zip(x, mask_row) if m]


def lambda_return_reference(r, v, boot, gamma, lam):
    """G^lambda_t as the weighted average of n-step returns (Sutton & Barto eq. 12.3).

    G^(n)_t = sum_{i<n} gamma^i r_{t+i} + gamma^n V_{t+n}, with V_k = boot after the last token;
    G^lambda_t = (1-lam) sum_{n=1}^{N-1} lam^(n-1) G^(n)_t + lam^(N-1) G^(N)_t, N = k - t
    (the tail weight goes on the full, bootstrapped return).
    """
    k = len(r)
    vs = list(v) + [boot]

    def n_step(t, n):
        return sum(gamma**i * r[t + i] for i in range(n)) + gamma**n * vs[t + n]

    out = []
    for t in range(k):
        N = k - t
        g = sum((1 - lam) * lam ** (n - 1) * n_step(t, n) for n in range(1, N))
        out.append(g + lam ** (N - 1) * n_step(t, N))
    return out


def recursion_reference(r, v, boot, gamma, lam):
    """Plain backward GAE recursion on one compacted row."""
    adv = [0.0] * len(r)
    next_v, next_a = boot, 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * next_v - v[t]
        adv[t] = delta + gamma * lam * next_a
        next_v, next_a = v[t], adv[t]
    return adv


def assert_close_list(actual, expected, tol=1e-9):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= tol * (1 + abs(e)), (actual, expected)


# ---------------------------------------------------------------------------------------------
# hand-computed
# ---------------------------------------------------------------------------------------------


def test_gae_hand_computed_three_tokens():
    # r = [1, 0, 2], V = [0.5, 1.0, 1.5], gamma = 0.9, lam = 0.5, terminated (V_next = 0).
    # delta_2 = 2 + 0.9*0   - 1.5 = 0.5
    # delta_1 = 0 + 0.9*1.5 - 1.0 = 0.35
    # delta_0 = 1 + 0.9*1.0 - 0.5 = 1.4
    # A_2 = 0.5
    # A_1 = 0.35 + 0.45*0.5   = 0.575
    # A_0 = 1.4  + 0.45*0.575 = 1.65875
    # returns = V + A = [2.15875, 1.575, 2.0]
    r = torch.tensor([[1.0, 0.0, 2.0]], dtype=F64)
    v = torch.tensor([[0.5, 1.0, 1.5]], dtype=F64)
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[1.65875, 0.575, 0.5]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[2.15875, 1.575, 2.0]], dtype=F64))

    # Truncated instead, bootstrap V_next = 2 after the last token:
    # delta_2 = 2 + 0.9*2 - 1.5 = 2.3 ; A_2 = 2.3
    # A_1 = 0.35 + 0.45*2.3   = 1.385
    # A_0 = 1.4  + 0.45*1.385 = 2.02325
    adv, _ = gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.5, last_values=torch.tensor([2.0], dtype=F64))
    torch.testing.assert_close(adv, torch.tensor([[2.02325, 1.385, 2.3]], dtype=F64))

    # Same three tokens with padding left, in the middle and right (garbage values there).
    r_p = torch.tensor([[9.0, 1.0, 7.0, 0.0, 2.0, 5.0]], dtype=F64)
    v_p = torch.tensor([[3.0, 0.5, -4.0, 1.0, 1.5, 8.0]], dtype=F64)
    m_p = torch.tensor([[0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    adv, ret = gae(r_p, v_p, m_p, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0, 1.65875, 0, 0.575, 0.5, 0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0, 2.15875, 0, 1.575, 2.0, 0]], dtype=F64))


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------


@given(gae_batch())
def test_returns_equal_lambda_return_of_n_step_returns(batch):
    r, v, mask, last, gamma, lam = batch
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam, last_values=last)
    for b in range(r.shape[0]):
        expected = lambda_return_reference(
            compact(r[b], mask[b]), compact(v[b], mask[b]), float(last[b]), gamma, lam
        )
        assert_close_list(compact(ret[b], mask[b]), expected)
        assert_close_list(
            compact(adv[b], mask[b]),
            [g - x for g, x in zip(expected, compact(v[b], mask[b]))],
        )


@given(gae_batch())
def test_vectorised_equals_per_row_loop(batch):
    r, v, mask, last, gamma, lam = batch
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam, last_values=last)
    for b in range(r.shape[0]):
        rc, vc = compact(r[b], mask[b]), compact(v[b], mask[b])
        expected = recursion_reference(rc, vc, float(last[b]), gamma, lam)
        assert_close_list(compact(adv[b], mask[b]), expected)
        # batching is irrelevant: each row alone gives bit-identical results
        adv_b, ret_b = gae(r[b : b + 1], v[b : b + 1], mask[b : b + 1], gamma, lam, last[b : b + 1])
        assert torch.equal(adv_b[0], adv[b]) and torch.equal(ret_b[0], ret[b])


@given(gae_batch(), st.sampled_from([0.0, 1.0]))
def test_lambda_extremes_td_error_and_monte_carlo(batch, lam):
    r, v, mask, last, gamma, _ = batch
    adv, _ = gae(r, v, mask, gamma=gamma, lam=lam, last_values=last)
    for b in range(r.shape[0]):
        rc, vc = compact(r[b], mask[b]), compact(v[b], mask[b])
        k, boot = len(rc), float(last[b])
        vs = vc + [boot]
        if lam == 0.0:  # one-step TD error
            expected = [rc[j] + gamma * vs[j + 1] - vc[j] for j in range(k)]
        else:  # discounted Monte-Carlo return, bootstrapped by gamma^(k-j) * last_value
            expected = [
                sum(gamma**i * rc[j + i] for i in range(k - j)) + gamma ** (k - j) * boot - vc[j]
                for j in range(k)
            ]
        assert_close_list(compact(adv[b], mask[b]), expected)


@given(st.data())
def test_padding_invariance(data):
    """Inserting padding (left/middle/right, arbitrary values) changes no valid result."""
    B = data.draw(st.integers(1, 3))
    gamma, lam = data.draw(unit), data.draw(unit)
    rows = []
    for _ in range(B):
        k = data.draw(st.integers(0, 6))
        rows.append(
            (
                data.draw(st.lists(reals, min_size=k, max_size=k)),
                data.draw(st.lists(reals, min_size=k, max_size=k)),
                data.draw(reals),
            )
        )
    # Build a padded layout: each valid token preceded by 0..2 padding tokens, plus a tail.
    layouts = []
    for r_row, _, _ in rows:
        mask_row = []
        for _ in range(len(r_row)):
            mask_row += [False] * data.draw(st.integers(0, 2)) + [True]
        mask_row += [False] * data.draw(st.integers(0, 2))
        layouts.append(mask_row)
    T = max(1, max(len(m) for m in layouts))
    mask = torch.zeros(B, T, dtype=torch.bool)
    r = torch.tensor(data.draw(st.lists(garbage, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    v = torch.tensor(data.draw(st.lists(garbage, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    for b, (m_row, (r_row, v_row, _)) in enumerate(zip(layouts, rows)):
        idx = [i for i, m in enumerate(m_row) if m]
        mask[b, idx] = True
        r[b, idx] = torch.tensor(r_row, dtype=F64)
        v[b, idx] = torch.tensor(v_row, dtype=F64)
    last = torch.tensor([row[2] for row in rows], dtype=F64)

    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam, last_values=last)
    assert not adv.isnan().any() and not ret.isnan().any()
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    for b, (r_row, v_row, boot) in enumerate(rows):
        if not r_row:
            continue
        adv_c, ret_c = gae(
            torch.tensor([r_row], dtype=F64),
            torch.tensor([v_row], dtype=F64),
            torch.ones(1, len(r_row)),
            gamma=gamma,
            lam=lam,
            last_values=torch.tensor([boot], dtype=F64),
        )
        assert torch.equal(adv[b][mask[b]], adv_c[0]), (adv[b], adv_c)
        assert torch.equal(ret[b][mask[b]], ret_c[0])


@given(gae_batch())
def test_truncation_bootstrap_effect(batch):
    """A(last=L) - A(last=0) = gamma * L * (gamma*lam)^(k-1-j) at the j-th of k valid tokens.

    Derivation: only the last valid delta changes, by gamma*L; the recursion carries that change
    back through each earlier valid token multiplied by gamma*lam. Returns change the same way.
    """
    r, v, mask, last, gamma, lam = batch
    adv_t, ret_t = gae(r, v, mask, gamma=gamma, lam=lam, last_values=last)
    adv_0, ret_0 = gae(r, v, mask, gamma=gamma, lam=lam, last_values=None)
    for b in range(r.shape[0]):
        k = int(mask[b].sum())
        expected = [gamma * float(last[b]) * (gamma * lam) ** (k - 1 - j) for j in range(k)]
        diff = compact(adv_t[b] - adv_0[b], mask[b])
        assert_close_list(diff, expected)
        assert_close_list(compact(ret_t[b] - ret_0[b], mask[b]), expected)
    assert torch.all(adv_t[~mask] == 0)


def test_outputs_detached_and_dtype_device():
    r = torch.randn(2, 5, requires_grad=True)
    v = torch.randn(2, 5, requires_grad=True)
    adv, ret = gae(r, v, torch.ones(2, 5), gamma=0.99, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    assert adv.dtype == torch.float32 and ret.device == r.device
    adv16, _ = gae(r.detach().bfloat16(), v.detach().bfloat16(), torch.ones(2, 5))
    assert adv16.dtype == torch.bfloat16
    torch.testing.assert_close(adv16.float(), gae(r.detach(), v.detach(), torch.ones(2, 5))[0], atol=0.05, rtol=0.02)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 3\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), last_values=torch.zeros(3))
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.5)


def test_value_target_minimiser_is_mean_of_returns():
    """The critic's MSE target: gradient descent on value_loss drives a scalar V to mean(R_i)."""
    g = torch.Generator().manual_seed(0)
    samples = torch.randn(1, 32, generator=g, dtype=F64) * 3 + 1.5
    v = torch.zeros((), dtype=F64, requires_grad=True)
    opt = torch.optim.SGD([v], lr=0.5)
    mask = torch.ones(1, 32)
    for _ in range(100):
        opt.zero_grad()
        loss, _ = value_loss(v.expand(1, 32), samples, samples, mask)
        loss.backward()
        opt.step()
    assert abs(v.item() - samples.mean().item()) < 1e-8
    # and it is not e.g. the median of the samples
    assert abs(v.item() - samples.median().item()) > 1e-3


# ---------------------------------------------------------------------------------------------
# whiten
# ---------------------------------------------------------------------------------------------


def test_whiten_hand_computed():
    # valid x = [1, 3] -> mean 2, unbiased var = (1 + 1) / 1 = 2 -> (x - 2) / sqrt(2)
    x = torch.tensor([[1.0, 50.0], [3.0, -50.0]], dtype=F64)
    m = torch.tensor([[1, 0], [1, 0]])
    s = 1 / math.sqrt(2 + 1e-8)
    torch.testing.assert_close(whiten(x, m), torch.tensor([[-s, 0.0], [s, 0.0]], dtype=F64))
    torch.testing.assert_close(
        whiten(x, m, shift_mean=False), torch.tensor([[2 - s, 0.0], [2 + s, 0.0]], dtype=F64)
    )


@given(gae_batch())
def test_whiten_properties(batch):
    x, _, mask, _, _, _ = batch
    n = int(mask.sum())
    assume(n >= 2)
    xs = x[mask]
    assume(float(xs.std()) > 1e-2)
    out = whiten(x, mask)
    assert torch.all(out[~mask] == 0)
    assert abs(float(out[mask].mean())) < 1e-9
    var = float(xs.var())  # unbiased; whiten divides by sqrt(var + 1e-8)
    assert abs(float(out[mask].std()) - (var / (var + 1e-8)) ** 0.5) < 1e-9
    kept = whiten(x, mask, shift_mean=False)
    assert abs(float(kept[mask].mean()) - float(xs.mean())) < 1e-9
    torch.testing.assert_close(kept[mask] - xs.mean(), out[mask])


def test_whiten_degenerate_masks_never_nan():
    x = torch.tensor([[5.0, 7.0, 9.0]])
    one = whiten(x, torch.tensor([[0, 1, 0]]))
    assert torch.equal(one, torch.zeros(1, 3))  # single entry: centred, not scaled
    assert torch.equal(whiten(x, torch.tensor([[0, 1, 0]]), shift_mean=False), torch.tensor([[0.0, 7.0, 0.0]]))
    assert torch.equal(whiten(x, torch.zeros(1, 3)), torch.zeros(1, 3))
    same = whiten(torch.full((2, 3), 4.0), torch.ones(2, 3))
    assert torch.equal(same, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        whiten(x, torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------
# multi-turn episodes: environment tokens (mask 0) in the middle of a row
# ---------------------------------------------------------------------------------------------


@st.composite
def multi_turn_batch(draw, max_b=4, max_t=24):
    """Random [B, T] batch whose masks have zeros anywhere, in particular mid-row env turns.

    Returns ``(r, v, mask, last, gamma, lam)`` where ``r``/``v`` hold finite reals at valid
    positions and padding garbage (nan, +-inf, +-1e30 or reals) at masked ones.
    """
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))

    @st.composite
    def turns(draw):
        # alternating agent / environment runs, starting with either: [1,1,0,0,0,1,0,1,1,...]
        out, agent = [], draw(st.booleans())
        while len(out) < T:
            out += [agent] * draw(st.integers(1, 5))
            agent = not agent
        return out[:T]

    row = st.one_of(
        st.lists(st.booleans(), min_size=T, max_size=T),
        turns(),
        st.just([False] * T),
        st.just([True] * T),
    )
    mask_rows = draw(st.lists(row, min_size=B, max_size=B))
    mask = torch.tensor(mask_rows)
    grid = lambda s: torch.tensor(draw(st.lists(s, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    r = torch.where(mask, grid(reals), grid(garbage))
    v = torch.where(mask, grid(reals), grid(garbage))
    last = torch.tensor(draw(st.lists(reals, min_size=B, max_size=B)), dtype=F64)
    return r, v, mask, last, draw(unit), draw(unit)


def gae_rounding_bound(r, v, last):
    """Absolute float64 error bound for one valid entry of ``gae`` on a row of length ``T``.

    Each A_t comes out of at most T backward steps ``a = r + g*V' - V + g*l*a'``: 5 roundings per
    step, each of relative size <= eps, on quantities bounded by
    S = sum_t (|r_t| + 2|V_t|) + |last| (|A| <= sum |delta| <= S as g, l <= 1), so
    |error| <= 5 * T * eps * S. Two computations are compared, so the bound is doubled; another
    factor 2 of slack keeps it robust (still ~1e-11 here, against O(0.1) errors of a wrong
    recursion).
    """
    T = r.numel()
    S = float(r.abs().sum() + 2 * v.abs().sum() + last.abs()) if T else 0.0
    return 20 * max(T, 1) * torch.finfo(F64).eps * (S + 1.0)


@given(multi_turn_batch(), st.sampled_from([torch.bool, torch.float32, torch.int64]))
def test_masked_gae_equals_gae_of_row_with_env_tokens_removed(batch, mask_dtype):
    """GAE over a masked row == GAE over the same row with its masked (env) tokens cut out.

    The value of the last agent token before an environment turn bootstraps from the first
    agent token after it; env tokens are neither steps of the recursion nor read at all.
    """
    r, v, mask, last, gamma, lam = batch
    m = mask.to(mask_dtype)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam, last_values=last)

    # exactly 0 at masked positions (so also no nan/inf leaking out of the garbage there)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()

    for b in range(r.shape[0]):
        idx = mask[b].nonzero().flatten()
        k = idx.numel()
        if k == 0:
            continue
        rc, vc = r[b, idx].unsqueeze(0), v[b, idx].unsqueeze(0)  # compressed to the left
        adv_c, ret_c = gae(rc, vc, torch.ones(1, k), gamma=gamma, lam=lam, last_values=last[b : b + 1])
        tol = gae_rounding_bound(rc, vc, last[b])
        torch.testing.assert_close(adv[b, idx], adv_c[0], atol=tol, rtol=0)
        torch.testing.assert_close(ret[b, idx], ret_c[0], atol=tol, rtol=0)

    # Garbage (nan, inf, 1e30) at masked positions changes nothing: same result, bit for bit, as
    # with harmless finite values there.
    clean_r = torch.where(mask, r, torch.full_like(r, 0.25))
    clean_v = torch.where(mask, v, torch.full_like(v, -0.5))
    adv_0, ret_0 = gae(clean_r, clean_v, m, gamma=gamma, lam=lam, last_values=last)
    assert torch.equal(adv, adv_0) and torch.equal(ret, ret_0)


def test_gae_hand_computed_multi_turn_env_reply_mid_row():
    # One row: two agent tokens, a two-token environment (tool) reply, one final agent token.
    #   position  0    1    2  3  4
    #   mask      1    1    0  0  1
    #   r         0    0.5  9  9  1      (the 9s sit on env tokens: ignored)
    #   V         0.2  0.4  7  7  0.6    (the 7s too: V(next) of position 1 is V_4, not V_2)
    # gamma = 0.9, lam = 0.8 (gamma*lam = 0.72), terminated (V after position 4 is 0).
    # deltas, delta_t = r_t + gamma * V(next valid) - V_t:
    #   delta_4 = 1   + 0.9*0   - 0.6 = 0.4
    #   delta_1 = 0.5 + 0.9*0.6 - 0.4 = 0.64
    #   delta_0 = 0   + 0.9*0.4 - 0.2 = 0.16
    # backward recursion, A_t = delta_t + 0.72 * A(next valid):
    #   A_4 = 0.4
    #   A_1 = 0.64 + 0.72*0.4   = 0.928
    #   A_0 = 0.16 + 0.72*0.928 = 0.82816
    # returns = V + A = [1.02816, 1.328, 0, 0, 1.0]; env positions: A = R = 0.
    # (Stepping to t+1 instead would give delta_1 = 0.5 + 0.9*7 - 0.4 = 6.4.)
    r = torch.tensor([[0.0, 0.5, 9.0, 9.0, 1.0]], dtype=F64)
    v = torch.tensor([[0.2, 0.4, 7.0, 7.0, 0.6]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8, last_values=torch.zeros(1, dtype=F64))
    torch.testing.assert_close(adv, torch.tensor([[0.82816, 0.928, 0, 0, 0.4]], dtype=F64), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.02816, 1.328, 0, 0, 1.0]], dtype=F64), atol=1e-6, rtol=0)
    # the default (last_values=None) is the same terminated case
    adv_n, _ = gae(r, v, mask, gamma=0.9, lam=0.8)
    assert torch.equal(adv_n, adv)

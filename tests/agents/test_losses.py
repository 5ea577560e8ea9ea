"""Properties of `kl_penalty`, `masked_aggregate`, `policy_loss` and `value_loss`."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tokengym.agents import functional as F
from tokengym.agents.functional import (
    AGGREGATIONS,
    kl_penalty,
    masked_aggregate,
    policy_loss,
    value_loss,
)

F64 = torch.float64
reals = st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False)
AGGS = list(AGGREGATIONS)


def mask_row(T):
    """A row mask, biased towards the edge cases: empty and full rows."""
    return st.one_of(
        st.lists(st.booleans(), min_size=T, max_size=T),
        st.just([False] * T),
        st.just([True] * T),
    )


@st.composite
def token_batch(draw, max_b=4, max_t=8, values=reals, n=1):
    """[B, T] mask plus ``n`` [B, T] float64 tensors."""
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    mask = torch.tensor([draw(mask_row(T)) for _ in range(B)], dtype=torch.bool).view(B, T)
    xs = [
        torch.tensor(draw(st.lists(values, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
        for _ in range(n)
    ]
    return (mask, *xs)


def aggregate_reference(x, mask, aggregation):
    """Independent, loop-based implementation of the three aggregation modes."""
    rows = [[float(a) for a, m in zip(xr, mr) if m] for xr, mr in zip(x.detach(), mask)]
    if aggregation == "token-mean":
        flat = [a for row in rows for a in row]
        return sum(flat) / len(flat) if flat else 0.0
    if aggregation == "seq-mean-token-mean":
        means = [sum(row) / len(row) for row in rows if row]
        return sum(means) / len(means) if means else 0.0
    assert aggregation == "seq-mean-token-sum"
    return sum(sum(row) for row in rows) / len(rows)


# ---------------------------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------------------------


def test_kl_hand_computed():
    # d = log(0.5/0.25) = log 2:  k1 = 0.693147, k2 = 0.5 * 0.480453 = 0.240227,
    #                             k3 = exp(-log 2) - 1 + log 2 = 0.5 - 1 + 0.693147 = 0.193147
    # d = -log 2:                 k3 = 2 - 1 - 0.693147 = 0.306853
    logp = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64))
    ref = torch.log(torch.tensor([[0.25, 0.5]], dtype=F64))
    ln2 = math.log(2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[ln2, -ln2]], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[ln2**2 / 2] * 2], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[ln2 - 0.5, 1 - ln2]], dtype=F64))


@given(token_batch(values=st.floats(-50, 0)), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_zero_when_equal(batch, est):
    _, logp = batch
    assert torch.equal(kl_penalty(logp, logp.clone(), est), torch.zeros_like(logp))


@given(
    token_batch(values=st.floats(-1000, 1000, allow_nan=False), n=2),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_k2_k3_nonnegative_and_finite(batch, dtype):
    _, logp, ref = batch
    logp, ref = logp.to(dtype), ref.to(dtype)
    for est in ["k2", "k3"]:
        kl = kl_penalty(logp, ref, est)
        assert kl.dtype == dtype
        if est == "k3" or dtype != torch.float16:  # k2 of |d|~1000 overflows float16 by design
            assert torch.isfinite(kl).all(), (est, kl)
        assert (kl >= 0).all()


def test_k3_extreme_log_ratios_finite_with_finite_gradients():
    logp = torch.tensor([[1000.0, -1000.0, 0.0, 30.0, -30.0]], requires_grad=True)
    ref = torch.zeros(1, 5)
    kl = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d = +1000: exp(-d) underflows to 0 -> k3 = d - 1, gradient 1 - exp(-d) = 1
    assert kl[0, 0].item() == pytest.approx(999.0) and logp.grad[0, 0].item() == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_k3_unbiased_monte_carlo(seed):
    """Averages of k1 and k3 over tokens sampled from pi converge to the exact KL(pi || ref)."""
    g = torch.Generator().manual_seed(seed)
    K, N = 6, 200_000
    log_pi = torch.log_softmax(torch.randn(K, generator=g, dtype=F64), -1)
    log_ref = torch.log_softmax(torch.randn(K, generator=g, dtype=F64), -1)
    exact = float((log_pi.exp() * (log_pi - log_ref)).sum())
    x = torch.multinomial(log_pi.exp(), N, replacement=True, generator=g)
    logp, ref = log_pi[x].view(1, N), log_ref[x].view(1, N)
    for est in ["k1", "k3"]:
        samples = kl_penalty(logp, ref, est)
        stderr = float(samples.std()) / math.sqrt(N)
        assert abs(float(samples.mean()) - exact) < 5 * stderr + 1e-12, (est, exact)
    # k2 is biased: for these fairly different distributions its mean is far from the KL
    k2 = kl_penalty(logp, ref, "k2")
    assert abs(float(k2.mean()) - exact) > 5 * float(k2.std()) / math.sqrt(N)


def test_kl_differentiable_and_errors():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty(a, b, "k3"), (logp, ref))
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty(a, b, "k2"), (logp, ref))
    with pytest.raises(ValueError, match="'k1'.*'k2'.*'k3'"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match=r"\(1, 2\).*\(2, 2\)"):
        kl_penalty(logp, torch.zeros(2, 2), "k1")


# ---------------------------------------------------------------------------------------------
# masked_aggregate
# ---------------------------------------------------------------------------------------------


def test_aggregate_hand_computed():
    # row 0: 3 valid tokens of 1 ; row 1: a single valid 4 ; row 2: no valid token
    # token-mean          = (1+1+1+4) / 4       = 1.75
    # seq-mean-token-mean = (1 + 4) / 2         = 2.5   (the empty row does not count)
    # seq-mean-token-sum  = (3 + 4 + 0) / 3     = 2.3333 (mean over all B rows)
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 100.0, math.nan], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_aggregate(x, m, "token-mean").item() == pytest.approx(1.75)
    assert masked_aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx(2.5)
    assert masked_aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx(7 / 3)
    for agg in AGGS:  # an empty mask gives 0, never NaN
        assert masked_aggregate(x, torch.zeros(3, 3), agg).item() == 0.0
    with pytest.raises(ValueError, match="'token-mean'.*'seq-mean-token-mean'.*'seq-mean-token-sum'"):
        masked_aggregate(x, m, "sum")


@given(token_batch(), st.sampled_from(AGGS))
def test_aggregate_matches_reference(batch, agg):
    mask, x = batch
    assert masked_aggregate(x, mask, agg).item() == pytest.approx(aggregate_reference(x, mask, agg), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# policy_loss
# ---------------------------------------------------------------------------------------------


def test_policy_loss_hand_computed_asymmetric():
    # clip_eps = 0.1 (ratio >= 0.9), clip_eps_high = 0.3 (ratio <= 1.3)
    # tok 0: A=+1, ratio 1.2  -> inside the high bound: loss -1.2
    # tok 1: A=+1, ratio 1.5  -> clipped to 1.3:       loss -1.3  (clipfrac_high)
    # tok 2: A=-1, ratio 0.8  -> clipped to 0.9:       loss max(0.8, 0.9) = 0.9 (clipfrac_low)
    # tok 3: A=-1, ratio 1.5  -> unclipped (pessimistic): loss max(1.5, 1.3) = 1.5
    # token-mean = (-1.2 - 1.3 + 0.9 + 1.5) / 4 = -0.025
    ratio = torch.tensor([[1.2, 1.5, 0.8, 1.5]], dtype=F64)
    old = torch.full((1, 4), -1.0, dtype=F64)
    logp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.1, clip_eps_high=0.3)
    assert loss.item() == pytest.approx(-0.025)
    assert stats["clipfrac_high"].item() == pytest.approx(0.25)
    assert stats["clipfrac_low"].item() == pytest.approx(0.25)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["ratio_mean"].item() == pytest.approx(1.25)
    loss.backward()
    # d/dlogp (-A * ratio) = -A * ratio ; / 4 tokens ; clipped tokens get 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 / 4, 0.0, 0.0, 1.5 / 4]], dtype=F64))


@given(token_batch(n=2), st.sampled_from(AGGS), st.booleans())
def test_ratio_one_loss_is_minus_mean_advantage(batch, agg, per_sequence):
    mask, logp, adv = batch
    if per_sequence:
        adv = adv[:, 0]
        adv_tok = adv[:, None].expand_as(logp)
    else:
        adv_tok = adv
    loss, stats = policy_loss(logp, logp.clone(), adv, mask, aggregation=agg)
    assert loss.item() == pytest.approx(-aggregate_reference(adv_tok, mask, agg), abs=1e-12)
    assert stats["clipfrac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    if mask.any():
        assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0


@st.composite
def clip_case(draw):
    mask, old, adv = draw(token_batch(n=2))
    B, T = mask.shape
    log_ratio = torch.tensor(draw(st.lists(st.floats(-0.7, 0.7), min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    eps_low = draw(st.sampled_from([0.1, 0.2, 0.28]))
    eps_high = draw(st.sampled_from([None, 0.1, 0.28, 0.4]))
    return mask, old, adv, log_ratio, eps_low, eps_high


@given(clip_case(), st.sampled_from(AGGS))
def test_clipped_tokens_have_exactly_zero_gradient(case, agg):
    mask, old, adv, log_ratio, eps_low, eps_high = case
    hi = eps_low if eps_high is None else eps_high
    ratio = log_ratio.exp()
    # keep away from the exact clip boundaries, where max() ties
    assume(torch.all(((ratio - (1 - eps_low)).abs() > 1e-6) & ((ratio - (1 + hi)).abs() > 1e-6)))
    logp = (old + log_ratio).requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=eps_low, clip_eps_high=eps_high, aggregation=agg)
    loss.backward()
    grad = logp.grad
    blocked_high = (adv > 0) & (ratio > 1 + hi)
    blocked_low = (adv < 0) & (ratio < 1 - eps_low)
    blocked = blocked_high | blocked_low
    assert torch.all(grad[blocked | ~mask] == 0)
    free = mask & ~blocked & (adv.abs() > 1e-100)  # a denormal advantage times the token weight underflows to 0
    assert torch.all(grad[free] != 0)
    # the unblocked gradient is exactly d(-A * ratio)/dlogp = -A * ratio times the token weight
    weight = torch.zeros_like(ratio)
    n_row = mask.sum(-1, keepdim=True).to(F64)
    if agg == "token-mean":
        weight[mask] = 1.0 / mask.sum()
    elif agg == "seq-mean-token-mean":
        rows = (mask.sum(-1) > 0).sum()
        weight = torch.where(mask, 1.0 / (n_row.clamp(min=1) * rows), 0.0)
    else:
        weight = torch.where(mask, 1.0 / mask.shape[0], 0.0)
    torch.testing.assert_close(grad[free], (-adv * ratio * weight)[free])
    # clip fractions are direct counts over valid tokens
    n = max(int(mask.sum()), 1)
    assert stats["clipfrac_high"].item() == pytest.approx(int((blocked_high & mask).sum()) / n)
    assert stats["clipfrac_low"].item() == pytest.approx(int((blocked_low & mask).sum()) / n)
    assert stats["clipfrac"].item() == pytest.approx(int((blocked & mask).sum()) / n)
    # approx_kl: masked mean of k3 of KL(old || new) = ratio - 1 - log ratio
    expected_kl = aggregate_reference(ratio - 1 - log_ratio, mask, "token-mean")
    assert stats["approx_kl"].item() == pytest.approx(expected_kl, abs=1e-12)
    if mask.any():
        assert stats["ratio_max"].item() == pytest.approx(float(ratio[mask].max()))
        assert stats["ratio_mean"].item() == pytest.approx(float(ratio[mask].mean()))


@given(st.data())
def test_aggregations_agree_for_equal_lengths(data):
    B = data.draw(st.integers(1, 4))
    T = data.draw(st.integers(1, 8))
    L = data.draw(st.integers(1, T))
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):  # exactly L valid tokens per row, at random positions
        mask[b, torch.tensor(data.draw(st.permutations(range(T)))[:L])] = True
    vals = data.draw(st.lists(reals, min_size=3 * B * T, max_size=3 * B * T))
    logp, old, adv = torch.tensor(vals, dtype=F64).view(3, B, T)
    losses = {agg: policy_loss(logp, old, adv, mask, aggregation=agg)[0].item() for agg in AGGS}
    assert losses["seq-mean-token-mean"] == pytest.approx(losses["token-mean"], abs=1e-12)
    assert losses["seq-mean-token-sum"] == pytest.approx(L * losses["token-mean"], abs=1e-10)


def test_policy_loss_padding_garbage_is_harmless():
    logp = torch.tensor([[-1.0, 0.0, math.inf]], requires_grad=True)
    old = torch.tensor([[-1.2, -math.inf, -math.inf]])
    mask = torch.tensor([[1, 0, 0]])
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1:].eq(0).all()
    assert all(torch.isfinite(v) for v in stats.values())


def test_policy_loss_stats_are_detached_scalars_and_errors():
    logp = torch.randn(2, 3, requires_grad=True)
    loss, stats = policy_loss(logp, torch.randn(2, 3), torch.randn(2), torch.ones(2, 3))
    assert set(stats) == {"clipfrac_low", "clipfrac_high", "clipfrac", "approx_kl", "ratio_mean", "ratio_max"}
    for v in stats.values():
        assert v.dim() == 0 and not v.requires_grad
    assert loss.dim() == 0 and loss.requires_grad
    empty_loss, empty_stats = policy_loss(logp, logp.detach(), torch.randn(2), torch.zeros(2, 3))
    assert empty_loss.item() == 0.0 and all(v.item() == 0.0 for v in empty_stats.values())
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3\)"):
        policy_loss(logp, logp.detach(), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        policy_loss(logp, logp.detach(), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        policy_loss(logp, torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logp, logp.detach(), torch.zeros(2), torch.ones(2, 3), aggregation="mean")


# ---------------------------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    # v = [1, 2], old = [1.5, 2], R = [2, 2], clip_eps = 0.2
    # unclipped: 0.5 * ((1-2)^2 + 0) / 2 = 0.25
    # tok 0: v_clip = 1.5 + clamp(-0.5, -0.2, 0.2) = 1.3 ; (1.3-2)^2 = 0.49 < 1 -> keeps 1
    # tok 1: exact -> 0 ; clipped loss = 0.25 too, vf_clipfrac = 0
    # with old = [0.5, 2]: v_clip = 0.5 + 0.2 = 0.7 ; (0.7-2)^2 = 1.69 > 1 -> clipped term active
    #   clipped loss = 0.5 * (1.69 + 0) / 2 = 0.4225, vf_clipfrac = 0.5
    v = torch.tensor([[1.0, 2.0]], dtype=F64, requires_grad=True)
    R = torch.tensor([[2.0, 2.0]], dtype=F64)
    m = torch.ones(1, 2)
    loss, stats = value_loss(v, torch.tensor([[1.5, 2.0]], dtype=F64), R, m, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.25) and stats["vf_clipfrac"].item() == 0.0
    loss, stats = value_loss(v, torch.tensor([[0.5, 2.0]], dtype=F64), R, m, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.4225) and stats["vf_clipfrac"].item() == 0.5
    assert stats["value_mean"].item() == pytest.approx(1.5)
    loss.backward()
    assert v.grad[0, 0].item() == 0.0  # clipped branch active: no gradient to v


@given(token_batch(n=4), st.floats(0.05, 1.0))
def test_value_loss_properties(batch, clip_eps):
    mask, v, old, R, _ = batch
    v = v.clone().requires_grad_()
    plain, _ = value_loss(v, old, R, mask)
    assert plain.item() == pytest.approx(0.5 * aggregate_reference((v - R) ** 2, mask, "token-mean"), abs=1e-12)
    clipped, stats = value_loss(v, old, R, mask, clip_eps=clip_eps)
    assert clipped.item() >= plain.item() - 1e-12
    clipped.backward()
    v_clip = old + (v.detach() - old).clamp(-clip_eps, clip_eps)
    active = mask & ((v_clip - R) ** 2 > (v.detach() - R) ** 2 + 1e-9)
    inactive = mask & ((v_clip - R) ** 2 < (v.detach() - R) ** 2 - 1e-9)
    assert torch.all(v.grad[active | ~mask] == 0)
    n = max(int(mask.sum()), 1)
    torch.testing.assert_close(v.grad[inactive], ((v.detach() - R) / n)[inactive])
    maybe = mask & ((v_clip - R) ** 2 >= (v.detach() - R) ** 2 - 1e-9) & ((v.detach() - old).abs() > clip_eps)
    assert int(active.sum()) / n - 1e-12 <= stats["vf_clipfrac"].item() <= int(maybe.sum()) / n + 1e-12


@given(token_batch(n=2))
def test_explained_variance(batch):
    mask, v, R = batch
    _, stats = value_loss(v, v, R, mask)
    ev = stats["explained_variance"].item()
    assert math.isfinite(ev)
    if int(mask.sum()) >= 2 and float(R[mask].var()) > 1e-6:
        assert ev == pytest.approx(1 - float((R - v)[mask].var()) / float(R[mask].var()), rel=1e-9)
        assert value_loss(R, R, R, mask)[1]["explained_variance"].item() == 1.0


def test_value_loss_degenerate_and_errors():
    v = torch.tensor([[1.0, 2.0, 3.0]])
    _, stats = value_loss(v, v, torch.full((1, 3), 5.0), torch.ones(1, 3))  # Var(R) = 0
    assert stats["explained_variance"].item() == 0.0
    loss, stats = value_loss(v, v, v, torch.zeros(1, 3))
    assert loss.item() == 0.0 and all(math.isfinite(x.item()) for x in stats.values())
    assert all(x.dim() == 0 and not x.requires_grad for x in stats.values())
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        value_loss(v, v, torch.zeros(1, 2), torch.ones(1, 3))
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(v, v, v, torch.ones(1, 3), clip_eps=0.0)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_loss_sends_no_gradient_to_old_logp_advantages_or_weights(aggregation):
    """pi_old, the advantages and the correction weights are constants of the surrogate: if any were left attached,
    backward would push the behaviour policy (or the critic, through the advantages) as if it were being trained."""
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=g, dtype=F64) - 1).requires_grad_()
    old = (logp.detach() + 0.1 * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(3, 4, generator=g, dtype=F64).requires_grad_()
    w = torch.rand(3, 4, generator=g, dtype=F64).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    loss, _ = F.policy_loss(logp, old, adv, mask, aggregation=aggregation, weights=w)
    loss.backward()
    assert logp.grad is not None and bool(logp.grad.abs().sum() > 0)
    assert old.grad is None and adv.grad is None and w.grad is None


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_loss_sends_no_gradient_to_the_reference(loss_type):
    """The reference model is frozen: its log-probs must not receive a gradient through the loss."""
    pc, pr = (torch.tensor([-3.0, -5.0], dtype=F64, requires_grad=True) for _ in range(2))
    rc, rr = (torch.tensor([-4.0, -4.5], dtype=F64, requires_grad=True) for _ in range(2))
    losses, chosen, rejected = F.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=loss_type,
                                          label_smoothing=0.1 if loss_type in ("sigmoid", "robust") else 0.0)
    losses.sum().backward()
    assert pc.grad is not None and pr.grad is not None
    assert rc.grad is None and rr.grad is None
    assert not chosen.requires_grad and not rejected.requires_grad

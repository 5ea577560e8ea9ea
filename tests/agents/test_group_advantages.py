"""Properties of the GRPO advantages: `group_advantages` (outcome) and `process_advantages`."""

import math
import statistics
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tokengym.agents.functional import group_advantages, process_advantages

F64 = torch.float64
# Rewards on a 1/8 grid: exactly representable, so differences never vanish numerically.
grid_reward = st.integers(-40, 40).map(lambda k: k / 8)
any_reward = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
SCALES = ["group", "batch", "none"]


@st.composite
def grouped_rewards(draw, max_groups=4, max_group_size=6, elements=grid_reward):
    n_groups = draw(st.integers(1, max_groups))
    group_size = draw(st.integers(1, max_group_size))
    r = draw(st.lists(elements, min_size=n_groups * group_size, max_size=n_groups * group_size))
    return torch.tensor(r, dtype=F64), group_size


def groups(x, group_size):
    return x.view(-1, group_size)


# ---------------------------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------------------------


def test_group_hand_computed():
    # group 1: [1, 0] -> mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.70711
    #          -> (1 - 0.5) / 0.70711 = 0.70711 and -0.70711
    # group 2: [3, 3] -> identical -> exactly 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5**0.5, -(0.5**0.5), 0.0, 0.0]))
    # "batch": batch mean 1.75, batch sample std = sqrt((0.5625+3.0625+1.5625*2)/3) = 1.5
    #          group 1 -> (1 - 0.5) / 1.5 = 1/3 ; "none": [0.5, -0.5, 0, 0]
    torch.testing.assert_close(
        group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale="batch", eps=0.0),
        torch.tensor([1 / 3, -1 / 3, 0.0, 0.0]),
    )
    torch.testing.assert_close(
        group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale="none"),
        torch.tensor([0.5, -0.5, 0.0, 0.0]),
    )


@given(grouped_rewards(), st.sampled_from(SCALES), st.sampled_from([0.0, 1e-4]))
def test_zero_mean_per_group(data, scale, eps):
    r, gs = data
    adv = group_advantages(r, gs, scale=scale, eps=eps)
    assert adv.shape == r.shape and adv.dtype == F64
    assert not adv.isnan().any()
    assert torch.all(groups(adv, gs).mean(-1).abs() < 1e-9)


@given(grouped_rewards())
def test_unit_sample_std_per_group(data):
    r, gs = data
    assume(gs >= 2)
    adv = groups(group_advantages(r, gs, scale="group", eps=0.0), gs)
    for g_r, g_a in zip(groups(r, gs), adv):
        if torch.all(g_r == g_r[0]):
            assert torch.all(g_a == 0)
        else:
            # torch.std is Bessel-corrected: unit *sample* std (population std would be off by
            # sqrt((n-1)/n))
            assert abs(float(g_a.std()) - 1.0) < 1e-9


@given(grouped_rewards())
def test_unit_std_up_to_eps(data):
    r, gs = data
    assume(gs >= 2)
    eps = 1e-4
    adv = groups(group_advantages(r, gs, scale="group", eps=eps), gs)
    for g_r, g_a in zip(groups(r, gs), adv):
        s = float(g_r.std())
        if s > 0:
            assert abs(float(g_a.std()) - s / (s + eps)) < 1e-9


@given(
    grouped_rewards(),
    st.sampled_from([0.125, 0.5, 3.0, 64.0]),
    grid_reward,
)
def test_affine_invariance(data, a, c):
    r, gs = data
    adv = group_advantages(r, gs, scale="group", eps=0.0)
    adv2 = group_advantages(a * r + c, gs, scale="group", eps=0.0)
    torch.testing.assert_close(adv2, adv, atol=1e-9, rtol=1e-9)


@given(grouped_rewards(), st.sampled_from(SCALES))
def test_order_and_sign_preserving(data, scale):
    r, gs = data
    adv = group_advantages(r, gs, scale=scale)
    for g_r, g_a in zip(groups(r, gs).tolist(), groups(adv, gs).tolist()):
        mean = sum(map(Fraction, g_r)) / len(g_r)
        for i in range(gs):
            if g_r[i] != mean:
                assert (g_a[i] > 0) == (Fraction(g_r[i]) > mean)
            for j in range(gs):
                if g_r[i] > g_r[j]:
                    assert g_a[i] > g_a[j]
                elif g_r[i] == g_r[j]:
                    assert g_a[i] == g_a[j]


@given(
    st.integers(1, 4),
    st.integers(1, 6),
    any_reward,
    st.sampled_from(SCALES),
    st.sampled_from([0.0, 1e-4]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_identical_rewards_give_exact_zero(n_groups, gs, value, scale, eps, dtype):
    r = torch.full((n_groups * gs,), value, dtype=dtype)
    adv = group_advantages(r, gs, scale=scale, eps=eps)
    assert torch.equal(adv, torch.zeros_like(r))


@given(grouped_rewards(elements=st.floats(-3, 3)), st.sampled_from([0.0, 1e-4]))
def test_identical_groups_exact_zero_within_mixed_batch(data, eps):
    r, gs = data
    r = r.clone()
    groups(r, gs)[0] = 0.1  # an identical group next to arbitrary ones
    for scale in SCALES:
        adv = group_advantages(r, gs, scale=scale, eps=eps)
        assert torch.equal(groups(adv, gs)[0], torch.zeros(gs, dtype=F64))
        assert not adv.isnan().any()


@given(grouped_rewards(), st.sampled_from([0.0, 1e-4, 0.5]))
def test_batch_and_none_match_formulas(data, eps):
    r, gs = data
    g = groups(r, gs)
    centred = (g - g.mean(-1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(group_advantages(r, gs, scale="none"), centred, atol=1e-12, rtol=0)
    batch_std = float(r.std()) if r.numel() > 1 else 0.0
    if batch_std + eps > 0:
        expected = centred / (batch_std + eps)
    else:
        expected = torch.zeros_like(r)
    torch.testing.assert_close(group_advantages(r, gs, scale="batch", eps=eps), expected, atol=1e-9, rtol=1e-9)
    if gs >= 2:
        std = g.std(-1, keepdim=True)
        den = std + eps
        exp_g = torch.where(den > 0, (g - g.mean(-1, keepdim=True)) / den.clamp(min=1e-300), 0.0)
        torch.testing.assert_close(group_advantages(r, gs, scale="group", eps=eps), exp_g.reshape(-1), atol=1e-9, rtol=1e-9)


def test_group_size_one_is_zero_not_nan():
    r = torch.tensor([1.0, -2.0, 5.0])
    for scale in SCALES:
        adv = group_advantages(r, 1, scale=scale, eps=0.0)
        assert torch.equal(adv, torch.zeros(3)), scale


def test_group_errors():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="'group'.*'batch'.*'none'"):
        group_advantages(torch.zeros(4), 2, scale="softmax")
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        group_advantages(torch.zeros(2, 2), 2)


# ---------------------------------------------------------------------------------------------
# process_advantages
# ---------------------------------------------------------------------------------------------


@st.composite
def process_batch(draw, max_groups=3, max_group_size=4, max_steps=4, max_len=8):
    n_groups = draw(st.integers(1, max_groups))
    gs = draw(st.integers(1, max_group_size))
    B = n_groups * gs
    S = draw(st.integers(1, max_steps))
    T = draw(st.integers(1, max_len))
    ends = draw(
        st.lists(st.lists(st.integers(-1, T - 1), min_size=S, max_size=S), min_size=B, max_size=B)
    )
    r = draw(st.lists(st.lists(grid_reward, min_size=S, max_size=S), min_size=B, max_size=B))
    return torch.tensor(r, dtype=F64), torch.tensor(ends), gs, T


def normalised_step_rewards_reference(r, ends, gs, eps):
    """{(b, j): normalised reward} of valid steps, using statistics.mean / statistics.stdev."""
    out = {}
    B, S = r.shape
    for g0 in range(0, B, gs):
        keys = [(b, j) for b in range(g0, g0 + gs) for j in range(S) if ends[b, j] >= 0]
        vals = [float(r[b, j]) for b, j in keys]
        mean = statistics.mean(vals) if vals else 0.0
        std = statistics.stdev(vals) if len(vals) >= 2 else 0.0
        for key, x in zip(keys, vals):
            out[key] = (x - mean) / (std + eps) if std + eps > 0 else 0.0
    return out


def process_reference(r, ends, gs, T, eps):
    normed = normalised_step_rewards_reference(r, ends, gs, eps)
    adv = [[0.0] * T for _ in range(r.shape[0])]
    for (b, j), x in normed.items():
        for t in range(T):
            if int(ends[b, j]) >= t:
                adv[b][t] += x
    return torch.tensor(adv, dtype=F64), normed


def test_process_hand_computed():
    # One group of 2 responses; response 0 has steps ending at tokens 0 and 2, response 1 a
    # single step ending at token 1 (second slot is padding, its reward 9 is ignored).
    # valid rewards 2, 0, 1 -> mean 1, sample std sqrt((1 + 1 + 0) / 2) = 1 -> normalised 1, -1, 0
    # response 0: A_0 = 1 + (-1) = 0, A_1 = A_2 = -1 (only the step ending at 2), A_3 = 0
    # response 1: A_0 = A_1 = 0, A_2 = A_3 = 0
    r = torch.tensor([[2.0, 0.0], [1.0, 9.0]])
    ends = torch.tensor([[0, 2], [1, -1]])
    adv = process_advantages(r, ends, group_size=2, seq_len=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


@given(process_batch(), st.sampled_from([0.0, 1e-4]))
def test_process_matches_slow_reference(batch, eps):
    r, ends, gs, T = batch
    adv = process_advantages(r, ends, gs, T, eps=eps)
    expected, _ = process_reference(r, ends, gs, T, eps)
    assert adv.shape == (r.shape[0], T) and not adv.isnan().any()
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=1e-9)


@given(process_batch())
def test_process_differences_are_step_rewards_ending_at_t(batch):
    """A_t - A_{t+1} is the normalised reward of the steps ending exactly at t (A_T := 0):
    earlier tokens accumulate the rewards of all later step ends."""
    r, ends, gs, T = batch
    adv = process_advantages(r, ends, gs, T, eps=1e-4)
    normed = normalised_step_rewards_reference(r, ends, gs, 1e-4)
    padded = torch.cat([adv, torch.zeros(adv.shape[0], 1, dtype=F64)], dim=1)
    for b in range(r.shape[0]):
        for t in range(T):
            at_t = sum(x for (bb, j), x in normed.items() if bb == b and int(ends[b, j]) == t)
            assert abs(float(padded[b, t] - padded[b, t + 1]) - at_t) < 1e-9
        last_end = max([int(e) for e in ends[b]] + [-1])
        assert torch.all(adv[b, last_end + 1 :] == 0)


@given(grouped_rewards(max_group_size=5), st.data())
def test_single_final_step_equals_outcome_advantages(data, draw):
    r, gs = data
    B = r.shape[0]
    T = 6
    lengths = draw.draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    ends = torch.tensor([[n - 1] for n in lengths])
    adv = process_advantages(r[:, None], ends, gs, T, eps=1e-4)
    outcome = group_advantages(r, gs, scale="group", eps=1e-4)
    resp = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    expected = torch.where(resp, outcome[:, None], torch.zeros(B, T, dtype=F64))
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=1e-12)


@given(process_batch(), any_reward)
def test_process_identical_rewards_exact_zero(batch, value):
    _, ends, gs, T = batch
    r = torch.full(ends.shape, value, dtype=F64)
    assert torch.equal(process_advantages(r, ends, gs, T, eps=0.0), torch.zeros(ends.shape[0], T, dtype=F64))


def test_process_degenerate_groups_never_nan():
    # group 0: a single valid step (std undefined -> 0): r - mean = 0 ; group 1: no valid step
    r = torch.tensor([[5.0, 1.0], [2.0, 3.0], [4.0, 4.0], [1.0, 1.0]])
    ends = torch.tensor([[1, -1], [-1, -1], [-1, -1], [-1, -1]])
    adv = process_advantages(r, ends, group_size=2, seq_len=3, eps=0.0)
    assert torch.equal(adv, torch.zeros(4, 3))
    # two valid steps in a group of two responses with eps=0: +-1/sqrt(2) ... normalised by the
    # sample std sqrt(2) of [1, 3]: (1 - 2)/sqrt(2), (3 - 2)/sqrt(2)
    r = torch.tensor([[1.0], [3.0]], dtype=F64)
    adv = process_advantages(r, torch.tensor([[0], [1]]), group_size=2, seq_len=2, eps=0.0)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[-s, 0.0], [s, s]], dtype=F64))


def test_process_errors():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="seq_len"):
        process_advantages(r, torch.tensor([[0, 1, 4], [0, -1, -1]]), group_size=2, seq_len=4)
    with pytest.raises(ValueError, match=r"-1"):
        process_advantages(r, torch.tensor([[0, 1, -2], [0, -1, -1]]), group_size=2, seq_len=4)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        process_advantages(r, torch.zeros(2, 2, dtype=torch.long), group_size=2, seq_len=4)
    with pytest.raises(ValueError, match="divisible"):
        process_advantages(r, torch.zeros(2, 3, dtype=torch.long), group_size=3, seq_len=4)
    with pytest.raises(ValueError, match="integer"):
        process_advantages(r, torch.zeros(2, 3), group_size=2, seq_len=4)

"""Inverse-CDF sampling over blocks (``inverse_cdf``): the token a one-level search over the exact cumulative sums
picks, up to fp32 rounding at a boundary; never a token of probability 0; the distribution it samples."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tokengym.agents.engine.policy import inverse_cdf, sample_logits

EPS = 2.0**-24  # fp32's unit roundoff


def _rows(seed: int, n: int, v: int, zeros: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 4, -1)
    return p.masked_fill(torch.rand(n, v, generator=g, dtype=torch.float64) < zeros, 0.0).float()


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), v=st.integers(1, 300), block=st.integers(1, 64),
       zeros=st.sampled_from([0.0, 0.5, 0.95]))
def test_the_token_is_the_exact_inverse_cdf_up_to_rounding(seed, n, v, block, zeros):
    probs = _rows(seed, n, v, zeros)
    probs[:, torch.randint(v, (1,), generator=torch.Generator().manual_seed(seed))] = 0.5  # every row has mass
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1))
    u[0] = 0.0  # the ends of [0, 1): the first and the last token of mass > 0
    if n > 1:
        u[1] = 1.0 - EPS
    tok = inverse_cdf(probs, u, block=block)
    assert bool((probs.gather(1, tok[:, None]) > 0).all())  # never a zero-probability token
    exact = probs.double().cumsum(-1)  # the one-level search's sums, exactly enough (float64)
    target = u.double() * exact[:, -1]
    # a recursive fp32 sum of k terms is within k * EPS of their total: the target (v terms), the block prefix
    # (v, and a subtraction), the offset in the block and the block's own sums (at most v each) add up to 4 (v + 2)
    tol = 4 * (v + 2) * EPS * exact[:, -1]
    below = torch.where(tok > 0, exact.gather(1, (tok - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(tol))
    assert bool((below <= target + tol).all()) and bool((target < exact.gather(1, tok[:, None])[:, 0] + tol).all())


def test_hand_computed_blocks_with_a_remainder():
    # 7 tokens in blocks of 3: [0.1, 0, 0.2 | 0, 0, 0 | 0.7]; cumulative 0.1, 0.1, 0.3, 0.3, 0.3, 0.3, 1.0
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.7]]).expand(6, -1)
    u = torch.tensor([0.0, 0.05, 0.1001, 0.2999, 0.3001, 1.0])
    # u = 1 (a rounded-up u * total): the last token of mass > 0; an empty block is never entered
    assert inverse_cdf(probs, u, block=3).tolist() == [0, 0, 2, 2, 6, 6]
    assert inverse_cdf(probs, u, block=3).tolist() == inverse_cdf(probs, u, block=1024).tolist()  # one block


def test_a_target_rounded_below_its_block_never_takes_the_blocks_zero_first_token():
    # the target sits on the first block's end; in fp32, total - (second block's sum) lands 1 ulp above it
    probs = torch.tensor([[0.4900934100151062, 0.8964447379112244, 0.0, 0.455627977848053]])
    assert inverse_cdf(probs, torch.tensor([0.752667248249054]), block=2).tolist() == [3]


def test_the_sampled_distribution_over_many_blocks():
    want = torch.tensor([0.05, 0.0, 0.15, 0.3, 0.0, 0.0, 0.25, 0.0, 0.2, 0.05])
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    tok = inverse_cdf(want.expand(20000, -1), u, block=3)
    freq = torch.bincount(tok, minlength=10).double() / 20000
    # binomial standard error at p = 0.3: sqrt(0.21 / 20000) = 0.0032; 5 of them
    torch.testing.assert_close(freq, want.double(), atol=0.016, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_logits_reports_the_log_prob_of_the_sampled_token(temperature):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 5000, generator=g) * 3
    logits[:, 100:200] = float("-inf")  # an action mask
    tok, logp = sample_logits(logits, temperature=temperature, uniform=torch.rand(8, generator=g))
    assert not bool(((tok >= 100) & (tok < 200)).any())
    want = torch.log_softmax(logits.double() / temperature, -1).gather(1, tok[:, None])[:, 0]
    # log of a softmax probability: exp, the sum (relative error up to 5000 * EPS in the worst case) and the division
    torch.testing.assert_close(logp.double(), want, atol=5002 * EPS, rtol=0)

"""Properties of the on-policy distillation math, `sampled_reverse_kl` and `reverse_kl` (KL(student || teacher) per
token, the negative of distillation's per-token reward): a hand case, zero where the teacher agrees, top-k with
k = V equal to the full vocabulary, non-negative, and the sampled estimator's expectation under the student equal to
the exact KL (so its reward is non-positive in expectation)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tokengym.agents.functional import reverse_kl, sampled_reverse_kl

F64 = torch.float64
EPS64 = torch.finfo(F64).eps


@st.composite
def logits_pair(draw, max_b=3, max_t=4, max_v=7):
    """Student and teacher logits ``[B, T, V]`` (float64), some positions near-deterministic."""
    B, T, V = draw(st.integers(1, max_b)), draw(st.integers(1, max_t)), draw(st.integers(1, max_v))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0, 20.0]))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g, dtype=F64) * scale, torch.randn(B, T, V, generator=g, dtype=F64) * scale)


def test_the_hand_computed_case():
    """Student (1/2, 1/4, 1/4), teacher (1/4, 1/2, 1/4): full KL = (1/2 - 1/4) log 2; over the student's top 2,
    (2/3, 1/3) against (1/3, 2/3): (1/3) log 2. The sampled estimator at token 0 is log(1/2) - log(1/4) = log 2."""
    s = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]], dtype=F64))
    t = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]], dtype=F64))
    assert float(reverse_kl(s, t)) == pytest.approx(0.25 * math.log(2), abs=1e-15)
    assert float(reverse_kl(s, t, top_k=2)) == pytest.approx(math.log(2) / 3, abs=1e-15)
    assert float(sampled_reverse_kl(s[..., 0], t[..., 0])) == pytest.approx(math.log(2), abs=1e-15)
    # teacher temperature 2 divides its logits: t / 2 is (1/4)^(1/2), ... renormalised
    t2 = torch.log_softmax(t / 2, -1)
    want = float((s.exp() * (s - t2)).sum())
    assert float(reverse_kl(s, t, teacher_temperature=2.0)) == pytest.approx(want, abs=1e-15)


@given(logits_pair(), st.integers(1, 8))
def test_zero_where_the_teacher_is_the_student(pair, k):
    s, _ = pair
    assert float(reverse_kl(s, s.clone()).abs().max()) <= 64 * EPS64 * s.shape[-1]
    assert float(reverse_kl(s, s.clone(), top_k=k).abs().max()) <= 64 * EPS64 * s.shape[-1]
    lp = torch.log_softmax(s, -1)[..., 0]
    assert torch.equal(sampled_reverse_kl(lp, lp.clone()), torch.zeros_like(lp))


@given(logits_pair(), st.integers(0, 3))
def test_top_k_with_k_at_least_v_is_the_full_vocabulary(pair, extra):
    s, t = pair
    V = s.shape[-1]
    assert torch.equal(reverse_kl(s, t, top_k=V + extra), reverse_kl(s, t))


@given(logits_pair(), st.one_of(st.none(), st.integers(1, 8)), st.sampled_from([0.5, 1.0, 2.0]))
def test_the_kl_is_non_negative(pair, k, temperature):
    s, t = pair
    kl = reverse_kl(s, t, top_k=k, teacher_temperature=temperature)
    assert kl.shape == s.shape[:2] and kl.dtype == F64
    assert float(kl.min()) >= -64 * EPS64 * s.shape[-1] * (1 + float(s.abs().max() + t.abs().max()))


@given(logits_pair())
def test_the_sampled_estimator_is_unbiased_and_its_reward_non_positive_in_expectation(pair):
    """``E_{a ~ student}[sampled_reverse_kl]`` summed over every token weighted by the student's probability equals
    the exact KL, so the reward ``-sampled_reverse_kl`` has expectation ``-KL <= 0``."""
    s, t = pair
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    expected = (ls.exp() * sampled_reverse_kl(ls, lt)).sum(-1)  # every token's estimate, weighted by its probability
    tol = 64 * EPS64 * s.shape[-1] * (1 + float(s.abs().max() + t.abs().max()))
    assert torch.allclose(expected, reverse_kl(s, t), rtol=0, atol=tol)
    assert float((-expected).max()) <= tol


@given(logits_pair())
def test_the_student_gradient_vanishes_where_the_teacher_agrees(pair):
    """The teacher's distribution is the KL's minimum over the student's logits: zero gradient there."""
    s, _ = pair
    s = s.clone().requires_grad_(True)
    reverse_kl(s, s.detach().clone()).sum().backward()
    assert float(s.grad.abs().max()) <= 64 * EPS64 * s.shape[-1] * (1 + float(s.detach().abs().max()))


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 0}, "top_k must be None or an int >= 1"),
    ({"top_k": 2.5}, "top_k must be None or an int >= 1"),
    ({"teacher_temperature": 0.0}, "teacher_temperature must be finite and > 0"),
    ({"teacher_temperature": float("nan")}, "teacher_temperature must be finite and > 0"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    s = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match=message):
        reverse_kl(s, s, **kwargs)
    with pytest.raises(ValueError, match="teacher_logits"):
        reverse_kl(s, torch.zeros(1, 2, 4))

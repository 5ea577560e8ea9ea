"""Distillation against hand-indexed teacher forwards (issue 52's missed mutations): the teacher's temperature reaches
the logits the ``topk`` and ``full`` estimators compare, the top-k support is the student's, and the teacher's
log-probs in ``forward_extra`` are of the very tokens the student sampled (a shift by one trains on a wrong signal
that no loss value reveals)."""

import math

import pytest
import torch

from tokengym.agents import DistillAgent, DistillConfig, Policy, collect
from tokengym.agents import functional as F
from tokengym.agents.engine.policy import position_ids
from tokengym.agents.engine.rollout import used_slice
from tokengym.envs import TokenVectorEnv
from tokengym.rewards import TeacherReward, teacher_token_rewards

pytestmark = pytest.mark.usefixtures("one_thread")

T = 0.5  # a teacher temperature far enough from 1 that dropping it moves every logit by a factor of 2
# Packed and padded forwards of a tiny fp32 model sum in other orders: a logit (below ~20) moves by ~1e-6, a
# log-softmax by at most twice that; 1e-4 leaves room and is far below what any mutation here changes (> 0.1).
TOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    """The random-init ``tiny`` student, ``tiny-arithmetic`` as the teacher, and 8 of the student's episodes."""
    student = Policy.from_pretrained("tiny", seed=0)
    teacher = Policy.from_pretrained("tiny-arithmetic")
    ro = collect(TokenVectorEnv(8, "arithmetic", max_new_tokens=8), student, seed=3)
    return student, teacher, ro


def raw_teacher_logits(teacher, tokens, mask, p):
    """The teacher's logits at the positions predicting ``tokens[:, p:]``: one plain padded forward, indexed by hand
    (position ``j`` predicts token ``j + 1``)."""
    with torch.no_grad():
        out = teacher.model(input_ids=tokens, attention_mask=mask.long(), position_ids=position_ids(mask)).logits
    return out[:, p - 1 : -1].float()


@pytest.mark.parametrize("estimator", ["topk", "full"])
def test_the_teacher_logits_are_at_its_temperature(setup, estimator):
    """``TeacherReward.logits`` divides by the temperature, and the reward of either whole-distribution estimator is
    ``-KL(student || teacher / T)`` of the hand-indexed forward."""
    student, teacher, ro = setup
    tokens, mask, p, m = used_slice(ro)
    act = ro.action_mask[:, :m].bool()
    want = raw_teacher_logits(teacher, tokens, mask, p) / T
    tr = TeacherReward(teacher.model, teacher.tokenizer, estimator, top_k=5, temperature=T)
    got = tr.logits(tokens, mask, p)
    assert float((got - want)[act].abs().max()) < TOL
    with torch.no_grad():
        s_logits = student(tokens, mask, p, return_logits=True)[1]
    r = tr(tokens, mask, ro.action_mask[:, :m], p, student_logits=s_logits)
    kl = F.reverse_kl(s_logits, want, 5 if estimator == "topk" else None)
    assert float((r + kl * act)[act].abs().max()) < TOL
    # the temperature matters here: at T = 1 the reward would differ by far more than the tolerance
    kl1 = F.reverse_kl(s_logits, want * T, 5 if estimator == "topk" else None)
    assert float((kl - kl1)[act].abs().max()) > 100 * TOL


@pytest.mark.parametrize("estimator", ["topk", "full"])
def test_the_agents_kl_term_and_teacher_logp_are_the_hand_indexed_teachers(setup, estimator):
    """``forward_extra``: the teacher's logits at its temperature, and its log-probs of exactly the student's tokens
    (gathered at ``tokens[:, p:]``, not one column off): what the loss's KL term and ``train/teacher_logp`` read."""
    student, teacher, ro = setup
    cfg = DistillConfig(estimator=estimator, top_k=5, distill_coef=0.3, teacher_temperature=T)
    agent = DistillAgent(student, cfg, teacher=teacher)
    tokens, mask, p, m = used_slice(ro)
    act = ro.action_mask[:, :m].bool()
    extra = agent.forward_extra(tokens, mask, p, m)
    want_logits = raw_teacher_logits(teacher, tokens, mask, p) / T
    want_lp = torch.log_softmax(want_logits.double(), -1).gather(2, tokens[:, p:, None])[..., 0]
    assert extra["teacher_logp"].shape == act.shape
    assert float((extra["teacher_logp"].double() - want_lp)[act].abs().max()) < TOL
    # a shift by one column reads other tokens' log-probs: far from these (so the check above can tell)
    shifted = torch.log_softmax(want_logits.double(), -1).gather(2, tokens[:, p - 1 : -1, None])[..., 0]
    assert float((shifted - want_lp)[act].abs().max()) > 0.1
    assert float((extra["teacher_logits"] - want_logits)[act].abs().max()) < TOL


def test_the_top_k_support_is_the_students():
    """Student (0.5, 0.4, 0.1), teacher (0.1, 0.2, 0.7), k = 2: over the student's top two {0, 1}, renormalised,
    (5/9, 4/9) against (1/3, 2/3): 0.1036; over the teacher's top two {2, 1} it would be (1/5, 4/5) against
    (7/9, 2/9): 0.7531."""
    s = torch.log(torch.tensor([[[0.5, 0.4, 0.1]]], dtype=torch.float64))
    t = torch.log(torch.tensor([[[0.1, 0.2, 0.7]]], dtype=torch.float64))
    want = 5 / 9 * math.log((5 / 9) / (1 / 3)) + 4 / 9 * math.log((4 / 9) / (2 / 3))
    assert float(F.reverse_kl(s, t, top_k=2)) == pytest.approx(want, abs=1e-12)
    r = teacher_token_rewards(torch.ones(1, 1), "topk", student_logits=s, teacher_logits=t, top_k=2)
    assert float(r) == pytest.approx(-want, abs=1e-12)
    # the gradient reaches the student's support only: token 2 is outside it
    s_req = s.clone().requires_grad_(True)
    F.reverse_kl(s_req, t, top_k=2).sum().backward()
    assert float(s_req.grad[0, 0, 2]) == 0.0 and float(s_req.grad[0, 0, :2].abs().sum()) > 0

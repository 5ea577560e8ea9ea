"""Packing in the reward-model fits: a packed pass of a sequence RM, a likelihood RM and a learned PRM gives the padded
pass's scores and gradients up to float32 rounding, and the fits' ``packing`` setting reaches the model they train.

Rows of mixed length (so that bins hold several rows), one torch thread, tolerances from ``rounding_tolerance``."""


import importlib.util
import pathlib

import pytest
import torch

from tokengym.rewards import packing
from tokengym.agents.engine.models import load_classifier, load_model
from tokengym.rewards import LearnedPRM, PRMConfig, RewardModel, RewardModelConfig, train_prm, train_reward_model
from tokengym.rewards.reward_model import LikelihoodRewardModel

_spec = importlib.util.spec_from_file_location("_numerics", pathlib.Path(__file__).parents[1] / "agents" / "_numerics.py")
_numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_numerics)
rounding_tolerance = _numerics.rounding_tolerance

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["1+2\n", "12+7+30\n", "2+2\n", "5+60+7\n"]
COMPLETIONS = ["1+2=3\nA: 3", "12+7=19\n19+30=49\nA: 49", "A: 5", "5+60=65\n65+7=72\nA: 72"]


def _both(score, model, set_packing):
    """``(padded, packed)`` outputs of ``score()`` and their gradients w.r.t. every parameter of ``model``."""
    out = []
    for mode in ("off", "bins"):
        set_packing(mode)
        model.zero_grad()
        y = score()
        (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        out.append((y.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    return out


def _close(a, b, n_terms):
    tol = rounding_tolerance(n_terms)
    (ya, ga), (yb, gb) = a, b
    assert torch.allclose(ya, yb, rtol=0, atol=tol * (1 + float(ya.abs().max())))
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb):
        assert float((x - y).abs().max()) <= tol * max(float(x.abs().max()), 1e-12)


@pytest.fixture
def spy(monkeypatch):
    """Counts the packed passes, so that a comparison cannot pass by running padded twice."""
    calls = {"n": 0}
    run = packing.Bins.run

    def counted(self, model, **kw):
        calls["n"] += int(self.segment.shape[0] < len(self.index))  # bins that hold more than one row each
        return run(self, model, **kw)

    monkeypatch.setattr(packing.Bins, "run", counted)
    return calls


def test_a_packed_sequence_rm_scores_and_gradients_equal_the_padded(spy):
    """The score is read where the classifier's own forward pools (its last non-pad token)."""
    model, tok = load_classifier("tiny-arithmetic", head="sequence", seed=0)
    rm = RewardModel(model, tok)
    ids = rm.encode(PROMPTS, COMPLETIONS)
    a, b = _both(lambda: rm.forward_ids(ids), model, lambda m: setattr(rm, "packing", m))
    _close(a, b, n_terms=4 * 40 * 352)
    assert spy["n"] >= 1


def test_a_packed_likelihood_rm_equals_the_padded(spy):
    model, tok = load_model("tiny-arithmetic")
    rm = LikelihoodRewardModel(model, tok, beta=0.5, reference=load_model("tiny")[0])
    ids = rm.encode(PROMPTS, COMPLETIONS)
    a, b = _both(lambda: rm.forward_ids(ids), model, lambda m: setattr(rm, "packing", m))
    _close(a, b, n_terms=4 * 40 * 352)
    assert spy["n"] >= 2  # the model and its reference


def test_a_packed_prm_step_logits_and_gradients_equal_the_padded(spy):
    model, tok = load_classifier("tiny-arithmetic", head="token", seed=0)
    prm = LearnedPRM(model, tok)
    enc = [prm.encode(p, c.split("\n")) for p, c in zip(PROMPTS, COMPLETIONS)]
    a, b = _both(lambda: prm.step_logits(enc), model, lambda m: setattr(prm, "packing", m))
    _close(a, b, n_terms=4 * 40 * 352)
    assert spy["n"] >= 1


def test_the_fits_pass_their_packing_to_the_model_they_train():
    """``RewardModelConfig.packing`` / ``PRMConfig.packing`` reach the fit's RM / PRM; a bad value names the choices."""
    model, tok = load_classifier("tiny", head="sequence", seed=0)
    rm = RewardModel(model, tok)
    pairs = [{"prompt": p, "chosen": c, "rejected": c + "0"} for p, c in zip(PROMPTS, COMPLETIONS)]
    train_reward_model(rm, tok, pairs, RewardModelConfig(batch_size=2, val_fraction=0, packing="bins"))
    assert rm.packing == "bins"
    seen = []
    real = LearnedPRM.step_logits

    def record(self, encoded):
        seen.append(self.packing)
        return real(self, encoded)

    pm, ptok = load_classifier("tiny", head="token", seed=0)
    LearnedPRM.step_logits = record
    try:
        train_prm(pm, ptok, [{"prompt": "p\n", "steps": ["ab", "cx"], "labels": [1.0, 0.0]}] * 4,
                  PRMConfig(batch_size=2, val_fraction=0, packing="off"))
    finally:
        LearnedPRM.step_logits = real
    assert seen and set(seen) == {"off"}
    for cfg in (RewardModelConfig, PRMConfig):
        with pytest.raises(ValueError, match="packing.*auto"):
            cfg(packing="yes")

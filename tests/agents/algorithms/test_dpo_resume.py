"""DPOLearner exact resume: stop a fit (or iterative DPO) through its callback, rebuild everything from a
checkpoint, continue -> the same parameters and the same logged metrics as one uninterrupted run."""

import copy
import io

import pytest
import torch

from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.engine.models import build_preset
from tokengym.agents.algorithms.online_dpo import iterative_dpo
from tokengym.agents.data.pairs import arithmetic_pairs
from tokengym.agents.engine.policy import Policy
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask

TASK = ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs():
    return arithmetic_pairs(TASK, 23, seed=0)  # 23 pairs, batch 5: the last batch of an epoch is short


def policy(seed):
    return Policy(*build_preset("tiny", seed=seed))


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def strip(records):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in records]


def restore(learner, make):
    """A fresh learner (differently initialised: everything must come from the checkpoint) with ``learner``'s state."""
    weights = {name: roundtrip(m.state_dict()) for name, m in learner.checkpoint_modules().items()}
    state = roundtrip(learner.state_dict())
    fresh = make(policy(99))
    mods = fresh.checkpoint_modules()
    assert set(mods) == set(weights)
    for name, m in mods.items():
        m.load_state_dict(weights[name], strict=True)
    fresh.load_state_dict(state)
    return fresh


def assert_same_params(a, b):
    for (name, p), q in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(p, q), name


CASES = {
    # stop mid-epoch (step 7 of 12: epoch 2, batch 3 of 5), live frozen reference, warmup + cosine, evals every 3 steps
    "live": (dict(steps=12, warmup_steps=2, lr_scheduler_type="cosine", eval_every=3, seed=4), 7),
    # reference log-probs precomputed before the first update (the resumed policy has moved: they come from the state),
    # records averaged over 2 steps, the plain [2B, L] stack
    "precomputed": (dict(epochs=2, precompute_ref=True, log_every=2, share_prefix=False, lr_scheduler_type="linear"), 4),
    # stopped at the very last step: the resumed fit has nothing left to do
    "finished": (dict(steps=5, eval_every=2), 5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_resume_matches_uninterrupted(pairs, case):
    kw, k = CASES[case]
    cfg = DPOConfig(batch_size=5, lr=3e-3, **kw)
    train, held = pairs[:18] + pairs[20:], pairs[18:20] + pairs[:3]

    def make(p):
        return DPOLearner(p, cfg)

    a = make(policy(0))
    full = a.fit(train, eval_pairs=held)
    total = a.global_step
    assert total >= k

    b = make(policy(0))
    part = b.fit(train, eval_pairs=held, callback=lambda rec: rec["step"] < k)
    assert b.global_step == k
    c = restore(b, make)
    rest = c.fit(train, eval_pairs=held)
    steps = [r["step"] for r in rest]
    assert (min(steps) > k and max(steps) == total) if k < total else steps == []  # only the remaining steps
    assert strip(part + rest) == strip(full)
    assert_same_params(a, c)
    assert c.epoch == a.epoch and c.global_step == a.global_step
    # a later fit is a fresh one again, not a resume
    assert len([r for r in c.fit(train) if "train/loss" in r]) == len([r for r in full if "train/loss" in r])


def test_checkpoint_modules_hold_a_frozen_reference_only_when_there_is_one():
    assert set(DPOLearner(policy(0)).checkpoint_modules()) == {"policy", "ref"}
    assert set(DPOLearner(policy(0), DPOConfig(precompute_ref=True)).checkpoint_modules()) == {"policy"}


def test_resuming_on_other_pairs_or_another_schedule_is_an_error(pairs):
    b = DPOLearner(policy(0), DPOConfig(batch_size=5, steps=6))
    b.fit(pairs, callback=lambda rec: rec["step"] < 2)
    c = restore(b, lambda p: DPOLearner(p, DPOConfig(batch_size=5, steps=6)))
    with pytest.raises(ValueError, match="interrupted after 2 of 6 steps on other pairs"):
        c.fit(pairs[:20])
    c = restore(b, lambda p: DPOLearner(p, DPOConfig(batch_size=5, steps=8)))
    with pytest.raises(ValueError, match="ran 6 steps but this config gives 8"):
        c.fit(pairs)


def test_iterative_dpo_resumes_at_a_round_boundary():
    warm = Policy.from_pretrained("tiny-arithmetic")  # the shipped warm start: its samples have reward gaps
    cfg = DPOConfig(batch_size=2, lr=1e-4, seed=3)

    def make_env():
        return TokenVectorEnv(32, TASK, tokenizer=warm.tokenizer, group_size=4)

    def make(p):
        return DPOLearner(p, cfg)

    def start():
        return Policy(copy.deepcopy(warm.model), warm.tokenizer)

    a = make(start())
    full = iterative_dpo(a, make_env(), rounds=3)
    assert all(r["pairs/count"] > 0 for r in full)

    b, env = make(start()), make_env()
    part = iterative_dpo(b, env, rounds=3, callback=lambda rec: rec["round"] < 1)
    assert len(part) == 2
    c, c_env = restore(b, make), make_env()
    c_env.load_state_dict(roundtrip(env.state_dict()))
    rest = iterative_dpo(c, c_env, rounds=3)
    assert [r["round"] for r in rest] == [2]
    assert strip(b.logger.history + c.logger.history) == strip(a.logger.history)  # the fits' records too
    assert strip(part + rest) == strip(full)
    assert_same_params(a, c)

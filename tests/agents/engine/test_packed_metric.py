"""``train/packed``: under ``packing='auto'`` an update logs the fraction of its forwards that ran packed (from where
``plan`` decides), so a run says whether auto packed; ``off`` and ``bins`` log nothing (nothing to decide)."""

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import GRPOAgent, GRPOConfig, Policy
from tokengym.agents.algorithms.sft import SFTConfig, SFTLearner
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards import packing
from tokengym.rewards.packing import packed_share, plan


def _batch(lengths, width=10):
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(3, 101, mask.shape, generator=torch.Generator().manual_seed(0)) * mask, mask


def test_packed_share_counts_the_decisions_of_auto_since_the_last_read():
    model = Policy.from_pretrained("tiny").model
    assert packed_share(model) is None  # nothing planned yet
    even, tail = _batch([10] * 4), _batch([10] + [1, 2, 3] * 5)  # nothing to gain / a long tail packs
    plan("auto", model, *even)
    assert packed_share(model) == 0.0
    plan("auto", model, *tail)
    assert packed_share(model) == 1.0
    for b in (even, tail, tail, even):
        plan("auto", model, *b)
    plan("off", model, *tail)  # off decides nothing
    assert packed_share(model) == 0.5 and packed_share(model) is None


@pytest.mark.parametrize("mode, fill, logged", [("auto", 1.0, 1.0), ("auto", 0.0, 0.0), ("off", 1.0, None)])
def test_grpo_logs_whether_auto_packed_its_update(monkeypatch, mode, fill, logged):
    """AUTO_FILL 1.0 packs every ragged batch, 0.0 none: the step's record says so (one step of the tiny preset)."""
    monkeypatch.setattr(packing, "AUTO_FILL", fill)
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4,
                       n_operands=(2, 3), digits=(1, 2), operators="+-")
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(steps=1, seed=0, packing=mode,
                                                                           skip_zero_advantage=False))
    (record,) = agent.learn(env)
    assert record.get("train/packed") == logged, record


@pytest.mark.parametrize("fill, logged", [(1.0, 1.0), (0.0, 0.0)])
def test_sft_logs_whether_auto_packed_its_steps(monkeypatch, fill, logged):
    monkeypatch.setattr(packing, "AUTO_FILL", fill)
    cfg = SFTConfig(steps=1, batch_size=8, eval_prompts=0, packing="auto", seed=0, log_every=1)
    learner = SFTLearner(Policy.from_pretrained("tiny"), ArithmeticTask(digits=(1, 3)), cfg)
    records = []
    learner.fit(callback=records.append)
    assert [r.get("train/packed") for r in records if "train/loss" in r] == [logged]

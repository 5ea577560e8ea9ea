"""GRPO exact resume: stop after k steps, rebuild everything from a checkpoint, continue -> same result."""

import io

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import GRPOAgent, GRPOConfig, Policy


def make_env():
    return gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4,
                        partial_credit=True)


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def strip(records):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in records]


@pytest.mark.parametrize("cfg", [
    dict(steps=3, iterations=2, beta=0.05, reset_ref=True, mu=2, minibatches=2),  # stop mid-iteration, ref saved
    dict(steps=5, iterations=1, beta=0.0),
])
def test_resume_matches_uninterrupted(cfg):
    config = GRPOConfig(lr=1e-3, seed=5, **cfg)
    total = config.steps * config.iterations
    a_env = make_env()
    a = GRPOAgent(Policy.from_pretrained("tiny", seed=0), config)
    full = a.learn(a_env)
    assert len(full) == total

    env = make_env()
    b = GRPOAgent(Policy.from_pretrained("tiny", seed=0), config)
    k = 4 if total > 4 else 2
    part = b.learn(env, callback=lambda rec: rec["step"] < k)
    assert len(part) == k
    weights = {name: roundtrip(m.state_dict()) for name, m in b.checkpoint_modules().items()}
    state, env_state = roundtrip(b.state_dict()), roundtrip(env.state_dict())

    c_env = make_env()
    c = GRPOAgent(Policy.from_pretrained("tiny", seed=99), config)  # different init: everything must come from the checkpoint
    mods = c.checkpoint_modules()
    assert set(mods) == set(weights)
    for name, m in mods.items():
        m.load_state_dict(weights[name])
    c.load_state_dict(state)
    c_env.load_state_dict(env_state)
    rest = c.learn(c_env)
    assert [r["step"] for r in rest] == list(range(k + 1, total + 1))
    assert strip(part + rest) == strip(full)
    for (n1, p1), (n2, p2) in zip(a.policy.named_parameters(), c.policy.named_parameters()):
        assert torch.equal(p1, p2), n1
    # a later learn() call is a fresh schedule again, not a resume
    assert len(c.learn(c_env)) == total

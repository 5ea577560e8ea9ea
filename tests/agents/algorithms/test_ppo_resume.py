"""Exact resume of PPOAgent: stop via the callback, restore a fresh agent from its checkpoint, continue ->
the same parameters and metrics as one uninterrupted run."""

import io

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents.engine.policy import Policy
from tokengym.agents.algorithms.ppo import PPOAgent, PPOConfig

STEPS, STOP = 4, 2


def make(config, sampler_seed=5):
    env = gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", partial_credit=True,
                       target="ok", max_new_tokens=3)
    return PPOAgent(Policy.from_pretrained("tiny", seed=sampler_seed), config), env


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def comparable(records):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in records]


@pytest.mark.parametrize("share_trunk", [False, True])
def test_stop_restore_continue_equals_one_run(share_trunk):
    # kl_target makes the adaptive controller move; lr is high so every step changes the weights visibly
    config = PPOConfig(steps=STEPS, lr=1e-3, beta=0.1, kl_target=0.5, kl_horizon=20, share_trunk=share_trunk, seed=3)
    full, env = make(config)
    full_history = full.learn(env)

    first, env = make(config)
    part = first.learn(env, callback=lambda record: record["step"] < STOP)
    assert first.global_step == STOP
    weights = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in first.checkpoint_modules().items()}
    state, env_state = roundtrip(first.state_dict()), roundtrip(env.state_dict())

    resumed, env = make(config, sampler_seed=99)  # the sampler's state must come from the checkpoint
    assert set(weights) == {"policy", "critic", "ref"}  # the reference is a frozen copy of the initial policy
    for name, module in resumed.checkpoint_modules().items():
        module.load_state_dict(weights[name], strict=True)
    resumed.load_state_dict(state)
    env.load_state_dict(env_state)
    rest = resumed.learn(env)

    assert [r["step"] for r in rest] == list(range(STOP + 1, STEPS + 1))  # only the remaining steps
    assert comparable(part + rest) == comparable(full_history)
    assert resumed.kl_ctl.value == full.kl_ctl.value != config.beta
    for name, module in full.checkpoint_modules().items():
        other = resumed.checkpoint_modules()[name].state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(value, other[key]), (name, key)
    # the weights did move after the stop, so the equality above is not vacuous
    assert not torch.equal(weights["policy"]["lm_head.weight"], full.policy.model.state_dict()["lm_head.weight"])
    # a later learn() call is a fresh schedule of config.steps again, not a resume
    assert len(resumed.learn(env)) == STEPS


def test_reference_is_left_out_without_kl_and_bad_state_is_named():
    agent, _ = make(PPOConfig(steps=1, beta=0.0))
    assert set(agent.checkpoint_modules()) == {"policy", "critic"}
    state = agent.state_dict()
    del state["critic_optimizer"]
    with pytest.raises(ValueError, match="critic_optimizer"):
        agent.load_state_dict(state)

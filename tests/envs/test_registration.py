"""Every registered id: gymnasium's check_env, make_vec + check_vector_env; stable-baselines3 interop."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import tokengym.envs
from tokengym.envs import ENV_IDS, check_vector_env
from tokengym.envs.vector_check import within_masks


def test_all_ids_registered():
    registered = {k for k in gym.registry if k.startswith("tokengym/")}
    assert registered == set(ENV_IDS)
    for spec in (gym.spec(k) for k in ENV_IDS):
        assert spec.entry_point and spec.vector_entry_point


@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_check_env_and_check_vector_env(env_id, bundled_env_kwargs):
    kw = bundled_env_kwargs(env_id)
    env = gym.make(env_id, **kw)
    assert isinstance(env.unwrapped, tokengym.envs.TokenEnv)
    if env.unwrapped.venv.masker is not None:  # gymnasium's check steps random actions, which a mask refuses
        env = gym.make(env_id, **kw, grammar=False)
    check_env(env.unwrapped)
    for mode in ("disabled", "next_step"):
        venv = gym.make_vec(env_id, num_envs=4, vectorization_mode="vector_entry_point", autoreset_mode=mode, **kw)
        assert isinstance(venv, tokengym.envs.TokenVectorEnv)
        assert venv.metadata["autoreset_mode"].name == mode.upper()
        check_vector_env(venv)
    venv = gym.make_vec(env_id, num_envs=4, vectorization_mode="vector_entry_point", group_size=2, **kw)
    _, info = venv.reset(seed=0)
    assert info["group_id"].tolist()[0] == info["group_id"].tolist()[1] != info["group_id"].tolist()[2]


def test_arithmetic_kwargs_reach_the_task():
    env = gym.make("tokengym/Arithmetic-v0", n_operands=2, digits=1, operators="*")
    env.reset(seed=0)
    prompt = env.unwrapped.venv.samples[0]["prompt"]
    assert prompt.count("*") == 1 and len(prompt) == 4, prompt


def test_stable_baselines3_check_env_and_ppo_interop():
    sb3 = pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_checker import check_env as sb3_check_env
    from stable_baselines3.common.monitor import Monitor

    for multi_turn in ("calculator", "guess_number"):  # observations that grow by many tokens in a step
        sb3_check_env(tokengym.envs.TokenEnv(multi_turn), warn=False)
    env = tokengym.envs.TokenEnv("reverse", length=(2, 3), max_new_tokens=6)
    sb3_check_env(env, warn=False)
    env = Monitor(env)
    model = sb3.PPO("MultiInputPolicy", env, n_steps=64, batch_size=32, n_epochs=1, seed=0, device="cpu")
    model.learn(total_timesteps=256)
    assert model.num_timesteps >= 256
    assert len(env.get_episode_rewards()) >= 256 // 7  # episodes of at most 6 tokens really ended
    obs, _ = env.reset(seed=1)
    action, _ = model.predict(obs, deterministic=True)
    assert env.action_space.contains(int(action))


@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_every_bundled_env_crosses_to_a_process_and_plays_the_same(env_id, bundled_env_kwargs):
    """What an async run's rollout workers receive: the env pickled. A task whose ``reward()`` returns a nested
    function (Target's) must cross, and the copy must score the same actions with the same rewards."""
    import pickle

    env = gym.make_vec(env_id, num_envs=4, vectorization_mode="vector_entry_point", group_size=2,
                       **bundled_env_kwargs(env_id))
    copy = pickle.loads(pickle.dumps(env))
    rng = np.random.default_rng(0)
    (obs, _), (obs2, _) = env.reset(seed=5), copy.reset(seed=5)
    assert all(np.array_equal(obs[k], obs2[k]) for k in obs)
    got = []
    for _ in range(env.max_new_tokens):
        actions = torch.as_tensor(rng.integers(0, env.single_action_space.n, size=env.num_envs))
        if env.masker is not None:  # an env with a grammar: inside its masks (and the copy's masks are the same)
            assert torch.equal(env.action_masks(), copy.action_masks())
            actions = within_masks(env, actions)
        got.append([e.step(actions)[1:3] for e in (env, copy)])
        if env.all_done:
            break
    for (r, term), (r2, term2) in got:
        assert np.array_equal(r, r2) and np.array_equal(term, term2)

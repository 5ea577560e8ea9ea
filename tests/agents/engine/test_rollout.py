"""collect(): Rollout shapes, masks, rewards and logprobs on every bundled env, with the fast decode path."""

import json

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401  (registers the ids)
from tokengym.agents import functional as Fn
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect, evaluate, heldout_samples

TOL = 1e-4
ENV_IDS = ["tokengym/Arithmetic-v0", "tokengym/Reverse-v0", "tokengym/Target-v0", "tokengym/Dataset-v0"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy():
    model, tok = build_preset("tiny", num_key_value_heads=2)
    return Policy(model.eval(), tok, seed=0)


def make_env(env_id, tmp_path, num_envs=8, group_size=2, **kw):
    if env_id == "tokengym/Dataset-v0":
        path = tmp_path / "data.jsonl"
        rows = [{"prompt": f"What is {i}+{i * 7}?\n", "answer": str(8 * i)} for i in range(6)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        kw.setdefault("data", str(path))
    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", group_size=group_size, **kw)


def check_rollout(ro, env, policy):
    N, P, M = env.num_envs, env.max_prompt_len, env.max_new_tokens
    assert ro.tokens.shape == ro.attention_mask.shape == (N, P + M) and ro.prompt_len == P
    for name in ("action_mask", "logprobs", "rewards", "process_rewards", "step_end"):
        assert getattr(ro, name).shape == (N, M), name
    assert ro.attention_mask.dtype == torch.bool and torch.equal(ro.action_mask, ro.attention_mask[:, P:])
    prompt_mask = ro.attention_mask[:, :P].long()
    assert bool((prompt_mask.diff(dim=1) >= 0).all()) and bool(prompt_mask[:, -1].all())  # left padding
    lengths = ro.lengths
    assert torch.equal(ro.action_mask, torch.arange(M)[None] < lengths[:, None])  # generation is a prefix
    assert bool((lengths >= 1).all())
    assert torch.equal(ro.terminated ^ ro.truncated, torch.ones(N, dtype=torch.bool))
    assert bool((lengths[ro.truncated] == M).all())
    last = ro.tokens[torch.arange(N), P + lengths - 1]
    assert bool((last[ro.terminated] == env.tokenizer.eos_token_id).all())  # these tasks stop on EOS only
    assert bool((ro.tokens[:, P:][~ro.action_mask] == env.pad_id).all())
    assert bool((ro.logprobs[~ro.action_mask] == 0).all()) and bool((ro.logprobs[ro.action_mask] <= 0).all())
    assert bool((ro.rewards[~ro.action_mask] == 0).all())
    assert torch.equal(ro.rewards.sum(1), ro.outcome + ro.process_rewards.sum(1))
    assert torch.equal(ro.group_id.view(-1, env.group_size), ro.group_id.view(-1, env.group_size)[:, :1].expand(-1, env.group_size))
    assert len(ro.completions) == len(ro.samples) == N and all(c is not None for c in ro.completions)
    with torch.inference_mode():
        full = policy(ro.tokens, ro.attention_mask, P)
    assert ((full - ro.logprobs) * ro.action_mask).abs().max().item() < TOL


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_rollout_shapes_and_masks_on_every_env(env_id, tmp_path, policy):
    env = make_env(env_id, tmp_path)
    ro = collect(env, policy, seed=0)
    assert policy.fast_path_active
    check_rollout(ro, env, policy)
    again = collect(env, policy, seed=1)  # the next batch reuses the policy's cache
    check_rollout(again, env, policy)


def test_step_rewards_with_the_process_reward_on(tmp_path, policy):
    env = make_env("tokengym/Arithmetic-v0", tmp_path, num_envs=16, group_size=4, process_reward=True, max_new_tokens=24)
    ro = collect(env, policy, seed=0)
    check_rollout(ro, env, policy)
    vals, ends = ro.step_rewards()
    N, M = ro.num_episodes, env.max_new_tokens
    assert vals.shape == ends.shape and vals.shape[0] == N
    assert int(ro.step_end.sum()) >= N // 2 and vals.shape[1] >= 2  # steps were scored, some rows have several
    for i in range(N):
        idx = ro.step_end[i].nonzero().flatten()
        k = idx.numel()
        assert ends[i, :k].tolist() == idx.tolist() and bool((ends[i, k:] == -1).all())
        assert torch.equal(vals[i, :k], ro.process_rewards[i, idx]) and bool((vals[i, k:] == 0).all())
        assert bool((idx < ro.lengths[i]).all())
        assert float(ro.process_rewards[i].sum()) == sum(ro.step_scores[i])
    adv = Fn.process_advantages(vals, ends, env.group_size, M)
    assert adv.shape == (N, M) and torch.isfinite(adv).all()


def test_collect_greedy_and_evaluate(tmp_path, policy):
    env = make_env("tokengym/Reverse-v0", tmp_path, num_envs=4, group_size=1)
    a = collect(env, policy, greedy=True, seed=0)
    b = collect(env, policy, greedy=True, seed=0)
    assert torch.equal(a.tokens, b.tokens)
    check_rollout(a, env, policy)
    stats = evaluate(policy, env, heldout_samples(env.task, 6))
    assert set(stats) == {"mean_reward", "accuracy", "mean_length", "truncated"}
    assert 1 <= stats["mean_length"] <= env.max_new_tokens


def test_rollout_tensors_can_enter_autograd():
    """collect() runs under inference_mode but hands back normal tensors a training step can use."""
    from tokengym.agents import Policy, collect
    from tokengym.envs import TokenVectorEnv

    policy = Policy.from_pretrained("tiny")
    ro = collect(TokenVectorEnv(2, "reverse"), policy, seed=0)
    assert not any(t.is_inference() for t in (ro.tokens, ro.attention_mask, ro.logprobs, ro.rewards, ro.outcome))
    logp = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    (logp * ro.action_mask).sum().backward()
    assert policy.model.lm_head.weight.grad is not None


def test_used_slice_drops_only_columns_that_are_padding_in_every_row():
    """Prompts of different lengths, left-padded to a generous buffer: the slice starts at the longest prompt and
    ends at the longest completion, and log-probs over it equal those over the full width (positions come from
    the mask), to float32 rounding of a differently shaped pass."""
    import gymnasium as gym

    from tokengym.agents import Policy, collect
    from tokengym.agents.engine.rollout import used_slice

    env = gym.make_vec("tokengym/Dataset-v0", num_envs=4, vectorization_mode="vector_entry_point", max_prompt_len=20,
                       data=[{"prompt": "1+2\n", "answer": "3"}, {"prompt": "10+20+3\n", "answer": "33"}], shuffle=False)
    policy = Policy.from_pretrained("tiny-arithmetic")
    ro = collect(env, policy, seed=0)
    tokens, mask, p, m = used_slice(ro)
    longest = int(ro.attention_mask[:, :20].sum(1).max())
    assert p == longest == 9 and tokens.shape[1] == p + m and m == int(ro.lengths.max())
    assert bool(mask[:, 0].any()) and not bool(ro.attention_mask[:, : 20 - p].any())  # nothing real was dropped
    with torch.no_grad():
        full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)[:, :m]
        cut = policy(tokens, mask, p)
    am = ro.action_mask[:, :m].bool()
    torch.testing.assert_close(cut[am], full[am], rtol=0, atol=1e-5)
    rows = torch.tensor([0])
    t0, m0, p0, n0 = used_slice(ro, rows)
    assert p0 == int(ro.attention_mask[0, :20].sum()) and n0 == int(ro.lengths[0])


def test_last_values_bootstrap_truncated_rows_only():
    """``last_values`` is V(s_end) for rows cut at the budget and exactly 0 for rows that terminated (EOS): a rollout
    that bootstrapped terminated rows would add value after the episode's end to every PPO return."""
    from tokengym.agents import Critic
    from tokengym.envs import TokenVectorEnv

    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    critic = Critic.from_policy(policy, seed=0)
    with torch.no_grad():  # a critic whose values are far from 0 everywhere, so a bootstrap cannot hide
        critic.value_head.bias.fill_(3.0)
    env = TokenVectorEnv(32, "arithmetic", max_new_tokens=20)  # about half the rows end before the budget
    ro = collect(env, policy, critic, seed=1)
    assert bool(ro.terminated.any()) and bool(ro.truncated.any())  # both kinds of rows in this batch
    P = env.max_prompt_len
    with torch.no_grad():
        v = critic(ro.tokens, ro.attention_mask, P)
    after = v.gather(1, ro.episode_lengths[:, None])[:, 0]
    assert torch.equal(ro.last_values[ro.terminated], torch.zeros(int(ro.terminated.sum())))
    assert torch.equal(ro.last_values[ro.truncated], after[ro.truncated]) and bool((after[ro.truncated].abs() > 0.5).all())

"""Wiring: each agent's advantages, importance weights and loss terms equal the pure functions on one fixed rollout.

The math is tested on its own (test_gae, test_group_advantages, test_variants, test_losses); these tests catch an
agent that calls it with the wrong arguments: a swapped pair, a wrong sign, a missing factor, a wrong estimator.
"""

import math

import pytest
import torch

from tokengym.agents import Critic, GRPOAgent, GRPOConfig, Policy, PPOAgent, PPOConfig, collect
from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.algorithms.onpolicy import Minibatch
from tokengym.agents.algorithms.ppo import ppo_rewards
from tokengym.agents.algorithms.registry import algorithms
from tokengym.agents.algorithms.reinforce_pp import ReinforcePPAgent, ReinforcePPConfig
from tokengym.agents.algorithms.rloo import RLOOAgent, RLOOConfig
from tokengym.envs import TokenVectorEnv

G = 4


@pytest.fixture(scope="module")
def rollout():
    """32 episodes in groups of 4 from the shipped warm start, with rule-based PRM scores and critic values; some
    rows end before the budget and some are cut by it."""
    torch.manual_seed(0)
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    critic = Critic.from_policy(policy, seed=0)
    env = TokenVectorEnv(32, "arithmetic", group_size=G, max_new_tokens=22, process_reward=True)
    ro = collect(env, policy, critic, seed=3)
    assert ro.outcome.view(-1, G).std(1).gt(0).any()  # some groups carry signal
    assert bool(ro.truncated.any()) and bool(ro.terminated.any())
    g = torch.Generator().manual_seed(1)
    ref = ro.logprobs + 0.3 * torch.randn(ro.logprobs.shape, generator=g) * ro.action_mask  # a reference that differs
    return policy, ro, ref


def per_token(x, ro):
    return x[:, None].expand(-1, ro.action_mask.shape[1]) * ro.action_mask


@pytest.mark.parametrize("preset", [None, *sorted(algorithms()["grpo"].presets)])
def test_grpo_advantages_are_the_group_advantages_of_the_shaped_returns(rollout, preset):
    policy, ro, _ = rollout
    cfg = GRPOConfig(**algorithms()["grpo"].presets.get(preset, {}))
    returns = ro.returns
    if cfg.overlong_buffer > 0:
        budget = ro.attention_mask.shape[1] - ro.prompt_len
        buffer = max(1, round(cfg.overlong_buffer * budget))
        returns = returns + V.overlong_penalty(ro.episode_lengths, budget, buffer, cfg.overlong_penalty)
    want = per_token(F.group_advantages(returns, G, scale=cfg.scale_rewards), ro)
    assert torch.equal(GRPOAgent(policy, cfg).advantages(ro), want)


def test_grpo_process_advantages_are_the_process_advantages_of_the_step_rewards(rollout):
    policy, ro, _ = rollout
    steps, ends = ro.step_rewards()
    want = F.process_advantages(steps, ends, G, ro.action_mask.shape[1]) * ro.action_mask
    assert torch.equal(GRPOAgent(policy, GRPOConfig(advantage="process")).advantages(ro), want)


def test_rloo_advantages_are_leave_one_out(rollout):
    policy, ro, _ = rollout
    assert torch.equal(RLOOAgent(policy, RLOOConfig()).advantages(ro), per_token(V.rloo_advantages(ro.returns, G), ro))


@pytest.mark.parametrize("group_baseline", [False, True])
def test_reinforce_pp_advantages_take_the_kl_penalty_of_the_rollout_against_the_reference(rollout, group_baseline):
    """Reward - beta * KL(pi_old || ref) per token, with the KL of the sampled tokens: a flipped sign or swapped
    arguments change it (the KL here is far from 0)."""
    policy, ro, ref = rollout
    cfg = ReinforcePPConfig(beta=0.3, group_baseline=group_baseline)
    am = ro.action_mask
    kl = F.kl_penalty(ro.logprobs, ref, cfg.kl_estimator) * am
    assert float(kl.abs().sum()) > 1.0
    want = V.reinforce_pp_advantages(ro.rewards, am, kl, 0.3, cfg.gamma, G if group_baseline else None)
    assert torch.equal(ReinforcePPAgent(policy, cfg).advantages(ro, ref), want)


def test_ppo_advantages_are_whitened_gae_of_the_kl_penalised_rewards(rollout):
    """GAE over ``rewards - beta * KL`` with the rollout's values, ending every row at 0 (no bootstrap by default)."""
    policy, ro, ref = rollout
    cfg = PPOConfig(beta=0.2)
    agent = PPOAgent(policy, cfg)
    rewards, kl = ppo_rewards(ro, ref, 0.2, cfg.kl_estimator)
    assert torch.equal(rewards, (ro.rewards - 0.2 * F.kl_penalty(ro.logprobs, ref, cfg.kl_estimator) * ro.action_mask)
                       * ro.action_mask)
    adv, ret = F.gae(rewards, ro.values, ro.action_mask, cfg.gamma, cfg.lam, None)
    got_adv, got_ret, _ = agent.advantages(ro, ref)
    assert torch.equal(got_ret, ret) and torch.equal(got_adv, F.whiten(adv, ro.action_mask))
    boot = PPOAgent(policy, PPOConfig(beta=0.2, bootstrap_truncated=True)).advantages(ro, ref)[1]
    assert torch.equal(boot, F.gae(rewards, ro.values, ro.action_mask, cfg.gamma, cfg.lam, ro.last_values)[1])


def test_tis_weights_are_the_trainers_over_the_samplers_probability_capped(rollout):
    """pi_old (the trainer's recomputed log-probs) over pi_sampler (the rollout's): with the trainer 3x and 0.5x as
    likely as the sampler the token-level TIS weights are exactly min(3, 2) = 2 and 0.5; swapping the two gives
    1/3 and 2 instead."""
    policy, ro, _ = rollout
    am = ro.action_mask.bool()
    up = torch.zeros_like(ro.logprobs, dtype=torch.bool)
    up[::2] = True
    old = ro.logprobs + torch.where(up, math.log(3.0), math.log(0.5)) * am
    agent = GRPOAgent(policy, GRPOConfig(correction="tis", correction_cap=2.0))
    batch, _ = agent.frozen_batch(ro, old, None)
    w = batch["weights"]
    assert torch.allclose(w[am & up], torch.full_like(w[am & up], 2.0), rtol=0, atol=1e-6)
    assert torch.allclose(w[am & ~up], torch.full_like(w[am & ~up], 0.5), rtol=0, atol=1e-6)
    want = V.importance_weights(old, ro.logprobs, ro.action_mask, "tis", "token", 2.0)
    assert torch.equal(w, want)


def _minibatch(ro, logp_shift=0.05):
    g = torch.Generator().manual_seed(2)
    logp = (ro.logprobs + logp_shift * torch.randn(ro.logprobs.shape, generator=g)).requires_grad_()
    rows = torch.arange(ro.num_episodes)
    m = ro.action_mask.shape[1]
    return Minibatch(rows=rows, m=m, action_mask=ro.action_mask, logp=logp, entropy=torch.zeros_like(ro.logprobs))


def test_gspo_takes_each_rows_mean_advantage_not_its_sum(rollout):
    """GSPO's sequence advantage is the row's (constant) token advantage; multiplied by the row length the loss
    would change for rows of different lengths, which this rollout has."""
    policy, ro, _ = rollout
    cfg = GRPOConfig(**algorithms()["grpo"].presets["gspo"])
    agent = GRPOAgent(policy, cfg)
    batch, _ = agent.prepare(ro, ro.logprobs, None)
    batch["old_logp"] = ro.logprobs
    mb = _minibatch(ro, 1e-4)
    got, _ = agent.policy_terms(mb, batch, ro.action_mask)
    seq_adv = F.group_advantages(ro.returns, G, scale=cfg.scale_rewards)
    want, _ = V.gspo_loss(mb.logp, ro.logprobs, seq_adv, ro.action_mask, cfg.clip_eps, cfg.clip_eps_high)
    assert len(set(ro.episode_lengths.tolist())) > 1
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (float(got), float(want))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_grpo_loss_terms_are_the_clipped_surrogate_and_beta_times_the_configured_kl(rollout, estimator):
    policy, ro, ref = rollout
    cfg = GRPOConfig(beta=0.04, kl_estimator=estimator, entropy_coef=0.01)
    agent = GRPOAgent(policy, cfg)
    batch, _ = agent.prepare(ro, ro.logprobs, ref)
    batch["old_logp"] = ro.logprobs
    mb = _minibatch(ro)
    mb.entropy = torch.rand(ro.logprobs.shape, generator=torch.Generator().manual_seed(3))
    terms, _ = agent.loss(mb, batch)
    am, agg = ro.action_mask, cfg.aggregation
    pg, _ = F.policy_loss(mb.logp, ro.logprobs, batch["adv"], am, cfg.clip_eps, cfg.clip_eps_high, agg)
    kl = F.masked_aggregate(F.kl_penalty(mb.logp, ref, estimator), am, agg)
    ent = -(0.01 * F.masked_aggregate(mb.entropy, am, agg))
    assert [a for _, a in terms] == [agg] * 3
    assert torch.equal(terms[0][0], pg) and torch.equal(terms[1][0], 0.04 * kl) and torch.equal(terms[2][0], ent)
    (sum(t for t, _ in terms)).backward()
    assert mb.logp.grad is not None  # the loss reaches the policy's log-probs, and nothing else requires grad


def test_ppo_loss_weights_the_surrogate_by_the_rollout_correction(rollout):
    """PPO's policy term with ``correction="tis"`` is the clipped surrogate weighted by the skeleton's TIS weights
    (pi_old over the sampler's log-probs), which are constants; without a correction there are no weights."""
    policy, ro, _ = rollout
    old = ro.logprobs + 0.4 * torch.randn(ro.logprobs.shape, generator=torch.Generator().manual_seed(4)) * ro.action_mask
    critic = Critic.from_policy(policy, seed=0)
    agent = PPOAgent(policy, PPOConfig(correction="tis", correction_cap=1.5), critic=critic)
    batch, _ = agent.frozen_batch(ro, old, None)
    want_w = V.importance_weights(old, ro.logprobs, ro.action_mask, "tis", "token", 1.5)
    assert torch.equal(batch["weights"], want_w) and not batch["weights"].requires_grad
    mb = _minibatch(ro)
    mb.extra = {"values": ro.values.clone().requires_grad_()}
    terms, _ = agent.loss(mb, batch)
    cfg = agent.config
    pg, _ = F.policy_loss(mb.logp, old, batch["adv"], ro.action_mask, cfg.clip_eps, cfg.clip_eps_high, cfg.aggregation,
                          want_w)
    assert torch.equal(terms[0][0], pg)
    unweighted, _ = F.policy_loss(mb.logp, old, batch["adv"], ro.action_mask, cfg.clip_eps, cfg.clip_eps_high,
                                  cfg.aggregation)
    assert not torch.equal(pg, unweighted)  # the weights matter on this input
    assert "weights" not in PPOAgent(policy, PPOConfig(correction="none"), critic=critic).frozen_batch(ro, old, None)[0]


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_auto_correction_is_tis_in_async_modes_and_none_otherwise(cls):
    assert cls().correction == "auto" and cls().correction_mode == "none" and cls().reuse_rollout_logprobs
    for mode in ("one-step", "bounded"):
        cfg = cls(async_mode=mode)
        assert cfg.correction_mode == "tis" and not cfg.reuse_rollout_logprobs
    assert cls(async_mode="one-step", correction="none").correction_mode == "none"
    assert GRPOConfig(async_mode="one-step", loss="gspo", clip_eps=3e-4).correction_mode == "none"  # weights clip only


def test_one_minibatch_takes_pi_old_and_the_correction_from_the_updates_own_forward():
    """mu = 1 with one minibatch: the update's forward runs at pi_old's weights, so its detached log-probs are pi_old
    (no extra pass), and the TIS weights the loss sees are pi_old over the sampler's log-probs, as a separate
    recomputation gives them (to float rounding: the two passes batch the rows differently)."""
    from tokengym.agents.engine.rollout import trimmed_logprobs

    torch.manual_seed(0)
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0, temperature=1.3)  # sampler != trainer: weights differ from 1
    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
    agent = GRPOAgent(policy, GRPOConfig(correction="tis", correction_cap=1.5, skip_zero_advantage=False, seed=0))
    seen = {}
    loss = agent.loss

    def spy(mb, batch):
        seen.update(rows=mb.rows, m=mb.m, old=batch["old_logp"].clone(), weights=batch["weights"].clone())
        return loss(mb, batch)

    agent.loss = spy
    collect_ = agent.collect
    agent.collect = lambda e: seen.setdefault("ro", collect_(e))
    agent.step(env)
    ro = seen["ro"]
    # the policy's weights after the step are not pi_old's: recompute pi_old with a fresh copy of the start weights
    fresh = Policy.from_pretrained("tiny-arithmetic", seed=0, temperature=1.3)
    with torch.no_grad():
        want_old = trimmed_logprobs(fresh, ro)
    am = ro.action_mask.bool()
    tol = 1e-5 * want_old.abs().max().item() + 1e-6
    assert torch.allclose(seen["old"][am], want_old[am], rtol=0, atol=tol)
    want_w = V.importance_weights(seen["old"], ro.logprobs, ro.action_mask, "tis", "token", 1.5)
    assert torch.equal(seen["weights"], want_w)
    assert (seen["weights"][am] != 1).any()  # the correction is not a no-op on this rollout

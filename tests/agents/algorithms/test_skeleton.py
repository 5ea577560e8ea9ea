"""GRPO and PPO on the shared skeleton step exactly as the algorithm written out as a plain loop of
``functional`` pieces: rollout, advantages, mu epochs of shuffled minibatches, loss, clip, AdamW step.

Both sides run the same kernels in the same order on the same machine, so their weights after several
updates are bit-identical on any CPU: this pins the skeleton's wiring (minibatch order, which log-probs
are pi_old, where the reference and the critic enter, the gradient clip) without a float tolerance.
"""

import math

import gymnasium as gym
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import functional as F
from tokengym.agents.engine.critic import Critic
from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.runtime.optim import adamw
from tokengym.agents.engine.policy import Policy, make_reference
from tokengym.agents.algorithms.ppo import PPOAgent, PPOConfig
from tokengym.agents.engine.rollout import collect, trimmed_logprobs, used_slice


def env(n, g):
    return gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=g)


def minibatches(n, cfg, shuffle):
    for _ in range(cfg.mu):
        yield from torch.randperm(n, generator=shuffle).chunk(cfg.minibatches)


def clip_and_step(pairs, max_norm):
    for params, _ in pairs:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    for _, opt in pairs:
        opt.step()


def identical(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_grpo_steps_exactly_as_the_written_out_loop():
    cfg = GRPOConfig(steps=2, mu=2, minibatches=2, beta=0.05, kl_estimator="k3", clip_eps_high=0.28, lr=1e-4, seed=3)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), cfg)
    agent.learn(env(16, 4))

    policy = Policy.from_pretrained("tiny-arithmetic")
    ref, opt, shuffle, e = make_reference(policy), adamw(policy.parameters(), lr=cfg.lr), torch.Generator().manual_seed(3), env(16, 4)
    params = [p for p in policy.parameters() if p.requires_grad]
    policy.seed(cfg.seed)
    for step in range(cfg.steps):
        policy.eval()
        ro = collect(e, policy, seed=cfg.seed if step == 0 else None)
        with torch.no_grad():
            ref_logp = trimmed_logprobs(ref, ro)
        adv = F.group_advantages(ro.returns, 4)[:, None].expand(-1, ro.action_mask.shape[1]) * ro.action_mask
        policy.train()
        for rows in minibatches(ro.num_episodes, cfg, shuffle):
            tokens, mask, p, m = used_slice(ro, rows)
            logp, _ = policy(tokens, mask, p, return_entropy=True)
            am = ro.action_mask[rows, :m]
            pg, _ = F.policy_loss(logp, ro.logprobs[rows, :m], adv[rows, :m], am, 0.2, 0.28, cfg.aggregation)
            kl = F.masked_aggregate(F.kl_penalty(logp, ref_logp[rows, :m], "k3"), am, cfg.aggregation)
            opt.zero_grad(set_to_none=True)
            (pg + cfg.beta * kl).backward()
            clip_and_step([(params, opt)], 1.0)
    assert not identical(policy.model, Policy.from_pretrained("tiny-arithmetic").model)  # it trained
    assert identical(agent.policy.model, policy.model)


def test_ppo_steps_exactly_as_the_written_out_loop():
    cfg = PPOConfig(steps=2, mu=2, minibatches=2, beta=0.05, lr=3e-5, seed=1)
    agent = PPOAgent(Policy.from_pretrained("tiny-arithmetic"), cfg)
    agent.learn(env(16, 1))

    policy = Policy.from_pretrained("tiny-arithmetic")
    critic = Critic.from_policy(policy, seed=cfg.seed)
    ref, shuffle, e = make_reference(policy), torch.Generator().manual_seed(1), env(16, 1)
    pparams, cparams = list(policy.parameters()), list(critic.parameters())
    popt, copt = adamw(pparams, lr=cfg.lr), adamw(cparams, lr=cfg.critic_lr)
    policy.seed(cfg.seed)
    for step in range(cfg.steps):
        policy.eval(), critic.eval()
        ro = collect(e, policy, critic, seed=cfg.seed if step == 0 else None)
        am = ro.action_mask
        with torch.no_grad():
            kl = F.kl_penalty(ro.logprobs, trimmed_logprobs(ref, ro), "k1") * am
            adv, ret = F.gae((ro.rewards - cfg.beta * kl) * am, ro.values, am, cfg.gamma, cfg.lam)
            adv = F.whiten(adv, am)
        policy.train(), critic.train()
        for rows in minibatches(ro.num_episodes, cfg, shuffle):
            tokens, mask, p, m = used_slice(ro, rows)
            logp, _ = policy(tokens, mask, p, return_entropy=True)
            values = critic(tokens, mask, p)[:, :m]
            a = am[rows, :m]
            pg, _ = F.policy_loss(logp, ro.logprobs[rows, :m], adv[rows, :m], a, 0.2, None, "token-mean")
            vf, _ = F.value_loss(values, ro.values[rows, :m], ret[rows, :m], a, 0.2)
            popt.zero_grad(set_to_none=True), copt.zero_grad(set_to_none=True)
            (pg + vf).backward()
            clip_and_step([(pparams, popt), (cparams, copt)], 1.0)
    assert math.isfinite(float(pg)) and not identical(policy.model, Policy.from_pretrained("tiny-arithmetic").model)
    assert identical(agent.policy.model, policy.model) and identical(agent.critic, critic)

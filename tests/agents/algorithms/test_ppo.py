"""PPO: learns the toy env, its critic explains returns, KL-shaped rewards and the adaptive controller."""

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import functional as F
from tokengym.agents.engine.policy import Policy
from tokengym.agents.algorithms.ppo import AdaptiveKLController, PPOAgent, PPOConfig, ppo_rewards
from tokengym.agents.engine.rollout import collect


def target_env(n=32):
    return gym.make_vec("tokengym/Target-v0", num_envs=n, vectorization_mode="vector_entry_point",
                        partial_credit=True, target="ok", max_new_tokens=2)


def test_ppo_learns_the_toy_target_and_its_critic_explains_returns():
    # defaults but a higher lr (the default is tuned for warm starts; see the slow test below)
    agent = PPOAgent(Policy.from_pretrained("tiny"), PPOConfig(steps=70, lr=1e-4))
    history = agent.learn(target_env())
    assert history[0]["objective/score"] < 0.1
    assert max(r["objective/score"] for r in history[-5:]) > 0.9
    # the critic regresses onto the returns: explained variance turns clearly positive and stays there
    assert history[0]["train/explained_variance"] < 0.1
    assert min(r["train/explained_variance"] for r in history[-5:]) > 0.5
    assert max(abs(r["train/value_mean"]) for r in history) < 1.5  # no drift: rewards are in [0, 1]


@pytest.mark.slow
def test_default_config_learns_the_toy_target():
    history = PPOAgent(Policy.from_pretrained("tiny"), PPOConfig(steps=160)).learn(target_env())
    assert max(r["objective/score"] for r in history[-10:]) > 0.9


@pytest.mark.slow
def test_default_config_raises_heldout_greedy_accuracy_from_the_sft_warm_start():
    """Measured here: 65.5% -> 73.5% after 40 updates (seeds 0 and 1), 200 held-out prompts, verifier reward."""
    from tokengym.agents import evaluate, heldout_samples
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ArithmeticTask

    def task():
        return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")

    policy = Policy.from_pretrained("tiny-arithmetic")
    eval_env, samples = TokenVectorEnv(100, task()), heldout_samples(task(), 200)
    before = evaluate(policy, eval_env, samples)["accuracy"]
    history = PPOAgent(policy, PPOConfig(steps=40)).learn(TokenVectorEnv(64, task()))
    after = evaluate(policy, eval_env, samples)["accuracy"]
    assert 0.55 < before < 0.75, before
    assert after >= before + 0.05, (before, after)
    assert max(r["train/explained_variance"] for r in history) > 0.2


def test_ppo_raises_heldout_greedy_accuracy_from_the_sft_warm_start():
    """The default suite's held-out claim for PPO (the slow test above runs the defaults for 40 updates): 25
    updates of 64 rollouts with mu=2 and lr 5e-5 from the shipped warm start raise greedy accuracy on 200
    held-out prompts (verifier reward) by far more than seed-to-seed noise. Measured here at one torch thread:
    0.655 -> 0.730 / 0.755 / 0.740 for seeds 0 / 1 / 2 (+7.5, +10.0, +8.5 points), about 37 s; the assertion
    asks for +4. (20 updates at lr 6e-5: +3.5 / +4.0; at lr 1e-4 the policy stalls: -0.5 / 0.0.)"""
    from tokengym.agents import evaluate, heldout_samples
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ArithmeticTask

    def task():
        return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")

    policy = Policy.from_pretrained("tiny-arithmetic")
    eval_env, samples = TokenVectorEnv(200, task()), heldout_samples(task(), 200)
    before = evaluate(policy, eval_env, samples)["accuracy"]
    PPOAgent(policy, PPOConfig(steps=25, lr=5e-5, mu=2, seed=0)).learn(TokenVectorEnv(64, task()))
    after = evaluate(policy, eval_env, samples)["accuracy"]
    assert before == pytest.approx(0.655), before  # greedy decoding of the warm start is deterministic
    assert after >= before + 0.04, (before, after)


def test_rewards_subtract_beta_kl_on_action_tokens_only():
    env = target_env(8)
    policy = Policy.from_pretrained("tiny")
    ro = collect(env, policy, seed=0)
    ref_logp = ro.logprobs - 0.25 * ro.action_mask  # a reference that is exp(0.25) less likely on every token
    shaped, kl = ppo_rewards(ro, ref_logp, beta=0.1, estimator="k1")
    assert torch.allclose(kl, 0.25 * ro.action_mask)
    assert torch.allclose(shaped, (ro.rewards - 0.025) * ro.action_mask)


@pytest.mark.parametrize("bootstrap", [False, True])
def test_gae_uses_old_values_and_bootstraps_truncated_rows_only_when_asked(bootstrap):
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=4, vectorization_mode="vector_entry_point", max_new_tokens=6)
    agent = PPOAgent(Policy.from_pretrained("tiny"),
                     PPOConfig(steps=0, beta=0.0, whiten_advantages=False, bootstrap_truncated=bootstrap))
    ro = collect(env, agent.policy, agent.critic, seed=0)
    assert ro.truncated.any()
    m = ro.action_mask.shape[1]
    with torch.no_grad():
        v = agent.critic(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert torch.allclose(ro.last_values, torch.where(ro.truncated, v[:, m], torch.zeros(4)))
    adv, ret, _ = agent.advantages(ro)
    # by default a truncated row's (already scored) return ends at 0 like a terminated one
    last = ro.last_values if bootstrap else torch.zeros(4)
    expected_adv, expected_ret = F.gae(ro.rewards * ro.action_mask, ro.values, ro.action_mask, 1.0, 0.95, last)
    assert torch.allclose(adv, expected_adv) and torch.allclose(ret, expected_ret)
    end = ro.lengths - 1
    rows = torch.arange(4)
    assert torch.allclose(ret[rows, end], ro.rewards[rows, end] + (ro.last_values if bootstrap else 0))


def test_passes_over_the_batch_skip_columns_after_the_longest_row():
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ArithmeticTask

    policy = Policy.from_pretrained("tiny-arithmetic")  # stops after ~20 tokens, well inside the budget of 48
    env = TokenVectorEnv(8, ArithmeticTask(n_operands=(2, 3), digits=2, operators="+"), max_new_tokens=48)
    agent = PPOAgent(policy, PPOConfig(steps=1, minibatches=2))
    widths = []
    for module in (policy, agent.ref, agent.critic):
        forward = module.forward
        module.forward = lambda tokens, *a, _f=forward, **k: (widths.append(tokens.shape[1]), _f(tokens, *a, **k))[1]
    history = agent.learn(env)
    P = env.max_prompt_len
    longest, full = int(env.attention_mask[:, :P].sum(1).max()) + int(history[0]["completion/length_max"]), P + 48
    assert longest < full - 1
    # collect's critic pass sees the whole buffer; the reference pass and the 2 x 4 minibatch passes of policy
    # and critic start at the longest prompt and stop at the longest row of their (mini)batch
    assert widths.count(full) == 1 and len(widths) == 1 + 1 + 2 * 2 * 4
    assert max(widths[1:]) == longest


def test_bf16_rollout_and_update_agree_to_bf16_rounding():
    agent = PPOAgent(Policy.from_pretrained("tiny"), PPOConfig(steps=1, bf16=True, lr=1e-9, critic_lr=1e-9))
    record = agent.learn(target_env(8))[0]
    assert abs(record["train/ratio_mean"] - 1) < 0.02 and record["train/clipfrac"] == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in record.values())


def test_adaptive_kl_controller_moves_towards_target():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(kl=12.0, n_episodes=10)  # too much KL: beta grows by at most 20% * n / horizon
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    ctl.update(kl=3.0, n_episodes=10)
    assert ctl.value < 0.1 * (1 + 0.2 * 0.1)
    fixed = AdaptiveKLController(0.1, target=None, horizon=100)
    fixed.update(kl=100.0, n_episodes=10)
    assert fixed.value == 0.1


def test_shared_trunk_critic_is_updated_through_the_policy_optimizer():
    policy = Policy.from_pretrained("tiny")
    agent = PPOAgent(policy, PPOConfig(steps=1, share_trunk=True, beta=0.0))
    assert agent.critic.trunk is policy.model.get_decoder()
    critic_only = {id(p) for p in agent.critic_opt.param_groups[0]["params"]}
    assert critic_only == {id(p) for p in agent.critic.value_head.parameters()}
    agent.learn(target_env(8))


@pytest.mark.parametrize("field, value", [("mu", 0), ("lam", 1.5), ("kl_estimator", "k9"), ("value_clip", 0.0)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        PPOConfig(**{field: value})

"""The RLHF pipeline on Arithmetic: SFT warm start -> reward model on bundled pairs -> PPO against it.

What holds on CPU in this budget and is asserted here:

* a Bradley-Terry reward model warm-started from the shipped SFT checkpoint ranks held-out bundled pairs;
* the trained RM is the env's outcome reward: PPO's logged score is the RM's score, and the verifier
  still measures greedy held-out accuracy on the side.

What does not hold yet (``test_ppo_against_the_learned_rm_raises_verifier_accuracy``, slow and
``xfail``): PPO against the learned RM raising the *verifier's* greedy accuracy beyond seed noise. The
tiny RM learns the bundled pairs' corruptions quickly but cannot verify the policy's own mistakes
(carry slips in 2-digit additions) better than the policy makes them; numbers in that test's docstring.
"""

import numpy as np
import pytest
import torch

from tokengym.agents import Policy, collect, evaluate, heldout_samples
from tokengym.agents.models import load_classifier
from tokengym.agents.pairs import arithmetic_pairs, split_pairs
from tokengym.agents.ppo import PPOAgent, PPOConfig
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards import RewardModel, RewardModelConfig, train_reward_model

WARM = "tiny-arithmetic"


def task():
    return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


@pytest.fixture(scope="module")
def trained_rm():
    """RM from the SFT trunk on 1,024 bundled pairs (reference vs corrupted), prompts of the eval set excluded."""
    held = {s["prompt"] for s in heldout_samples(task(), 200)}
    pairs = arithmetic_pairs(task(), 1024, seed=0, exclude_prompts=held)
    train, val = split_pairs(pairs, val_fraction=0.125, seed=0)
    model, tok = load_classifier(WARM, head="sequence", seed=0)
    hist = train_reward_model(model, tok, train, RewardModelConfig(lr=3e-4, batch_size=32, epochs=1, seed=0), eval_pairs=val)
    return RewardModel(model, tok), hist


def test_reward_model_from_the_sft_warm_start_ranks_heldout_bundled_pairs(trained_rm):
    rm, hist = trained_rm
    acc = hist[-1]["eval/accuracy"]
    print(f"held-out pairwise accuracy of the RM on bundled pairs: {acc:.3f}")
    assert acc > 0.8, acc  # measured: 0.90
    assert hist[-1]["eval/margin"] > 0


def test_ppo_optimises_the_learned_rm_as_the_envs_outcome_reward(trained_rm):
    rm, _ = trained_rm
    policy = Policy.from_pretrained(WARM)
    ro = collect(TokenVectorEnv(64, task()), policy, seed=1)
    rm.normalize([s["prompt"] for s in ro.samples], ro.completions)  # the initial policy scores mean 0, std 1
    scored = []

    def recorded_rm(prompts, completions, **fields):
        scores = rm(prompts, completions, **fields)
        scored.append(scores)
        return scores

    env = TokenVectorEnv(32, task(), reward=recorded_rm)
    eval_env = TokenVectorEnv(100, task())  # default reward: the verifier
    agent = PPOAgent(policy, PPOConfig(steps=2, lr=5e-5, mu=1, minibatches=1, kl_coef=0.05, seed=0))
    history = agent.learn(env, eval_env, heldout_samples(task(), 100))
    per_rollout = torch.cat(scored).split(32)  # every episode is scored once, when it ends
    assert len(per_rollout) == 2
    for scores, rec in zip(per_rollout, history):
        assert rec["objective/score"] == pytest.approx(scores.mean().item(), abs=1e-5)
    assert abs(history[0]["objective/score"]) < 1.0  # normalised on the initial policy's samples
    assert 0.0 <= history[-1]["eval/accuracy"] <= 1.0  # greedy accuracy under the verifier, not the RM


def test_learned_prm_on_rule_based_labels_plugs_into_the_env_and_agrees_with_the_rule():
    """A token-classification PRM from the SFT trunk, trained on the rule-based checker's labels of 1,500
    solutions (half the warm start's own samples, a fifth references, the rest corrupted), scores the
    warm start's rollouts on 128 held-out prompts inside the env. Measured: agreement 0.64 with the rule
    (the majority label alone: 0.55); it flags 41% of the rule's bad steps and passes 82% of the good ones."""
    from tokengym.agents.reward_data import arithmetic_step_labels
    from tokengym.rewards import LearnedPRM, PRMConfig, arithmetic_step_reward, train_prm

    heldout = heldout_samples(task(), 128)
    policy = Policy.from_pretrained(WARM)
    examples = arithmetic_step_labels(task(), 1500, seed=0, policy=policy, sampled_fraction=0.5,
                                      exclude_prompts={s["prompt"] for s in heldout})
    model, tok = load_classifier(WARM, head="token", seed=0)
    hist = train_prm(model, tok, examples, PRMConfig(lr=1e-3, batch_size=32, epochs=2, seed=0))
    print(f"held-out step accuracy of the learned PRM: {hist[-1]['eval/step_accuracy']:.3f}")
    assert hist[-1]["eval/step_accuracy"] > 0.55

    env = TokenVectorEnv(128, task(), process_reward=LearnedPRM(model, tok, threshold=0.5))
    ro = collect(env, policy, samples=heldout, seed=5)
    steps = [[p for p in c.split("\n") if p.strip()] for c in ro.completions]
    rule = np.array([x for row in arithmetic_step_reward([s["prompt"] for s in ro.samples], steps) for x in row])
    learned = np.array([x for row in ro.step_scores for x in row])
    assert learned.shape == rule.shape and int(ro.step_end.sum()) == len(rule)
    agree = (learned == rule).mean()
    majority = max(rule.mean(), 1 - rule.mean())
    print(f"agreement with the rule-based PRM on {len(rule)} steps: {agree:.3f} (majority label: {majority:.3f})")
    assert agree > 0.5 and agree > majority + 0.03, (agree, majority)
    assert (learned[rule == 0] == 0).mean() > 0.25 and (learned[rule == 1] == 1).mean() > 0.6


@pytest.mark.slow
@pytest.mark.xfail(reason="the tiny RM cannot verify the warm start's own carry slips; PPO against it does not raise "
                          "the verifier's greedy accuracy (see the docstring)", strict=False)
def test_ppo_against_the_learned_rm_raises_verifier_accuracy(trained_rm):
    """The issue's must-learn claim, kept as a tracked expected failure.

    Measured (seed 0, 200 held-out prompts, warm start 65.5% greedy), RM held-out pairwise accuracy 0.91 on
    bundled pairs but only ~0.5-0.6 within-prompt accuracy on the policy's own samples (correct vs wrong):
    the bundled corruptions are random digits the SFT trunk already finds surprising, the policy's errors
    are carry slips it believes in. PPO then climbs the RM score and the verifier's accuracy drifts down:

    * RM on 1,024 sampled pairs (reference vs the policy's wrong samples), PPO lr 1e-4, kl 0.01, 30 steps:
      0.655 -> 0.225 (KL 4.7).
    * RM memorising a 128-prompt pool (10 epochs, within-prompt 0.75), PPO lr 5e-5, kl 0.1: 0.655 -> 0.51.
    * The same with a sum-pooled token-classifier RM (within-prompt 0.90) normalised to unit scale,
      kl 0.05: 0.655 -> 0.70 (step 10) -> 0.665 (step 20).
    * A 64-prompt pool, RM within-prompt 0.94, normalised, kl 0.05: RM score 0.05 -> 0.35, verifier 0.655 -> 0.65.
    * This test's set-up (RM of the fixture, normalised on the warm start's samples, 20 PPO steps):
      lr 5e-5, mu 2, 2 minibatches, kl 0.05: RM score 0.20 -> 0.15, verifier 0.655 -> 0.435;
      lr 2e-5, mu 1, 1 minibatch, kl 0.2: 0.655 -> 0.615; lr 1e-5, mu 4, kl 0.05: 0.655 -> 0.455;
      lr 5e-5, kl 0.1, no advantage whitening: 0.655 -> 0.51; PPO's defaults (lr 3e-5, mu 4, kl 0.05) for
      40 steps, which take the verifier itself 65.5% -> ~73.5%: 0.655 -> 0.295. The RM score never rises: the pairs taught
      it what the policy already does (full, well-formed solutions), so its signal on the policy's samples
      is noise and PPO drifts.
    * For reference, PPO against the verifier itself on the 128-prompt pool: 0.655 -> 0.725 in 20 steps.
    """
    rm, _ = trained_rm
    policy = Policy.from_pretrained(WARM)
    ro = collect(TokenVectorEnv(256, task()), policy, seed=1)
    rm.normalize([s["prompt"] for s in ro.samples], ro.completions)
    eval_env, samples = TokenVectorEnv(200, task()), heldout_samples(task(), 200)
    before = evaluate(policy, eval_env, samples)["accuracy"]
    agent = PPOAgent(policy, PPOConfig(steps=20, lr=5e-5, mu=2, minibatches=2, kl_coef=0.05, seed=0))
    history = agent.learn(TokenVectorEnv(64, task(), reward=rm))
    after = evaluate(policy, eval_env, samples)["accuracy"]
    print(f"RM score {history[0]['objective/score']:.3f} -> {history[-1]['objective/score']:.3f}; "
          f"verifier greedy accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.05, (before, after)

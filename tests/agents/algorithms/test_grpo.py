"""GRPO: the toy env is learned; config validation; advantages wiring; reference/KL path."""

import importlib.util
import pathlib

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents.functional import AGGREGATIONS
from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig, grpo_advantages
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect

_spec = importlib.util.spec_from_file_location("_numerics", pathlib.Path(__file__).parents[1] / "_numerics.py")
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)
WIDEST = 352  # the tiny preset's widest layer (intermediate_size): the longest sum over features in a backward


def target_env(n=32, g=8):
    return gym.make_vec("tokengym/Target-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=g,
                        partial_credit=True, target="ok", max_new_tokens=2)


def test_grpo_learns_the_toy_target_from_chance():
    env = target_env(64)  # settings that escape the toy's 0.5 trap on every seed tried (see test_algorithms.CASES)
    agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=100, lr=1e-3, seed=0))
    history = agent.learn(env)
    first, last = history[0]["reward/mean"], max(r["reward/mean"] for r in history[-10:])
    assert first < 0.1, f"a random tiny model should be near chance, got {first}"
    assert last > 0.9, f"mean reward only reached {last}"


def test_first_ratio_is_one_and_kl_zero_at_reference():
    env = target_env(16, 8)
    policy = Policy.from_pretrained("tiny")
    agent = GRPOAgent(policy, GRPOConfig(steps=1, beta=0.1, lr=1e-12))
    history = agent.learn(env)
    # the policy equals pi_old and the reference: ratio 1, nothing clipped, KL 0
    assert history[0]["train/clipfrac"] == 0.0
    assert abs(history[0]["train/kl"]) < 1e-5


def test_process_advantages_run_end_to_end_and_place_step_rewards():
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4,
                       process_reward=True, max_new_tokens=12)
    policy = Policy.from_pretrained("tiny")
    ro = collect(env, policy, seed=0)
    adv = grpo_advantages(ro, "process", "group")
    step_rewards, step_ends = ro.step_rewards()
    assert adv.shape == ro.action_mask.shape and (adv[ro.action_mask == 0] == 0).all()
    assert ((step_ends >= 0).sum(1) == ro.step_end.sum(1)).all()
    agent = GRPOAgent(policy, GRPOConfig(steps=2, advantage="process"))
    assert len(agent.learn(env)) == 2


def test_outcome_advantages_are_group_normalised_on_every_action_token():
    env = target_env(16, 8)
    ro = collect(env, Policy.from_pretrained("tiny"), seed=1)
    adv = grpo_advantages(ro, "outcome", "group")
    per_seq = adv[:, 0]
    assert torch.allclose(per_seq.view(-1, 8).mean(1), torch.zeros(2), atol=1e-5)
    assert torch.equal(adv, per_seq[:, None].expand_as(adv) * ro.action_mask)


@pytest.mark.parametrize("field, value", [("mu", 0), ("advantage", "nope"), ("aggregation", "sum"), ("beta", -1.0)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**{field: value})


def test_env_without_groups_or_prm_is_rejected():
    policy = Policy.from_pretrained("tiny")
    env = gym.make_vec("tokengym/Target-v0", num_envs=4, vectorization_mode="vector_entry_point")
    with pytest.raises(ValueError, match="group_size >= 2"):
        GRPOAgent(policy).learn(env)
    with pytest.raises(ValueError, match="process reward"):
        GRPOAgent(policy, GRPOConfig(advantage="process")).learn(target_env(8, 4))


def test_logs_go_to_tensorboard_and_metrics_jsonl(tmp_path):
    import json

    agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=2), run_dir=str(tmp_path / "run"))
    agent.learn(target_env(16, 8))
    agent.logger.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for key in ("reward/mean", "reward/std", "reward/accuracy", "reward/frac_zero_std_groups", "train/entropy",
                "train/clipfrac_low", "train/clipfrac_high", "completion/length_mean", "completion/length_max",
                "completion/truncated_frac", "train/grad_norm", "perf/tokens_per_s", "time/rollout", "time/reward",
                "time/update"):
        assert key in lines[0], key
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))


# GRPO from the shipped warm start must raise held-out greedy accuracy: the README's `tokengym train grpo` (outcome,
# 64.5% -> 72.3%), its Agents script (the same through the API) and `--advantage process` (64.5% -> 71.5%), each run
# and checked by tests/test_readme.py.


def test_bf16_update_still_learns_the_toy():
    agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=100, lr=1e-3, seed=0, bf16=True))
    history = agent.learn(target_env(64))
    assert max(r["reward/mean"] for r in history[-10:]) > 0.9
    assert all(abs(r["train/ratio_mean"] - 1) < 0.05 for r in history)  # bf16 rounding only


def test_lr_schedule_follows_global_step_and_continues_after_a_resume():
    import io
    import math

    def fresh(seed=0):
        return GRPOAgent(Policy.from_pretrained("tiny", seed=seed), GRPOConfig(steps=4, lr=1e-3, lr_scheduler_type="cosine", seed=0))

    full = fresh().learn(target_env(16, 8))
    assert [r["train/lr"] for r in full] == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])
    env, b = target_env(16, 8), fresh()
    b.learn(env, callback=lambda rec: rec["step"] < 2)
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c, c_env = fresh(seed=1), target_env(16, 8)
    c.policy.model.load_state_dict(b.policy.model.state_dict())
    c.load_state_dict(torch.load(buf, weights_only=True))
    c_env.load_state_dict(env.state_dict())
    rest = c.learn(c_env)
    assert [r["train/lr"] for r in rest] == [r["train/lr"] for r in full[2:]]
    assert [r["reward/mean"] for r in rest] == [r["reward/mean"] for r in full[2:]]
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        GRPOConfig(lr_scheduler_type="step")


def test_passes_skip_columns_past_every_rows_end_without_changing_the_update(monkeypatch):
    """The update, reference and pi_old passes run on the used columns only (here the warm start's
    completions end before the budget, and the prompt buffer has a spare column left of the longest prompt),
    and every update's gradient equals that of full-width passes up to
    float32 rounding. The full-width run steps on the trimmed run's gradients (``numerics.Lockstep``), so both
    compute each update at the same weights; their weights after AdamW steps are not compared, as AdamW
    turns a rounding-level difference in a near-zero gradient entry into an O(lr) weight difference."""
    import tokengym.agents.algorithms.onpolicy_update as skeleton  # where the update looks the slicers up

    def run(full_width: bool, lockstep):
        if full_width:
            monkeypatch.setattr(skeleton, "used_slice", lambda ro, rows: (
                ro.tokens[rows], ro.attention_mask[rows], ro.prompt_len, ro.action_mask.shape[1]))
            monkeypatch.setattr(skeleton, "trimmed_logprobs", lambda fn, ro, masked=True: fn(ro.tokens, ro.attention_mask, ro.prompt_len))
        env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=16, vectorization_mode="vector_entry_point", group_size=8,
                           n_operands=(2, 3), digits=2)
        policy = Policy.from_pretrained("tiny-arithmetic")
        widths = []
        forward = policy.forward
        monkeypatch.setattr(policy, "forward", lambda tokens, *a, **kw: widths.append(tokens.shape[1]) or forward(tokens, *a, **kw))
        agent = GRPOAgent(policy, GRPOConfig(steps=2, beta=0.05, recompute_old_logprobs=True, lr=1e-4, seed=0))
        with lockstep:
            history = agent.learn(env)
        return widths, env, history

    trimmed = numerics.Lockstep()
    widths, env, hist = run(False, trimmed)
    full = env.max_prompt_len + env.max_new_tokens
    assert max(widths) < full, f"every pass ran at the full width {full}: {widths}"
    assert max(r["completion/length_max"] for r in hist) < env.max_new_tokens  # the premise: rows end before the budget
    untrimmed = numerics.Lockstep(replay=trimmed.steps)
    widths_full, _, _ = run(True, untrimmed)
    assert set(widths_full) == {full}
    # each gradient entry sums over at most the 16 rows x full-width tokens of the batch and WIDEST features
    numerics.assert_gradients_match(untrimmed.diffs, len(trimmed.steps), 16 * full * WIDEST, "full width vs trimmed")
    assert len(trimmed.steps) == 2 and all(any(g.any() for g in step) for step in trimmed.steps)


@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
def test_rows_with_zero_advantage_stay_out_of_the_backward_without_changing_the_update(monkeypatch, aggregation):
    """With beta=0, a group whose rewards are all equal has advantage 0 and adds nothing to the gradient:
    its rows run through the update's forward without autograd, and every update's gradient and logged
    statistics equal those of an update over every row up to float32 rounding, including the exactly-zero
    gradient on a batch where nothing is left to learn, on which AdamW still takes its momentum step. The
    all-rows run steps on the skipping run's gradients (``numerics.Lockstep``), so both compute each update at
    the same weights (comparing weights after AdamW steps would amplify rounding without bound). Under every
    aggregation: the skipped rows still count in its normalisers (tokens for token-mean, rows for the others)."""

    def run(skip: bool, lockstep):
        policy = Policy.from_pretrained("tiny-arithmetic")
        graded = []  # rows per forward that autograd records
        forward = policy.forward
        monkeypatch.setattr(policy, "forward", lambda tokens, *a, **kw: (
            torch.is_grad_enabled() and graded.append(tokens.shape[0])) or forward(tokens, *a, **kw))
        agent = GRPOAgent(policy, GRPOConfig(steps=3, lr=1e-4, seed=0, skip_zero_advantage=skip, aggregation=aggregation))
        # with subtraction, which the warm start rarely gets right, some groups score 0 throughout
        mixed = gym.make_vec("tokengym/Arithmetic-v0", num_envs=32, vectorization_mode="vector_entry_point", group_size=8,
                             n_operands=(2, 3), digits=2, operators="+-")
        with lockstep:
            history = agent.learn(mixed)
            before = [p.detach().clone() for p in policy.model.parameters()]
            # the arithmetic model never writes "ok": every reward and advantage is 0
            zero = gym.make_vec("tokengym/Target-v0", num_envs=16, vectorization_mode="vector_entry_point", group_size=8,
                                target="ok", max_new_tokens=4)
            zero.reset(seed=0)  # learn() seeds an env only at its first step
            history += agent.learn(zero)
        moved = any(not torch.equal(a, p) for a, p in zip(before, policy.model.parameters()))
        return graded, history, moved, mixed

    skipped = numerics.Lockstep()
    graded, hist, moved, env = run(True, skipped)
    every_row = numerics.Lockstep(replay=skipped.steps)
    graded_full, hist_full, _, _ = run(False, every_row)
    assert min(r["reward/frac_zero_std_groups"] for r in hist[:3]) > 0  # the premise: some groups have equal rewards
    assert 0 < len(graded) <= 3 and max(graded) < 32, graded  # no autograd on all-zero rows or steps
    assert graded_full == [32] * 3 + [16] * 3
    assert moved, "AdamW's momentum must still move the weights when every advantage is 0"
    # each gradient entry sums over at most 32 rows x full-width tokens and WIDEST features; an all-zero
    # gradient (the last 3 steps) must be matched exactly, with a gradient for every weight
    width = env.max_prompt_len + env.max_new_tokens
    numerics.assert_gradients_match(every_row.diffs, 6, 32 * width * WIDEST, "every row vs skipped rows")
    assert all(not g.any() for step in skipped.steps[3:] for g in step)
    for r, r_full in zip(hist, hist_full):
        for key in ("train/pg_loss", "train/entropy", "train/clipfrac", "train/grad_norm"):
            assert r[key] == pytest.approx(r_full[key], rel=1e-4, abs=1e-6), key


def test_a_step_with_nothing_to_learn_gives_frozen_weights_no_gradient():
    """An all-zero-advantage step fills in zero gradients as backward would: only for trainable weights, so a
    frozen base (LoRA) gets no full-size buffer and every rank all-reduces the same set of gradients."""
    policy = Policy.from_pretrained("tiny-arithmetic")
    frozen = policy.model.get_input_embeddings().weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    agent = GRPOAgent(policy, GRPOConfig(steps=1, seed=0))
    env = gym.make_vec("tokengym/Target-v0", num_envs=16, vectorization_mode="vector_entry_point", group_size=8,
                       target="ok", max_new_tokens=4)  # the arithmetic model never writes "ok": every advantage is 0
    record = agent.learn(env)[0]
    assert record["reward/mean"] == 0.0
    assert frozen.grad is None
    assert torch.equal(frozen, before)
    assert all(p.grad is not None and not p.grad.any() for p in policy.parameters() if p.requires_grad)


def test_gradient_checkpointing_recomputes_the_same_gradients():
    """``gradient_checkpointing=True`` keeps fewer activations and recomputes them in the backward: every update's
    gradient equals that of a run that keeps them (float32 rounding), stepping in lockstep."""

    def run(gc: bool, lockstep):
        env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=16, vectorization_mode="vector_entry_point", group_size=8)
        policy = Policy.from_pretrained("tiny-arithmetic")
        agent = GRPOAgent(policy, GRPOConfig(steps=2, lr=1e-4, seed=0, gradient_checkpointing=gc, skip_zero_advantage=False))
        assert policy.model.is_gradient_checkpointing == gc
        with lockstep:
            agent.learn(env)
        return env

    kept = numerics.Lockstep()
    env = run(False, kept)
    recomputed = numerics.Lockstep(replay=kept.steps)
    run(True, recomputed)
    full = env.max_prompt_len + env.max_new_tokens
    numerics.assert_gradients_match(recomputed.diffs, 2, 16 * full * WIDEST, "checkpointed vs kept activations")


def test_a_non_finite_loss_stops_training_before_the_weights_change():
    """A NaN in the loss (here forced into the policy term) ends learn() with one line naming the step, and no
    optimiser step is taken: the weights are those of the last update that was finite."""
    from tokengym.agents.algorithms.onpolicy import NonFiniteLoss

    env = gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4,
                       partial_credit=True)
    agent = GRPOAgent(Policy.from_pretrained("tiny", seed=0), GRPOConfig(steps=3, lr=1e-3, skip_zero_advantage=False))
    loss = agent.loss

    def poisoned(mb, batch):
        terms, stats = loss(mb, batch)
        if agent.global_step == 1:
            terms = [(terms[0][0] * float("nan"), terms[0][1]), *terms[1:]]
        return terms, stats

    agent.loss = poisoned
    before = {}  # the weights after step 1 (the callback runs after each step)
    with pytest.raises(NonFiniteLoss, match=r"^step 2: the loss is nan, so the update was not applied"):
        agent.learn(env, callback=lambda rec: before.update({k: v.clone() for k, v in agent.policy.model.state_dict().items()}))
    after = agent.policy.model.state_dict()
    assert agent.global_step == 1 and all(torch.equal(before[k], after[k]) for k in before)

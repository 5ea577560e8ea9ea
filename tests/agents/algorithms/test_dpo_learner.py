"""DPOLearner: completion-only sequence log-probs, reference paths, config validation, logging, and
tiny-model runs that must learn (bundled arithmetic pairs from the SFT warm start, every loss type,
iterative DPO on env groups)."""

import dataclasses
import importlib.util
import json
import math
import os
import pathlib

import pytest
import torch

from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.engine.models import build_preset
from tokengym.agents.algorithms.online_dpo import iterative_dpo
from tokengym.agents.data.pairs import PairData, arithmetic_pairs
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect, evaluate, heldout_samples
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask

_spec = importlib.util.spec_from_file_location("_numerics", pathlib.Path(__file__).parents[1] / "_numerics.py")
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)
WIDEST = 352  # the tiny preset's widest layer (intermediate_size): the longest sum over features in a backward

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "agents", "checkpoints", "tiny-arithmetic")
TASK = ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs():
    return arithmetic_pairs(TASK, 24, seed=0)


def random_policy(seed=1):
    return Policy(*build_preset("tiny", seed=seed))


# ------------------------------------------------------------------ sequence log-probs
def test_sequence_logps_equal_a_manual_sum_over_completion_tokens(pairs):
    policy = random_policy()
    data = PairData.from_pairs(pairs[:6], policy.tokenizer)
    batch = data.batch(torch.arange(6))
    with torch.no_grad():
        seq = DPOLearner.sequence_logps(policy, batch)
        for row in range(12):
            i, k = row % 6, row // 6
            p = data.prompts[i][data.prompt_mask[i]]
            c = data.completions[k, i, : int(data.completion_lens[k, i])]
            tokens = torch.cat([p, c])[None]  # no padding at all
            logp = policy(tokens, torch.ones_like(tokens, dtype=torch.bool), len(p))
            torch.testing.assert_close(seq[row], logp.sum(), atol=1e-4, rtol=1e-5)


def test_prompt_padding_and_padding_ids_do_not_change_sequence_logps(pairs):
    policy = random_policy()
    data = PairData.from_pairs(pairs[:8], policy.tokenizer)
    b = data.batch(torch.arange(8))
    extra = 5
    padded = PairData(torch.nn.functional.pad(data.prompts, (extra, 0), value=data.pad_id),
                      torch.nn.functional.pad(data.prompt_mask, (extra, 0), value=False),
                      data.completions, data.completion_lens, data.pad_id)
    b2 = padded.batch(torch.arange(8))
    b2.prompt_len += extra  # keep every extra padding column (batch() trims to the longest prompt)
    b2.tokens = torch.cat([torch.full((16, extra), data.pad_id), b2.tokens], 1)
    b2.mask = torch.cat([torch.zeros(16, extra, dtype=torch.bool), b2.mask], 1)
    garbage = b.tokens.clone()  # random ids wherever the mask is 0 (prompt-side and completion-side padding)
    garbage[~b.mask] = torch.randint(3, 90, (int((~b.mask).sum()),))
    b3 = type(b)(garbage, b.mask, b.completion_mask, b.prompt_len, b.index, b.num_tokens)
    with torch.no_grad():
        s1, s2, s3 = (DPOLearner.sequence_logps(policy, x) for x in (b, b2, b3))
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(s1, s3, atol=1e-4, rtol=1e-5)
    # a real prompt token does matter (the prompt is context, just not scored)
    b4 = type(b)(b.tokens.clone(), b.mask, b.completion_mask, b.prompt_len, b.index, b.num_tokens)
    b4.tokens[:, b.prompt_len - 2] = 60
    with torch.no_grad():
        assert not torch.allclose(DPOLearner.sequence_logps(policy, b4), s1)


def test_shared_prefix_packing_gives_the_same_logps_and_gradients(pairs):
    policy = Policy(*build_preset("tiny", seed=2), temperature=0.7)
    edge = [{"prompt": "1+1\n", "chosen": "A: 2", "rejected": "A: 2 and more"},  # the common prefix is all of chosen but EOS
            {"prompt": "1+1\n", "chosen": "xyz", "rejected": "abc"},  # nothing in common
            {"prompt": "3\n", "chosen": "A: 2 and more", "rejected": "A: 2"}]
    data = PairData.from_pairs(pairs[:13] + edge, policy.tokenizer)
    idx = torch.tensor([15, 3, 0, 14, 7, 13, 2, 9, 12, 1, 4, 5, 6, 8, 10, 11])
    stack, shared = data.batch(idx), data.shared_batch(idx)
    assert shared.tokens.numel() < stack.tokens.numel() and shared.tokens.shape[0] < len(idx)  # shared and packed
    params = list(policy.parameters())
    s1, s2 = DPOLearner.sequence_logps(policy, stack), DPOLearner.sequence_logps(policy, shared)
    torch.testing.assert_close(s1, s2, atol=2e-4, rtol=1e-5)
    w = torch.randn(len(s1))
    g1, g2 = torch.autograd.grad((w * s1).sum(), params), torch.autograd.grad((w * s2).sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    # every real token of every pair is present once (prompt and chosen in full, rejected after the common prefix)
    need = data.prompt_lens[idx] + data.completion_lens[0, idx] + data.completion_lens[1, idx] - data.common_prefix[idx]
    assert int((shared.pair >= 0).sum()) == int(need.sum())


def n_terms(pairs, policy, batch_size):
    """A bound on the float32 terms summed into one gradient entry: the tokens of a batch's 2 x batch_size
    sequences (each at most the longest prompt plus the longest completion) times the widest layer."""
    data = PairData.from_pairs(pairs, policy.tokenizer)
    return 2 * batch_size * (data.prompts.shape[1] + data.completions.shape[2]) * WIDEST


def test_share_prefix_training_matches_the_stack(pairs):
    """Prefix-shared, packed batches give every step the gradient and statistics of the plain stack up to
    float32 rounding. The packed run steps on the stack's gradients (``numerics.Lockstep``), so both compute
    each step at the same weights: comparing them after independent AdamW steps would amplify rounding."""
    hists, locks = [], []
    for share in (False, True):
        learner = DPOLearner(random_policy(), DPOConfig(batch_size=6, steps=3, lr=1e-3, share_prefix=share))
        locks.append(numerics.Lockstep(replay=locks[0].steps if locks else None))
        with locks[-1]:
            hists.append(learner.fit(pairs))
    assert learner.share_prefix and len(locks[0].steps) == 3
    numerics.assert_gradients_match(locks[1].diffs, 3, n_terms(pairs, learner.policy, 6), "shared prefix vs stack")
    for a, b in zip(*hists):
        for k in ("train/loss", "rewards/margins", "logps/chosen", "logps/rejected", "train/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-3), k


class _MaskDropping(torch.nn.Module):
    """A causal LM that ignores (``raises=False``) or rejects (``raises=True``) 4D attention masks."""

    def __init__(self, inner, raises):
        super().__init__()
        self.inner, self.raises = inner, raises

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, **kw):
        if attention_mask is not None and attention_mask.dim() == 4:
            if self.raises:
                raise ValueError("4D attention masks are not supported")
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)


def test_share_prefix_default_is_on_only_where_the_packed_path_is_verified(pairs):
    assert DPOLearner(random_policy()).share_prefix is True  # Llama (the presets) honours 4D masks
    for raises in (False, True):
        p = random_policy()
        policy = Policy(_MaskDropping(p.model, raises), p.tokenizer)
        learner = DPOLearner(policy, DPOConfig(batch_size=4, steps=1))
        assert learner.share_prefix is False, raises
        assert len(learner.fit(pairs[:4])) == 1  # trains on the plain stack
    assert DPOLearner(policy, DPOConfig(share_prefix=True)).share_prefix  # an explicit setting is not second-guessed


def test_lora_policy_trains_against_its_adapter_disabled_base(pairs):
    peft = pytest.importorskip("peft")
    from tokengym.agents.engine.policy import AdapterDisabledReference

    base = random_policy()
    data = PairData.from_pairs(pairs[:8], base.tokenizer)
    stack, packed = data.batch(torch.arange(8)), data.shared_batch(torch.arange(8))
    with torch.no_grad():
        base_seq = DPOLearner.sequence_logps(base, stack)
    lora = peft.get_peft_model(base.model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # B = 0: starts at the base
    policy = Policy(lora, base.tokenizer)
    learner = DPOLearner(policy, DPOConfig(batch_size=4, steps=6, lr=3e-2))
    # the reference is the policy's own model with its adapter off: no second copy of the weights, nothing of its own to save
    assert isinstance(learner.ref, AdapterDisabledReference) and learner.ref.policy is policy
    assert set(learner.checkpoint_modules()) == {"policy"} and learner.share_prefix
    first = learner.fit(pairs[:16])
    assert first[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-5) and first[-1]["rewards/margins"] > 0
    policy.train()
    for batch in (stack, packed):
        torch.testing.assert_close(learner._ref_batch(batch, None), base_seq, atol=1e-4, rtol=1e-5)
    assert policy.training  # the reference pass restores the shared model's mode (and its adapter)
    with torch.no_grad():
        assert not torch.allclose(DPOLearner.sequence_logps(policy, stack), base_seq, atol=1e-2)  # only the adapter trained
    assert all("lora_" in n for n, p in policy.named_parameters() if p.requires_grad)


def test_precomputed_reference_equals_live_reference(pairs):
    torch.manual_seed(0)
    live = DPOLearner(random_policy(), DPOConfig(batch_size=5, steps=4, shuffle=True, lr=1e-3, seed=3))
    pre = DPOLearner(random_policy(), DPOConfig(batch_size=5, steps=4, shuffle=True, lr=1e-3, seed=3, precompute_ref=True))
    assert pre.ref is None and live.ref is not None
    data = live.prepare(pairs)
    cached = pre.reference_logps(data, batch_size=7)  # different batching than training
    for idx in (torch.arange(5), torch.tensor([3, 17, 9, 20])):
        b = data.batch(idx)
        torch.testing.assert_close(live._ref_batch(b, None), pre._ref_batch(b, cached), atol=1e-4, rtol=1e-5)
    # the precomputed run steps on the live run's gradients (numerics.Lockstep), so both compute each step at
    # the same weights and differ by rounding alone (independent AdamW steps would amplify it without bound)
    with numerics.Lockstep() as lock_live:
        h_live = live.fit(data)
    with numerics.Lockstep(replay=lock_live.steps) as lock_pre:
        h_pre = pre.fit(data)
    numerics.assert_gradients_match(lock_pre.diffs, 4, n_terms(pairs, live.policy, 5), "precomputed vs live reference")
    for a, b in zip(h_live, h_pre):
        for k in ("train/loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert a[k] == pytest.approx(b[k], abs=1e-4), k
    # the cache was computed before the first update: it still equals the (unchanged) live reference
    torch.testing.assert_close(live.reference_logps(data), cached, atol=1e-4, rtol=1e-5)


def test_first_step_is_at_the_reference(pairs):
    learner = DPOLearner(random_policy(), DPOConfig(batch_size=8, steps=1))
    rec = learner.fit(pairs)[0]
    assert rec["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rec["rewards/chosen"] == 0 and rec["rewards/rejected"] == 0 and rec["rewards/accuracies"] == 0


def test_ipo_uses_length_averaged_logps(pairs):
    policy = random_policy()
    learner = DPOLearner(policy, DPOConfig(loss_type="ipo", beta=0.5))
    data = learner.prepare(pairs[:4])
    b = data.batch(torch.arange(4))
    with torch.no_grad():
        policy.model.lm_head.weight.mul_(1.5)  # move the policy away from the reference
        loss, stats = learner._loss(b, learner._ref_batch(b, None))
        seq, ref = DPOLearner.sequence_logps(policy, b), DPOLearner.sequence_logps(learner.ref, b)
    n = b.completion_lens.float()
    h = (seq[:4] / n[:4] - ref[:4] / n[:4]) - (seq[4:] / n[4:] - ref[4:] / n[4:])
    assert loss.item() == pytest.approx(((h - 1 / (2 * 0.5)) ** 2).mean().item(), rel=1e-4)


# ------------------------------------------------------------------ config, logging, API
@pytest.mark.parametrize("kw, match", [
    ({"beta": 0.0}, "beta"), ({"loss_type": "kto"}, "loss_type"), ({"label_smoothing": 0.1, "loss_type": "ipo"}, "label_smoothing"),
    ({"label_smoothing": 0.5}, "label_smoothing"), ({"batch_size": 0}, "batch_size"), ({"lr": -1.0}, "lr"),
    ({"lr_scheduler_type": "step"}, "lr_scheduler_type"), ({"max_prompt_len": 10, "max_length": 10}, "max_prompt_len"), ({"log_every": 0}, "log_every"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        DPOConfig(**kw)


def test_config_fields_have_docstrings():
    from tokengym.agents.runtime.config_io import field_docs

    docs = field_docs(DPOConfig)  # the shared fields' docstrings are their base's (tokengym.rewards.training)
    fields = [f.name for f in dataclasses.fields(DPOConfig)]
    assert all(docs.get(f) for f in fields) and len(fields) >= 15


def test_logging_metrics_jsonl_and_eval(tmp_path, pairs):
    learner = DPOLearner(random_policy(), DPOConfig(batch_size=8, steps=4, log_every=2, eval_every=2, lr=1e-3), run_dir=str(tmp_path))
    env = TokenVectorEnv(4, TASK, tokenizer=learner.policy.tokenizer)
    hist = learner.fit(pairs[:16], eval_pairs=pairs[16:], eval_env=env, eval_samples=heldout_samples(TASK, 4))
    train = [r for r in hist if "train/loss" in r]
    evals = [r for r in hist if "eval/loss" in r]
    assert [r["step"] for r in train] == [2, 4] and [r["step"] for r in evals] == [2, 4]
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
              "perf/tokens_per_s", "perf/pairs_per_s", "train/grad_norm", "train/lr", "epoch"):
        assert k in train[0] and math.isfinite(train[0][k]), k
    assert "eval/rewards/accuracies" in evals[-1] and "eval/accuracy" in evals[-1]
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert len(lines) == len(hist) and any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))


def test_steps_cycle_epochs_and_callback_stops(pairs):
    learner = DPOLearner(random_policy(), DPOConfig(batch_size=10, steps=7))  # 24 pairs: 3 batches per epoch
    hist = learner.fit(pairs)
    assert len(hist) == 7 and learner.global_step == 7 and hist[-1]["epoch"] == pytest.approx(2 + 1 / 3)
    seen = []
    learner.fit(pairs, callback=lambda r: seen.append(r) or len(seen) < 2)
    assert len(seen) == 2 and learner.global_step == 9


def test_pairs_from_jsonl_and_an_explicit_reference(tmp_path, pairs):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({k: p[k] for k in ("prompt", "chosen", "rejected")}) for p in pairs))
    ref_model = build_preset("tiny", seed=7)[0]
    learner = DPOLearner(random_policy(), DPOConfig(batch_size=12, steps=1), ref=ref_model)
    rec = learner.fit(str(path))[0]
    assert rec["train/loss"] != pytest.approx(math.log(2))  # the reference is not the policy
    assert not any(p.requires_grad for p in learner.ref.parameters())
    pre = DPOLearner(random_policy(), DPOConfig(precompute_ref=True))
    with pytest.raises(ValueError, match="ref_logps"):
        pre.evaluate_pairs(pairs)


# ------------------------------------------------------------------ must learn
@pytest.fixture(scope="module")
def warm_start():
    if os.path.isdir(CHECKPOINT):
        return CHECKPOINT
    pytest.skip("the SFT warm-start checkpoint agents/checkpoints/tiny-arithmetic is missing")


def test_evaluation_between_updates_sees_the_new_weights(pairs):
    # the policy's fast decoder caches fused weights keyed on the parameters' version counters: the
    # learner's optimiser must bump them, or a greedy evaluation after training would use stale weights
    policy = random_policy()
    env = TokenVectorEnv(4, TASK, tokenizer=policy.tokenizer, max_new_tokens=8)
    samples = heldout_samples(TASK, 4)
    from tokengym.agents.engine.rollout import collect

    collect(env, policy, greedy=True, samples=samples)  # builds the fast decoder's weight cache
    DPOLearner(policy, DPOConfig(batch_size=8, steps=3, lr=3e-2)).fit(pairs)
    fresh = Policy(policy.model, policy.tokenizer)
    a, b = (collect(env, p, greedy=True, samples=samples) for p in (policy, fresh))
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("loss_type, ls", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)])
def test_every_loss_trains_stably(loss_type, ls):
    train = arithmetic_pairs(TASK, 256, seed=5)
    beta = 0.1 if loss_type != "ipo" else 0.5
    learner = DPOLearner(random_policy(3), DPOConfig(loss_type=loss_type, label_smoothing=ls, beta=beta, lr=1e-3, batch_size=16,
                                                     epochs=2, share_prefix=True))
    hist = learner.fit(train)
    assert len(hist) == 32
    for r in hist:
        assert all(math.isfinite(v) for v in r.values()), r
    margins = [r["rewards/margins"] for r in hist]
    early, late = sum(margins[:4]) / 4, sum(margins[-4:]) / 4
    assert late > max(early, 0.0) + 0.05, (loss_type, margins)
    assert sum(r["rewards/accuracies"] for r in hist[-4:]) / 4 > 0.6


def test_dpo_positive_only_penalises_a_chosen_likelihood_below_the_reference(pairs):
    policy = random_policy()
    plain = DPOLearner(policy, DPOConfig())
    dpop = DPOLearner(policy, DPOConfig(dpop_lambda=5.0), ref=plain.ref)
    b = plain.prepare(pairs[:8]).batch(torch.arange(8))
    with torch.no_grad():
        ref = plain._ref_batch(b, None)
        for shift in (-2.0, 2.0):  # chosen log-probs below / above the reference
            fake = ref.clone()
            fake[:8] -= shift  # the "reference" for the chosen rows
            l0, s0 = plain._loss(b, fake)
            l1, s1 = dpop._loss(b, fake)
            assert s1["rewards/chosen"] == pytest.approx(s0["rewards/chosen"].item())  # logged rewards are plain DPO's
            if shift < 0:  # policy chosen < reference chosen: penalised
                assert l1.item() > l0.item() + 0.1
            else:
                assert l1.item() == pytest.approx(l0.item())


# ------------------------------------------------------------------ must learn (from the SFT warm start)
HELDOUT = heldout_samples(TASK, 256)


@pytest.mark.parametrize("dpop_lambda, lr", [(0.0, 3e-5), (5.0, 1e-4)])
def test_bundled_pairs_from_the_warm_start(warm_start, dpop_lambda, lr):
    policy = Policy.from_pretrained(warm_start)
    env = TokenVectorEnv(256, TASK, tokenizer=policy.tokenizer)
    before = evaluate(policy, env, HELDOUT)["accuracy"]
    held = {s["prompt"] for s in HELDOUT}
    train = arithmetic_pairs(TASK, 1024, seed=1, exclude_prompts=held)
    val = arithmetic_pairs(TASK, 256, seed=2, exclude_prompts=held | {p["prompt"] for p in train})
    learner = DPOLearner(policy, DPOConfig(lr=lr, batch_size=16, dpop_lambda=dpop_lambda))
    hist = learner.fit(train, eval_pairs=val)
    ev = hist[-1]
    assert ev["eval/rewards/accuracies"] > 0.9 and ev["eval/rewards/margins"] > 0
    after = evaluate(policy, env, HELDOUT)["accuracy"]
    # 0.645 before. Plain DPO at lr 3e-5: 0.68-0.71 over shuffle seeds 0-3 (0.711 here); at lr 1e-4 it stays flat
    # (0.61-0.66: one-digit pairs, likelihood displacement), where DPO-Positive keeps the chosen likelihood up and gains 6-7 points
    assert after >= before + 0.03, (before, after)


def test_iterative_dpo_improves_the_env_reward(warm_start):
    policy = Policy.from_pretrained(warm_start, seed=0)
    env = TokenVectorEnv(256, TASK, tokenizer=policy.tokenizer, group_size=8)
    probe = TokenVectorEnv(1024, TASK, tokenizer=policy.tokenizer, group_size=8)
    fixed = HELDOUT[:128]  # the same 128 prompts x 8 samples (same sampler seed) before and after

    def sampled_reward():
        policy.seed(123)
        return collect(probe, policy, samples=fixed).outcome.mean().item()

    before = sampled_reward()
    learner = DPOLearner(policy, DPOConfig(lr=1e-4, batch_size=16, share_prefix=True, dpop_lambda=5.0))
    records = iterative_dpo(learner, env, rounds=2, batches_per_round=4)
    assert [r["round"] for r in records] == [0, 1] and all(r["pairs/count"] > 20 for r in records)
    assert all(0 <= r["pairs/skipped_groups_frac"] < 1 for r in records)
    after = sampled_reward()
    assert after >= before + 0.025, (before, after)  # seeds 0/1/2: +0.052 / +0.044 / +0.046

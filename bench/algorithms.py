"""Every on-policy algorithm from the same warm start on Arithmetic, with the same wall-clock training budget.

    python bench/algorithms.py --json [--seconds 300] [--seeds 0 1] [--only grpo rloo] [--eval-seconds 15]

Each algorithm runs with its registered defaults (and its preset, for the GRPO presets) from the shipped
``tiny-arithmetic`` checkpoint on ``tokengym/Arithmetic-v0``: 64 episodes per step (8 prompts x 8 for the
critic-free ones, 64 x 1 for PPO), 1 thread, each in a fresh process (``bench/_isolate.py``); the algorithms run
one after another, and an algorithm's seeds run side by side (one process per core on a 2-core machine), so every
algorithm meets the same load. Greedy accuracy on 200 held-out prompts is measured after the first step past every
``--eval-seconds`` of training and at the end (evaluation time is excluded from the budget). The JSON line has ``acc_<name>`` (accuracy at the end of the budget, averaged over the seeds),
``t10_<name>`` (training seconds until accuracy first reached the start + 10 points; null if never) and the
per-seed values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ALGOS = {  # name -> (registry algorithm, preset)
    "grpo": ("grpo", None), "dr-grpo": ("grpo", "dr-grpo"), "dapo": ("grpo", "dapo"), "gspo": ("grpo", "gspo"),
    "kl-cov": ("grpo", "kl-cov"), "rloo": ("rloo", None), "reinforce-pp": ("reinforce-pp", None), "ppo": ("ppo", None),
}


def one(name: str, seconds: float, seed: int, eval_seconds: float) -> dict:
    import torch

    torch.set_num_threads(1)
    import gymnasium as gym

    import tokengym.envs  # noqa: F401
    from tokengym.agents import Policy
    from tokengym.agents.algorithms.registry import algorithms
    from tokengym.agents.engine.rollout import heldout_samples
    from _measure import accuracy_curve

    algo, preset = ALGOS[name]
    spec = algorithms()[algo]
    cfg = spec.config_cls(**{**spec.presets.get(preset or "", {}), "steps": 10_000, "seed": seed, "eval_every": 0})
    prompts, g = spec.rollout
    policy = Policy.from_pretrained("tiny-arithmetic", seed=seed)
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=prompts * g, vectorization_mode="vector_entry_point", group_size=g)
    eval_env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=200, vectorization_mode="vector_entry_point")
    samples = heldout_samples(eval_env.task, 200)
    agent = spec.agent(policy, cfg)

    run = accuracy_curve(agent, env, eval_env, samples, seconds, eval_seconds)
    curve = run["curve"]
    start = curve[0][1]
    t10 = next((t for t, a in curve if a >= start + 0.10 - 1e-9), None)
    return {"start": start, "final": curve[-1][1], "t10": t10, "steps": agent.global_step, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--only", nargs="+", choices=sorted(ALGOS))
    ap.add_argument("--eval-seconds", type=float, default=15.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.seconds, a.seed, a.eval_seconds)))
        return
    from concurrent.futures import ThreadPoolExecutor

    from _isolate import run_child

    out: dict = {"seconds": a.seconds, "seeds": a.seeds}
    for name in a.only or ALGOS:
        with ThreadPoolExecutor(len(a.seeds)) as pool:
            runs = list(pool.map(lambda s: run_child(__file__, ["--one", name, "--seed", str(s), "--seconds", str(a.seconds),
                                                                "--eval-seconds", str(a.eval_seconds)]), a.seeds))
        out[f"acc_{name}"] = sum(r["final"] for r in runs) / len(runs)
        t10 = [r["t10"] for r in runs]
        out[f"t10_{name}"] = None if None in t10 else sum(t10) / len(t10)
        out[f"per_seed_{name}"] = [{k: r[k] for k in ("start", "final", "t10", "steps", "curve")} for r in runs]
        if not a.json:
            print(name, out[f"acc_{name}"], out[f"t10_{name}"], [(r["final"], r["t10"], r["steps"]) for r in runs], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""SPIN on ``tokengym/Arithmetic-v0`` from the shipped ``tiny-arithmetic`` warm start: held-out accuracy per round.

    python bench/spin_rounds.py [--seeds 0 1] [--rounds 3] [--prompts 512] [--lr 1e-5] [--threads 1]

For each seed: the warm start, ``spin(DPOLearner(policy, SPINConfig(...)), env)`` with greedy accuracy on the 256
held-out prompts (``heldout_samples``, never trained on) after every round. Prints one JSON line: the config and,
per seed, the accuracy before and after each round, the pairs per round and the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from tokengym.agents import Policy
from tokengym.agents.algorithms.dpo import DPOLearner
from tokengym.agents.algorithms.online_dpo import SPINConfig, spin
from tokengym.agents.engine.rollout import evaluate, heldout_samples
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask


def run(cfg: SPINConfig) -> dict:
    policy = Policy.from_pretrained("tiny-arithmetic")
    task = ArithmeticTask()  # Arithmetic-v0's task, the one tiny-arithmetic was trained on
    env = TokenVectorEnv(256, task, tokenizer=policy.tokenizer)
    held = heldout_samples(task, 256)
    t0 = time.perf_counter()
    before = evaluate(policy, env, held)["accuracy"]
    records = spin(DPOLearner(policy, cfg), env, eval_env=env, eval_samples=held)
    return {"seed": cfg.seed, "accuracy": [before] + [r["eval/accuracy"] for r in records],
            "pairs": [int(r["pairs/count"]) for r in records], "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=512, help="prompts per round")
    p.add_argument("--lr", type=float, default=SPINConfig.lr)
    p.add_argument("--beta", type=float, default=SPINConfig.beta)
    p.add_argument("--epochs", type=int, default=SPINConfig.epochs)
    p.add_argument("--batch-size", type=int, default=SPINConfig.batch_size)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = SPINConfig(lr=a.lr, beta=a.beta, epochs=a.epochs, batch_size=a.batch_size, rounds=a.rounds, prompts_per_round=a.prompts)
    runs = [run(dataclasses.replace(base, seed=s)) for s in a.seeds]
    keys = ("lr", "beta", "epochs", "batch_size", "rounds", "prompts_per_round", "loss_type")
    print(json.dumps({"env": "tokengym/Arithmetic-v0", "model": "tiny-arithmetic", "heldout": 256, "threads": a.threads,
                      "config": {k: getattr(base, k) for k in keys}, "runs": runs}))


if __name__ == "__main__":
    main()

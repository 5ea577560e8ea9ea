"""On-policy distillation against GRPO from the same start, at equal training time.

    python bench/distill.py --json [--parts arith smollm2] [--seconds 600] [--seeds 0 1 2] [--teacher DIR]
                                   [--smollm2-teacher RUN] [--smollm2-seconds 300]

``arith``: the student is the shipped ``tiny-arithmetic`` on ``tokengym/Arithmetic-v0`` (char tokenizer), the teacher
a ``small``-preset model supervised on the same task to at least 85% held-out greedy accuracy (``--teacher``; made
by the SFT recipe below into ``runs/bench-distill-teacher`` when missing). GRPO (its registered defaults) and
distillation (``DistillConfig`` defaults: the sampled estimator, no outcome reward) each train for ``--seconds`` per
seed, 8 prompts x 8 per step, 1 thread, each run in a fresh process (``bench/_isolate.py``), two runs side by side
(one per core on a 2-core machine), so every run meets the same load. Greedy accuracy on 200 held-out prompts
is measured after the first step past every ``--eval-seconds`` of training (evaluation time excluded). The JSON line
has ``time_ratio_to_grpo``: for each seed, the training seconds distillation needed to reach that seed's GRPO accuracy
at the end of the budget, over the budget, averaged over seeds (null when a seed never reached it), the goal being at
most 1/3; and both curves per seed.

``smollm2``: SmolLM2-135M-Instruct on chat sums (the README's GRPO recipe), the student the base model with LoRA r=16
on every projection (lr 1e-4), the teacher a GRPO-trained SmolLM2 run folder (``--smollm2-teacher``, e.g. the
README's ``runs/smollm2-grpo``). Distillation and GRPO alone train side by side for ``--smollm2-seconds`` each;
``smollm2_gain_per_min_*`` is the held-out accuracy gain (200 prompts) per training minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TEACHER_RUN = "bench-distill-teacher"
TEACHER_RECIPE = ["train", "sft", "--model", "small", "--steps", "800", "--lr", "1e-3", "--warmup-steps", "50",
                  "--lr-scheduler-type", "cosine", "--eval-every", "50", "--eval-prompts", "256",
                  "--stop-at-accuracy", "0.9", "--threads", "1", "--seed", "0", "--name", TEACHER_RUN]
"""The teacher's supervised recipe (``tokengym`` arguments): the small preset, cosine lr 1e-3 over 800 steps of 64,
stopping at the first evaluation of at least 90%."""
SMOL_ENV = {"chat": True, "n_operands": 2, "digits": [1, 2], "max_new_tokens": 32}


def _curve_run(agent, env, eval_env, samples, seconds: float, eval_seconds: float) -> dict:
    """:func:`accuracy_curve`, with distillation's last logged reverse KL, teacher log-prob and length."""
    from _measure import accuracy_curve

    out = accuracy_curve(agent, env, eval_env, samples, seconds, eval_seconds)
    keep = ("train/reverse_kl", "train/teacher_logp", "completion/length_mean")
    out["last"] = {k: v for k, v in agent.logger.history[-1].items() if k in keep}
    return out


def one_arith(algo: str, seconds: float, seed: int, eval_seconds: float, teacher: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import gymnasium as gym

    import tokengym.envs  # noqa: F401
    from tokengym.agents import DistillAgent, DistillConfig, GRPOAgent, GRPOConfig, Policy
    from tokengym.agents.engine.rollout import heldout_samples

    policy = Policy.from_pretrained("tiny-arithmetic", seed=seed)
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=64, vectorization_mode="vector_entry_point", group_size=8)
    eval_env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=200, vectorization_mode="vector_entry_point")
    samples = heldout_samples(eval_env.task, 200)
    if algo == "grpo":
        agent = GRPOAgent(policy, GRPOConfig(steps=100_000, seed=seed, eval_every=0))
    else:
        agent = DistillAgent(policy, DistillConfig(steps=100_000, seed=seed, eval_every=0, teacher=teacher))
    return _curve_run(agent, env, eval_env, samples, seconds, eval_seconds)


def one_smol(algo: str, seconds: float, seed: int, eval_seconds: float, teacher: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import gymnasium as gym
    import peft

    import tokengym.envs  # noqa: F401
    from tokengym.agents import DistillAgent, DistillConfig, GRPOAgent, GRPOConfig, Policy
    from tokengym.agents.engine.rollout import heldout_samples

    base = Policy.from_pretrained("smollm2-135m-instruct", seed=seed)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"])
    policy = Policy(peft.get_peft_model(base.model, lora), base.tokenizer)
    make = lambda n, g=1: gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point",  # noqa: E731
                                       group_size=g, tokenizer=policy.tokenizer, **SMOL_ENV)
    env, eval_env = make(16, 8), make(100)
    samples = heldout_samples(eval_env.task, 200)
    cls, cfg = (GRPOAgent, GRPOConfig) if algo == "grpo" else (DistillAgent, DistillConfig)
    extra = {} if algo == "grpo" else {"teacher": teacher}
    agent = cls(policy, cfg(steps=100_000, lr=1e-4, seed=seed, eval_every=0, **extra))
    return _curve_run(agent, env, eval_env, samples, seconds, eval_seconds)


def teacher_folder(path: str | None) -> tuple[str, float]:
    """The arith teacher's model folder and its held-out greedy accuracy (256 prompts); trained when missing."""
    import torch

    from tokengym.agents import Policy
    from tokengym.agents.algorithms.sft import evaluate_policy
    from tokengym.envs.tasks import ArithmeticTask

    folder = path or os.path.join("runs", TEACHER_RUN, "model")
    if not os.path.isdir(folder):
        if path:
            raise SystemExit(f"--teacher {path}: no such folder")
        subprocess.run(["tokengym", *TEACHER_RECIPE], check=True)
    torch.set_num_threads(2)
    acc = evaluate_policy(Policy.from_pretrained(folder), ArithmeticTask(n_operands=(2, 3), digits=2, operators="+"), n=256)["accuracy"]
    return folder, float(acc)


def _two_at_a_time(jobs: list[list[str]]) -> list[dict]:
    """Each job (``bench/distill.py`` arguments) in a fresh process, two side by side (one per core): every job
    meets the same load, another 1-thread trainer."""
    from concurrent.futures import ThreadPoolExecutor

    from _isolate import run_child

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda argv: run_child(__file__, argv), jobs))


def reach_time(curve: list, target: float) -> float | None:
    """The first training time at which ``curve`` reaches ``target`` (None: never)."""
    return next((t for t, a in curve if a >= target - 1e-9), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["arith", "smollm2"], choices=["arith", "smollm2"])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-seconds", type=float, default=30.0)
    ap.add_argument("--teacher")
    ap.add_argument("--smollm2-teacher", default=os.path.join("runs", "smollm2-grpo"))
    ap.add_argument("--smollm2-seconds", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--arith", help=argparse.SUPPRESS)
    ap.add_argument("--smol", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arith:
        print(json.dumps(one_arith(a.arith, a.seconds, a.seed, a.eval_seconds, a.teacher)))
        return
    if a.smol:
        print(json.dumps(one_smol(a.smol, a.smollm2_seconds, a.seed, a.eval_seconds, a.smollm2_teacher)))
        return
    out: dict = {"seconds": a.seconds, "seeds": a.seeds}
    if "arith" in a.parts:
        folder, acc = teacher_folder(a.teacher)
        out["teacher"], out["teacher_accuracy"] = folder, acc
        args = ["--seconds", str(a.seconds), "--eval-seconds", str(a.eval_seconds), "--teacher", folder]
        jobs = [(algo, seed) for algo in ("grpo", "distill") for seed in a.seeds]
        done = dict(zip(jobs, _two_at_a_time([["--arith", algo, "--seed", str(seed), *args] for algo, seed in jobs])))
        runs = {algo: [done[algo, seed] for seed in a.seeds] for algo in ("grpo", "distill")}
        ratios = []
        for g, d in zip(runs["grpo"], runs["distill"]):
            t = reach_time(d["curve"], g["final"])
            ratios.append(None if t is None else t / a.seconds)
        out["time_ratio_to_grpo"] = None if None in ratios else sum(ratios) / len(ratios)
        out["time_ratio_per_seed"] = ratios
        for algo, rs in runs.items():
            out[f"acc_{algo}"] = sum(r["final"] for r in rs) / len(rs)
            out[f"per_seed_{algo}"] = rs
        if not a.json:
            print("arith", {k: out[k] for k in ("teacher_accuracy", "time_ratio_to_grpo", "time_ratio_per_seed", "acc_grpo", "acc_distill")}, flush=True)
    if "smollm2" in a.parts:
        if not os.path.isdir(a.smollm2_teacher):
            raise SystemExit(f"--smollm2-teacher {a.smollm2_teacher}: no such run folder (train it with the README's "
                             "SmolLM2 GRPO command)")
        args = ["--smollm2-seconds", str(a.smollm2_seconds), "--eval-seconds", str(a.smollm2_seconds / 2),
                "--smollm2-teacher", a.smollm2_teacher, "--seed", str(a.seeds[0])]
        smol = dict(zip(("grpo", "distill"), _two_at_a_time([["--smol", algo, *args] for algo in ("grpo", "distill")])))
        for algo, r in smol.items():
            train_min = r["curve"][-1][0] / 60
            out[f"smollm2_gain_per_min_{algo}"] = (r["final"] - r["start"]) / train_min
            out[f"smollm2_{algo}"] = r
        if not a.json:
            print("smollm2", {k: v for k, v in out.items() if k.startswith("smollm2_gain")}, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

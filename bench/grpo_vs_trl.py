"""GRPO seconds per step: tokengym's GRPOAgent vs TRL's GRPOTrainer, measured in the same run.

    pip install -e ".[bench]"          # trl
    python bench/grpo_vs_trl.py --json [--steps 12] [--repeats 3] [--race-seconds 600]

Equal work: the same preset model (random init, so both always generate the full completion
length), the same Arithmetic prompts and reward function (`tokengym.rewards.arithmetic_correct`),
group size 8, 2 prompts per step (16 completions), the same completion length, mu=1 (TRL's
num_iterations=1), beta=0 (no reference model), every row in the update (``skip_zero_advantage=False``: see
:data:`EQUAL_WORK`), lr 1e-4, temperature 1, fp32, CPU. Seconds per step
is the median over steps after 2 warm-up steps. ``tiny_speedup``/``small_speedup`` = TRL seconds per
step / tokengym seconds per step (both fp32); ``*_speedup_bf16`` compares both with ``bf16=True``
(tokengym: bf16 autocast in the rollout, whose fast decoder then multiplies bf16 weights, and in the
update; TRL: ``bf16=True`` with ``use_cpu=True``, i.e. accelerate's CPU bf16 autocast over training and
generation; TRL's model keeps ``transformers``' sdpa attention, while tokengym's ``Policy`` attends in fp32
under CPU autocast, see ``tokengym.agents.engine.models.ATTENTION``). Each contender runs in a fresh process (``bench/_isolate.py``: one library's leftovers slowed the next by ~10%); ``--repeats`` reruns the four in rotating order.
The small preset's step is mostly the same arithmetic in both (tokengym fp32: 1.27 s update at the matmul
peak, 0.62 s rollout bound by reading the weights once per token), which caps its fp32 ratio.

The race (tiny only): both start from the shipped warm checkpoint ``agents/checkpoints/tiny-arithmetic``
(65.5% on the 200 held-out prompts) and train until greedy accuracy on those prompts first reaches 90%
or ``--race-seconds`` of training pass (evaluated about every ``--race-eval-prompts`` training prompts
with the same tokengym evaluator for both; evaluation time excluded). Each decays its learning rate to 0
over its own schedule:

* TRL as the issue describes it: G=8, 2 prompts per step, lr 1e-4, ``loss_type="grpo"``, and TRL's
  default linear decay over ``max_steps`` (3,200 steps, 6,400 prompts).
* tokengym with :data:`RACE_TOKENGYM`: G=8, 32 prompts per step, lr 2e-4, ``lr_scheduler_type="cosine"`` over
  300 steps (9,600 prompts); the best of the settings below.

What was found (2026-12-02/03, tiny, 1 thread): from this checkpoint, greedy held-out accuracy under a
*constant* lr 1e-4 hovers at 70-77% for both libraries however long they train, and that level does
not depend on where training starts: from an SFT model at 83.5% (``sft --steps 600``, the same
recipe run to the end of its cosine) tokengym (8 prompts per step) fell to 67% by step 30 and then
hovered at 73-80% to step 270, and TRL (2 prompts per step) fell to 54% (best 63.5%) in 583 steps; at
lr 2e-5 tokengym kept it at 80-85% (8 prompts, 300 steps) and 83-86.5% (32 prompts, 30 steps), without
a gain. The update noise of 16-256 samples per step keeps flipping greedy
answers (late in a 1,200-step cosine, with lr < 2.5e-6 and at most 0.3% weight change, the shipped
warm start still moved between 72% and 84%), and the warm start's errors are carries, which the model
must learn from a 0/1 reward (SFT on reference solutions takes it from 64.5% to 88.7% in 150 steps).
A decaying lr lets it settle higher, and more prompts per step help a little (ends of cosine runs,
tokengym: 8 prompts lr 1e-4 over 800 steps 83-86%; 32 prompts lr 2e-4 over 300 steps 87-88%; 32
prompts lr 1.5e-4 over 400 steps 86-87%; 64 prompts lr 2e-4 over 200 steps 87.5%; 64 prompts lr
3e-4 over 150 steps 83.5%). lr >= 3e-4 with 8 prompts collapses it (30% after 10 steps), and process
supervision, temperature 0.5-0.7, G=4/16, mu=2, token-mean aggregation, ``scale_rewards="none"``,
Adam beta1=0.98 or eps=1e-3, SGD with momentum (lr 2e-3: 74% at step 240; lr 8e-3: 67%; lr 0.05 and 0.2 collapse), LoRA rank 16 (lr 3e-4 / 1e-3, 400-step
cosine: 80-81.5%) and an EMA of the weights did not lift the plateau. The previous race gave TRL
``max_steps=100_000``, so its linear decay never started and it stayed at 55-65%; with ``max_steps=400``
it climbs from 55% back to 70% as the lr decays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch

from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import evaluate, heldout_samples
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards import arithmetic_correct

G, PROMPTS_PER_STEP, LR = 8, 2, 1e-4
RACE_TOKENGYM = {"prompts": 32, "lr": 2e-4, "lr_scheduler_type": "cosine"}
"""tokengym's race settings (prompts per step and GRPOConfig fields; G = 8): see the module docstring."""
RACE_TOKENGYM_STEPS = 300
"""tokengym's sampling steps in the race (the cosine schedule's length)."""
RACE_TRL_STEPS = 3200
"""TRL's ``max_steps`` in the race (2 prompts per step: 6,400 prompts; its 600 s cap ends after about 2,400)."""
CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "agents", "checkpoints", "tiny-arithmetic")


def make_task() -> ArithmeticTask:
    return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


def tokengym_run(model, tok, steps: int, eval_every: int = 0, eval_samples=None, budget_s: float = 0.0,
                 prompts: int = PROMPTS_PER_STEP, group_size: int = G, **config) -> dict:
    """GRPOAgent on ``prompts`` x ``group_size`` completions per step; ``config`` overrides the GRPOConfig fields."""
    policy = Policy(model, tok)
    env = TokenVectorEnv(group_size * prompts, make_task(), tokenizer=tok, group_size=group_size,
                         process_reward=config.get("advantage") == "process")
    eval_env = TokenVectorEnv(100, make_task(), tokenizer=tok)
    cfg = {"lr": LR, "mu": 1, "beta": 0.0, "seed": 0, **config}
    agent = GRPOAgent(policy, GRPOConfig(steps=steps, eval_every=eval_every, **cfg))
    step_times, reached, train_s, accs = [], None, 0.0, []

    def cb(rec):
        nonlocal reached, train_s
        dt = rec["time/rollout"] + rec["time/reward"] + rec["time/update"]
        step_times.append(dt)
        train_s += dt
        if "eval/accuracy" in rec:
            accs.append(rec["eval/accuracy"])
            if reached is None and rec["eval/accuracy"] >= 0.9:
                reached = train_s
        return not (reached is not None or (budget_s and train_s > budget_s))

    agent.learn(env, eval_env=eval_env if eval_samples else None, eval_samples=eval_samples, callback=cb)
    return {"step_s": statistics.median(step_times[2:] or step_times), "seconds_to_90": reached, "train_s": train_s,
            "best_accuracy": max(accs, default=None), "final_accuracy": accs[-1] if accs else None, "steps": len(step_times)}


def trl_run(model, tok, steps: int, eval_every: int = 0, eval_samples=None, budget_s: float = 0.0,
            bf16: bool = False) -> dict:
    from datasets import Dataset
    from _isolate import trl_step_timer
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    rows = make_task().batch(__import__("numpy").random.default_rng(0), 4000)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    eval_env = TokenVectorEnv(100, make_task(), tokenizer=tok)
    state = {"t0": 0.0, "times": [], "train_s": 0.0, "reached": None, "accs": []}

    def eval_and_stop(st, control):
        if eval_samples and eval_every and st.global_step % eval_every == 0:
            model.eval()
            acc = evaluate(Policy(model, tok), eval_env, eval_samples)["accuracy"]
            model.train()
            state["accs"].append(acc)
            if acc >= 0.9 and state["reached"] is None:
                state["reached"] = state["train_s"]
        if state["reached"] is not None or (budget_s and state["train_s"] > budget_s):
            control.should_training_stop = True

    args = TRLConfig(
        output_dir="/tmp/tokengym-trl-bench", per_device_train_batch_size=G * PROMPTS_PER_STEP, num_generations=G,
        max_completion_length=TokenVectorEnv(1, make_task(), tokenizer=tok).max_new_tokens, num_iterations=1,
        beta=0.0, learning_rate=LR, max_steps=steps, logging_strategy="no", disable_tqdm=True, log_level="error",
        report_to="none", use_cpu=True,
        save_strategy="no", loss_type="grpo", scale_rewards="group", temperature=1.0, top_k=0, top_p=1.0,
        bf16=bf16, disable_dropout=True, seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[arithmetic_correct], args=args, train_dataset=data, processing_class=tok,
                          callbacks=[trl_step_timer(state, eval_and_stop)])
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints a summary dict; keep stdout for the JSON line
        trainer.train()
    return {"step_s": statistics.median(state["times"][2:] or state["times"]), "seconds_to_90": state["reached"],
            "train_s": state["train_s"], "best_accuracy": max(state["accs"], default=None),
            "final_accuracy": state["accs"][-1] if state["accs"] else None, "steps": len(state["times"])}


EQUAL_WORK = {"skip_zero_advantage": False}
"""The speed comparison's random-init model scores 0 everywhere, so every advantage is 0 and tokengym's
default would skip the whole forward/backward: it is turned off there, so both do the same update."""
CONTENDERS = {"tokengym": (tokengym_run, EQUAL_WORK), "trl": (trl_run, {}),
              "tokengym_bf16": (tokengym_run, {"bf16": True, **EQUAL_WORK}), "trl_bf16": (trl_run, {"bf16": True})}


def one(name: str, preset: str, steps: int) -> float:
    """Median seconds per step of one contender (what ``--one`` runs in a fresh process)."""
    fn, kw = CONTENDERS[name]
    model, tok = build_preset(preset, seed=0)
    return fn(model, tok, steps, **kw)["step_s"]


def speed(preset: str, steps: int, repeats: int = 1, threads: int = 1) -> dict:
    """Seconds per step of both in fp32 and both with ``bf16=True``.

    Each contender runs in its own process (``_isolate``), ``repeats`` times in rotating order (a
    shared machine's load drifts); each figure is the median of its per-run medians.
    """
    from _isolate import run_child

    runs = list(CONTENDERS)
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        for name in runs[r % len(runs):] + runs[: r % len(runs)]:
            argv = ["--one", name, "--presets", preset, "--steps", str(steps), "--threads", str(threads)]
            times.setdefault(name, []).append(run_child(os.path.abspath(__file__), argv))
    out = {name: statistics.median(t) for name, t in times.items()}
    out["runs"] = {name: [round(x, 4) for x in t] for name, t in times.items()}
    out["speedup"] = out["trl"] / out["tokengym"]
    out["speedup_bf16"] = out["trl_bf16"] / out["tokengym_bf16"]
    return out


def race(seconds: float, eval_prompts: int) -> dict:
    """Both from the warm checkpoint until 90% held-out greedy accuracy, the end of their schedule, or
    ``seconds`` of training each; evaluation about every ``eval_prompts`` training prompts."""
    if not os.path.isdir(CHECKPOINT):
        return {"race": f"skipped: no warm checkpoint at {CHECKPOINT}"}
    samples = heldout_samples(make_task(), 200)
    res = {"race_config_tokengym": dict(RACE_TOKENGYM, steps=RACE_TOKENGYM_STEPS),
           "race_config_trl": {"group_size": G, "prompts": PROMPTS_PER_STEP, "lr": LR, "max_steps": RACE_TRL_STEPS}}
    for name, fn, steps, kw in (("tokengym", tokengym_run, RACE_TOKENGYM_STEPS, RACE_TOKENGYM), ("trl", trl_run, RACE_TRL_STEPS, {})):
        policy = Policy.from_pretrained(CHECKPOINT)
        start_acc = evaluate(policy, TokenVectorEnv(100, make_task(), tokenizer=policy.tokenizer), samples)["accuracy"]
        every = max(1, round(eval_prompts / kw.get("prompts", PROMPTS_PER_STEP)))
        r = fn(policy.model, policy.tokenizer, steps, every, samples, budget_s=seconds, **kw)
        res[f"seconds_to_90_{name}"] = None if r["seconds_to_90"] is None else round(r["seconds_to_90"], 1)
        res[f"start_accuracy_{name}"] = start_acc
        res[f"train_seconds_{name}"] = round(r["train_s"], 1)
        res[f"train_steps_{name}"] = r["steps"]
        res[f"best_accuracy_{name}"] = r["best_accuracy"]
        res[f"final_accuracy_{name}"] = r["final_accuracy"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--presets", nargs="*", default=["tiny", "small"], help="presets for the speed comparison (none: race only)")
    ap.add_argument("--race-seconds", type=float, default=600.0, help="training-time cap per contender (0 = no race)")
    ap.add_argument("--race-eval-prompts", type=int, default=80, help="evaluate about every this many training prompts")
    ap.add_argument("--repeats", type=int, default=1, help="speed runs per contender, in rotating order (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)  # a contender, in a child process
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one(args.one, args.presets[0], args.steps)))
        return
    try:
        import trl
    except ImportError:
        print(json.dumps({"error": "trl is not installed: pip install -e '.[bench]'"}))
        sys.exit(0)
    result = {"trl_version": trl.__version__, "threads": args.threads, "group_size": G, "prompts_per_step": PROMPTS_PER_STEP,
              "load_avg_1min_start": round(os.getloadavg()[0], 2)}
    for preset in args.presets:
        s = speed(preset, args.steps, args.repeats, args.threads)
        result[f"{preset}_step_s_tokengym"] = round(s["tokengym"], 4)
        result[f"{preset}_step_s_trl"] = round(s["trl"], 4)
        result[f"{preset}_speedup"] = round(s["speedup"], 3)
        result[f"{preset}_step_s_tokengym_bf16"] = round(s["tokengym_bf16"], 4)
        result[f"{preset}_step_s_trl_bf16"] = round(s["trl_bf16"], 4)
        result[f"{preset}_speedup_bf16"] = round(s["speedup_bf16"], 3)
        result[f"{preset}_step_s_runs"] = s["runs"]
    if args.race_seconds > 0:
        result.update(race(args.race_seconds, args.race_eval_prompts))
    result["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""PPO seconds per update: tokengym's PPOAgent vs TRL's PPOTrainer, measured in the same run.

    python bench/ppo_vs_trl.py --json [--steps 8] [--presets tiny small]

TRL dropped its PPO trainer after 1.12.0 (it lived in ``trl.experimental.ppo``), so this script installs
``trl==1.12.0`` into ``bench/.trl-1.12.0`` (git-ignored) with ``pip install --no-deps --target`` on first
use and puts that folder first on ``sys.path`` for the TRL side only. If it cannot be installed or
imported, the JSON line says why (``trl_error``) and carries only tokengym's numbers.

Equal work per update: the same preset policy (random init, same weights), the same reward model (a
``transformers`` ``LlamaForSequenceClassification`` built from the preset's config, same weights for both;
tokengym plugs it into the env through ``tokengym.rewards.RewardModel``), a value model / critic of the
same size (TRL: a sequence classifier read per token; tokengym: a copy of the policy trunk + value
head), a frozen reference copy (KL coef 0.05, k1), the same Arithmetic prompts, ``--rollouts``
completions per update of at most ``--response-length`` tokens (EOS stops both), 4 epochs of one
minibatch (TRL's ``num_ppo_epochs=4, num_mini_batches=1``), value clip 0.2, whitened advantages,
temperature 1, fp32, CPU, ``--threads`` torch threads. Seconds per update is the median wall time
between consecutive updates (everything each trainer does per update: generation, reward, reference,
values, advantages, epochs, logging) after ``--warmup`` updates. ``<preset>_speedup`` = TRL seconds per
update / tokengym seconds per update (both fp32); ``<preset>_speedup_bf16`` compares both with
``bf16=True`` (tokengym: bf16 autocast in rollout and update; TRL: ``bf16=True`` with ``use_cpu=True``,
accelerate's CPU bf16 autocast; TRL's models keep ``transformers``' sdpa attention, as a TRL user gets them, while
tokengym's ``Policy``/``Critic`` attend in fp32 under CPU autocast: ``tokengym.agents.engine.models.ATTENTION``). Each contender runs in a fresh process (``bench/_isolate.py``: one library's leftovers slowed the next by ~10%). ``--rounds R`` repeats the four contenders R times and pools the updates, so that a machine whose
load drifts does not favour whichever trainer ran first.

Where the time goes (2026-12-03, 1 thread, quiet machine): both updates are the same arithmetic (4 epochs of policy
and critic forward/backward over the same tokens) and run at this CPU's matmul peak (a small-preset policy+critic
step: 2.2 of 2.5 s in fp32 GEMMs at ~97 GFLOP/s; in bf16, 1.03 of 1.44 s at ~205 GFLOP/s). On small the fp32 update
is 11 of tokengym's 13 s per update, so however fast the rollout the fp32 ratio stays below TRL's 13-16 s / 11 s; tokengym's lead
comes from the rollout (fast decoder, no separate pi_old pass) and from bf16, where fp32 attention halved the tiny
preset's step (CPU flash-attention's bf16 backward is slow).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from tokengym.agents.engine.models import build_preset, load_classifier
from tokengym.agents.engine.policy import Policy
from tokengym.agents.algorithms.ppo import PPOAgent, PPOConfig
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards import RewardModel

TRL_VERSION = "1.12.0"
TRL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".trl-{TRL_VERSION}")
LR, EPOCHS, KL_COEF, VALUE_CLIP = 3e-5, 4, 0.05, 0.2


def make_task() -> ArithmeticTask:
    return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


def models(preset: str):
    """Policy LM, reward model and tokenizer, identical for both trainers (fresh copies per call)."""
    policy, tok = build_preset(preset, seed=0)
    rm, _ = load_classifier(preset, head="sequence", tokenizer=tok, seed=1)
    return policy, rm, tok


# ---------------------------------------------------------------------------------------------- tokengym
def tokengym_run(preset: str, steps: int, rollouts: int, length: int, bf16: bool = False) -> list[float]:
    model, rm, tok = models(preset)
    env = TokenVectorEnv(rollouts, make_task(), tokenizer=tok, reward=RewardModel(rm, tok), max_new_tokens=length)
    cfg = PPOConfig(steps=steps, lr=LR, mu=EPOCHS, minibatches=1, beta=KL_COEF, value_clip=VALUE_CLIP,
                    bf16=bf16, seed=0)
    agent = PPOAgent(Policy(model, tok), cfg)
    marks = [time.perf_counter()]
    agent.learn(env, callback=lambda rec: marks.append(time.perf_counter()))
    return [b - a for a, b in zip(marks, marks[1:])]


# ---------------------------------------------------------------------------------------------- TRL 1.12
def load_trl():
    """``trl.experimental.ppo`` of TRL 1.12.0 from the side folder (installed on first use); raises on failure."""
    if not os.path.isdir(os.path.join(TRL_DIR, "trl")):
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", TRL_DIR, f"trl=={TRL_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install trl=={TRL_VERSION} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
        del sys.modules[name]  # a newer trl imported earlier must not shadow the side copy
    sys.path.insert(0, TRL_DIR)
    importlib.invalidate_caches()
    trl = importlib.import_module("trl")
    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(f"imported trl {trl.__version__} from {trl.__file__}, expected {TRL_VERSION}")
    return trl, importlib.import_module("trl.experimental.ppo")


def trl_run(ppo, preset: str, steps: int, rollouts: int, length: int, bf16: bool = False) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback

    model, rm, tok = models(preset)
    value_model = copy.deepcopy(rm)  # same architecture and size as tokengym's critic (trunk + scalar head)
    rows = make_task().batch(__import__("numpy").random.default_rng(0), rollouts * (steps + 1))
    data = Dataset.from_dict({"input_ids": [tok(r["prompt"])["input_ids"] for r in rows]})
    marks: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    args = ppo.PPOConfig(
        output_dir="/tmp/tokengym-trl-ppo-bench", per_device_train_batch_size=rollouts, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=EPOCHS, total_episodes=rollouts * steps, local_rollout_forward_batch_size=rollouts,
        response_length=length, stop_token="eos", temperature=1.0, learning_rate=LR, kl_coef=KL_COEF, kl_estimator="k1",
        cliprange=0.2, cliprange_value=VALUE_CLIP, gamma=1.0, lam=0.95, whiten_rewards=False, num_sample_generations=0,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, log_level="error", use_cpu=True,
        bf16=bf16, seed=0, dataloader_num_workers=0, lr_scheduler_type="constant",
    )
    trainer = ppo.PPOTrainer(args=args, processing_class=tok, model=model, ref_model=None, reward_model=rm,
                             train_dataset=data, value_model=value_model, callbacks=[Timer()])
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints progress; keep stdout for the JSON line
        trainer.train()
    return [b - a for a, b in zip(marks, marks[1:])]


CONTENDERS = ("tokengym", "trl", "tokengym_bf16", "trl_bf16")


def one(name: str, preset: str, args) -> list[float]:
    """Seconds of each update of one contender (what ``--one`` runs in a fresh process)."""
    bf16 = name.endswith("_bf16")
    if name.startswith("trl"):
        return trl_run(load_trl()[1], preset, args.steps, args.rollouts, args.response_length, bf16=bf16)
    return tokengym_run(preset, args.steps, args.rollouts, args.response_length, bf16=bf16)


def speed(with_trl: bool, preset: str, args) -> dict[str, float]:
    """Median seconds per update of each contender, each run in its own process (``_isolate``), updates
    pooled over ``args.rounds`` rounds."""
    from _isolate import run_child

    runs = [n for n in CONTENDERS if with_trl or not n.startswith("trl")]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name in runs:
            argv = ["--one", name, "--presets", preset, "--steps", str(args.steps), "--rollouts", str(args.rollouts),
                    "--response-length", str(args.response_length), "--threads", str(args.threads)]
            times[name] += run_child(os.path.abspath(__file__), argv)[args.warmup :]
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--steps", type=int, default=8, help="updates per trainer and preset")
    ap.add_argument("--warmup", type=int, default=2, help="updates left out of the median")
    ap.add_argument("--rollouts", type=int, default=16, help="completions per update")
    ap.add_argument("--response-length", type=int, default=32, help="max new tokens per completion")
    ap.add_argument("--presets", nargs="*", default=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=1, help="repeat the contenders in turn and pool their updates")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)  # a contender, in a child process
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.one:
        print(json.dumps(one(args.one, args.presets[0], args)))
        return
    result: dict = {"threads": args.threads, "rollouts": args.rollouts, "response_length": args.response_length,
                    "epochs": EPOCHS, "minibatches": 1, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    try:
        trl, ppo = load_trl()
        result["trl_version"] = trl.__version__
    except Exception as e:  # noqa: BLE001 - any failure to get TRL 1.12 is reported, not raised
        ppo = None
        result["trl_error"] = f"{type(e).__name__}: {e}"
    for preset in args.presets:
        s = speed(ppo is not None, preset, args)
        for name, sec in s.items():
            result[f"{preset}_update_s_{name}"] = round(sec, 4)
        result[f"{preset}_speedup"] = round(s["trl"] / s["tokengym"], 3) if "trl" in s else None
        result[f"{preset}_speedup_bf16"] = round(s["trl_bf16"] / s["tokengym_bf16"], 3) if "trl" in s else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""DPO training throughput: tokengym ``DPOLearner`` vs TRL ``DPOTrainer``, same model, same pairs, same batches.

Usage::

    python bench/dpo_vs_trl.py                  # a table
    python bench/dpo_vs_trl.py --json           # one JSON line (tiny_speedup, small_speedup, ...)
    python bench/dpo_vs_trl.py --presets tiny --repeats 5 --threads 2

Contenders: TRL ``DPOTrainer``; ``DPOLearner`` with its default config (``share_prefix=None``: shared-prefix
packing, which the presets' Llama architecture passes the one-time check for; ``tiny_speedup`` /
``small_speedup`` are this one, live reference); and ``DPOLearner(share_prefix=False)``, the plain
``[2B, L]`` stack (``*_speedup_stack``; skip with ``--no-stack``).

What is compared (equal work):

* the same preset (``tiny``/``small``, same seed, so the same initial weights), fp32, CPU, the same
  ``--threads`` torch threads for both;
* the same bundled arithmetic pairs (``arithmetic_pairs``), tokenized to the same ids (checked: TRL's
  ``prompt_ids``/``chosen_ids``/``rejected_ids`` equal ours), the same batch size, **the same batches in
  the same order** (TRL ``train_sampling_strategy="sequential"``, ``DPOLearner`` ``shuffle=False``);
* the same optimisation: sigmoid DPO loss, beta, AdamW (TRL's default fused AdamW; ours fused as well),
  constant learning rate, gradient clipping at 1.0, no gradient accumulation, fp32;
* TRL runs with ``gradient_checkpointing=False`` (its DPOConfig default is True, which recomputes
  activations: not equal work), ``bf16=False``, ``use_cpu=True``, no eval, no saving, ``report_to="none"``,
  logging every 1000 steps (ours logs every step, so any logging cost counts against us);
* with a live reference model (both get a frozen copy of the same initial weights; TRL cannot rebuild
  an in-memory preset from a path, so it is passed as ``ref_model``) and with precomputed reference
  log-probs (``precompute_ref_log_probs=True`` / ``precompute_ref=True``).

Timing: only training steps. Both run ``--warmup`` steps first; the clock runs from the end of the
last warm-up step to the end of the last step (TRL: a ``TrainerCallback.on_step_end``; ours: the
``fit`` callback, called after every step). Model construction, tokenization, the packing check, reference
precomputation and trainer set-up are outside the clock. Each timed step includes, for both, fetching
and collating the batch, the forward passes, backward, clipping and the optimiser step.

Sequence length: TRL right-pads ``prompt + completion`` rows to the batch's longest row; the plain
tokengym stack left-pads prompts and right-pads completions (the env's layout), so its rows are
``longest prompt + longest completion``: never shorter. Shared-prefix packing stores each pair's prompt
and common completion prefix once and packs pairs into rows. All padded token counts are reported.

Timings on a shared machine are noisy: the contenders are interleaved (order alternating per repeat),
medians are reported with the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def make_pairs(n: int, seed: int) -> list[dict]:
    from tokengym.agents.data.pairs import arithmetic_pairs
    from tokengym.envs.tasks import ArithmeticTask

    task = ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")
    return [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in arithmetic_pairs(task, n, seed=seed)]


def padded_tokens(data, batch_size: int, steps: int) -> tuple[int, int, int]:
    """Padded tokens fed to the policy over ``steps`` sequential batches: (tokengym [2B, L], TRL, tokengym share_prefix)."""
    ours = trl = shared = 0
    for s in range(steps):
        idx = torch.arange(s * batch_size, (s + 1) * batch_size) % len(data)
        p = data.prompt_lens[idx]
        c = data.completion_lens[:, idx]
        ours += 2 * len(idx) * int(p.max() + c.max())
        trl += 2 * len(idx) * int((p[None] + c).max())
        shared += data.shared_batch(idx).tokens.numel()
    return ours, trl, shared


def run_tokengym(preset: str, pairs: list[dict], a: argparse.Namespace, precompute: bool, share_prefix: bool | None = None) -> dict:
    from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
    from tokengym.agents.engine.models import build_preset
    from tokengym.agents.engine.policy import Policy

    policy = Policy(*build_preset(preset, seed=0))
    cfg = DPOConfig(beta=a.beta, lr=a.lr, batch_size=a.batch_size, steps=a.warmup + a.steps, shuffle=False,
                    precompute_ref=precompute, share_prefix=share_prefix, max_grad_norm=1.0, log_every=1)
    learner = DPOLearner(policy, cfg)
    data = learner.prepare(pairs)  # tokenization: outside the clock
    packed = learner.share_prefix  # the default's one-time check: outside the clock
    stamps: list[float] = []
    learner.fit(data, callback=lambda rec: stamps.append(time.perf_counter()))
    assert len(stamps) == a.warmup + a.steps, len(stamps)
    dt = stamps[-1] - stamps[a.warmup - 1]
    return {"pairs_per_s": a.steps * a.batch_size / dt, "seconds": dt, "loss_last": learner.logger.history[-1]["train/loss"],
            "share_prefix": packed}


def run_trl(preset: str, pairs: list[dict], a: argparse.Namespace, precompute: bool, check_ids=None) -> dict:
    import datasets
    from transformers import TrainerCallback
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    from tokengym.agents.engine.models import build_preset

    model, tok = build_preset(preset, seed=0)
    ref = None if precompute else copy.deepcopy(model)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TRLConfig(
            output_dir=out, per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=1,
            max_steps=a.warmup + a.steps, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
            beta=a.beta, loss_type=["sigmoid"], max_grad_norm=1.0, precompute_ref_log_probs=precompute,
            precompute_ref_batch_size=4 * a.batch_size, train_sampling_strategy="sequential",
            gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0,
            eval_strategy="no", save_strategy="no", report_to="none", logging_steps=1000, disable_tqdm=True,
            seed=0, max_length=None,
        )
        ds = datasets.Dataset.from_list(pairs)
        trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
        if check_ids is not None:  # same token ids as tokengym
            row = trainer.train_dataset[0]
            exp = check_ids
            if (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) != exp:
                raise AssertionError(f"TRL tokenized differently: {row['prompt_ids']}, {row['chosen_ids']} vs {exp}")
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its final metrics; keep stdout one JSON line
            trainer.train()
    assert len(stamps) == a.warmup + a.steps, len(stamps)
    dt = stamps[-1] - stamps[a.warmup - 1]
    return {"pairs_per_s": a.steps * a.batch_size / dt, "seconds": dt}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 30 tiny, 6 small)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--modes", nargs="+", default=["live", "precomputed"], choices=["live", "precomputed"])
    p.add_argument("--no-stack", dest="stack", action="store_false",
                   help="skip the DPOLearner(share_prefix=False) contender (the plain [2B, L] stack)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the clock starts at the end of the last warm-up step)")
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    import datasets

    datasets.logging.set_verbosity_error()
    from tokengym.agents.data.pairs import PairData
    from tokengym.envs.tokenizer import char_tokenizer

    load_before = os.getloadavg()
    t_start = time.perf_counter()
    results: dict = {}
    for preset in a.presets:
        steps = a.steps or (30 if preset == "tiny" else 6)
        ns = argparse.Namespace(**{**vars(a), "steps": steps})
        pairs = make_pairs((a.warmup + steps) * a.batch_size, seed=0)
        data = PairData.from_pairs(pairs, char_tokenizer())
        ids0 = (data.prompts[0][data.prompt_mask[0]].tolist(), data.completions[0, 0, : int(data.completion_lens[0, 0])].tolist(),
                data.completions[1, 0, : int(data.completion_lens[1, 0])].tolist())
        stack_tok, trl_tok, shared_tok = padded_tokens(data, a.batch_size, a.warmup + steps)
        for mode in a.modes:
            pre = mode == "precomputed"
            who_all = ["trl", "tokengym"] + (["tokengym_stack"] if a.stack else [])
            runs: dict[str, list[float]] = {w: [] for w in who_all}
            packed = None
            for r in range(a.repeats):
                order = who_all[r % len(who_all):] + who_all[: r % len(who_all)]  # rotate who goes first
                for who in order:
                    if who == "trl":
                        res = run_trl(preset, pairs, ns, pre, ids0 if r == 0 else None)
                    elif who == "tokengym":  # the default config
                        res = run_tokengym(preset, pairs, ns, pre)
                        packed = res["share_prefix"]
                    else:
                        res = run_tokengym(preset, pairs, ns, pre, share_prefix=False)
                    runs[who].append(res["pairs_per_s"])
            med = {k: statistics.median(v) for k, v in runs.items()}
            res_ = {
                "tokengym_pairs_per_s": round(med["tokengym"], 2), "trl_pairs_per_s": round(med["trl"], 2),
                "speedup": round(med["tokengym"] / med["trl"], 3),
                "tokengym_runs": [round(x, 2) for x in runs["tokengym"]], "trl_runs": [round(x, 2) for x in runs["trl"]],
                "tokengym_share_prefix": packed, "timed_steps": steps, "padded_tokens_trl": trl_tok,
                "padded_tokens_tokengym": shared_tok if packed else stack_tok,
            }
            if a.stack:
                res_.update({"stack_pairs_per_s": round(med["tokengym_stack"], 2),
                             "stack_speedup": round(med["tokengym_stack"] / med["trl"], 3),
                             "stack_runs": [round(x, 2) for x in runs["tokengym_stack"]],
                             "padded_tokens_stack": stack_tok})
            results[f"{preset}_{mode}"] = res_
            if not a.json:
                print(f"{preset:5s} {mode:11s} tokengym {res_['tokengym_pairs_per_s']:8.2f} pairs/s   TRL {res_['trl_pairs_per_s']:8.2f} pairs/s"
                      f"   speedup {res_['speedup']:.2f}x   runs {res_['tokengym_runs']} vs {res_['trl_runs']}"
                      f"   (share_prefix={packed})", flush=True)
                if a.stack:
                    print(f"{'':17s} tokengym share_prefix=False {res_['stack_pairs_per_s']:8.2f} pairs/s   speedup "
                          f"{res_['stack_speedup']:.2f}x   runs {res_['stack_runs']}", flush=True)
    out = {
        "bench": "dpo_vs_trl",
        **{f"{pr}_speedup": results[f"{pr}_live"]["speedup"] for pr in a.presets if f"{pr}_live" in results},
        **{f"{pr}_speedup_precomputed": results[f"{pr}_precomputed"]["speedup"] for pr in a.presets if f"{pr}_precomputed" in results},
        **{f"{pr}_speedup_stack": results[f"{pr}_live"]["stack_speedup"] for pr in a.presets
           if a.stack and f"{pr}_live" in results},
        "results": results,
        "batch_size": a.batch_size, "warmup_steps": a.warmup, "repeats": a.repeats, "threads": a.threads,
        "torch": torch.__version__, "trl": __import__("trl").__version__, "transformers": transformers.__version__,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "wall_s": round(time.perf_counter() - t_start, 1),
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(f"load average before {out['loadavg_before']} after {out['loadavg_after']} ({out['cpus']} CPUs); wall {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

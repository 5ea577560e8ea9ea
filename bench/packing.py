"""Padding-free updates: update seconds with ``packing=off`` against ``bins`` and ``auto``.

    python bench/packing.py --json [--threads 2] [--rows 64] [--models smollm2 small] [--dtypes fp32 bf16]

One update epoch is timed: the batch's rows shuffled into minibatches of ``--minibatch`` rows (a padded 64-row
SmolLM2 batch does not fit a 24 GB machine's memory in one pass), and per minibatch the policy's forward (log-probs
and entropies, as the on-policy skeleton runs it), a policy-gradient loss with fixed random advantages, the backward
and an AdamW step. Shapes:

* ``longtail``: ``--rows`` rows ending after 4 to 256 tokens, log-uniform (``bench/longtail.py``'s schedule, mean
  ~61), behind the task's prompts (SmolLM2: the chat arithmetic prompts of the README, left padded): what a
  long-tailed GRPO rollout hands the update as a ``[rows, P + 256]`` padded batch.
* ``even``: every row 128 tokens long: only the prompts' lengths differ, so there is little padding to remove.

``bins`` runs on its own only on the even shape, with ``--even-bins`` (on the long-tailed one ``auto`` packs, so it is
that run).

Every (model, dtype, shape, packing) runs in its own fresh process (``bench/_isolate.py``) with ``--threads`` torch
threads: one warm-up update of 8 rows, then the best of ``--repeats`` timed updates of the whole batch. The completion tokens are random non-special
ids (the update's cost does not depend on them). A 2048^3 matmul measured in the parent gives the machine's limit.
``--json`` prints one line; ``longtail_speedup`` and ``even_speedup_auto`` are SmolLM2 fp32's ``off`` seconds over
``auto``'s (``longtail_speedup_bins`` and ``even_speedup_bins`` the same for ``bins``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = {"smollm2": "smollm2-135m-instruct", "small": "small"}
EVEN = 128


def _batch(policy, model: str, shape: str, rows: int, seed: int = 0):
    """``(tokens, mask, P)``: the task's prompts, left padded, then each row's completion, right padded."""
    from longtail import schedule

    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ArithmeticTask

    task = ArithmeticTask(chat=True, n_operands=2, digits=(1, 2)) if model == "smollm2" else ArithmeticTask()
    env = TokenVectorEnv(rows, task, tokenizer=policy.tokenizer, max_new_tokens=256)
    env.reset(seed=seed)
    P = env.max_prompt_len
    prompts, pmask = env.tokens[:, :P], env.attention_mask[:, :P]
    lengths = schedule(rows) if shape == "longtail" else torch.full((rows,), EVEN)
    M = int(lengths.max())
    special = set(policy.tokenizer.all_special_ids)
    ok = torch.tensor([i for i in range(len(policy.tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(seed)
    comp = ok[torch.randint(len(ok), (rows, M), generator=g)]
    cmask = (torch.arange(M)[None] < lengths[:, None]).long()
    tokens = torch.cat([prompts, comp * cmask], 1)
    mask = torch.cat([pmask.long(), cmask], 1)
    lead = P - int(pmask.sum(1).max())  # the skeleton's used_slice drops columns that are padding in every row
    return tokens[:, lead:], mask[:, lead:], P - lead


def run_one(model: str, dtype: str, shape: str, packing: str, rows: int, minibatch: int, repeats: int) -> dict:
    from tokengym.agents import Policy
    from tokengym.rewards import packing as PK

    name = MODELS[model]
    if model == "smollm2":
        from tokengym.agents.engine.convert import gguf_folder

        name = gguf_folder(name)
    policy = Policy.from_pretrained(name, seed=0, packing=packing)
    tokens, mask, P = _batch(policy, model, shape, rows)
    amask = mask[:, P:].float()
    adv = torch.randn(rows, 1, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    chose = PK.plan(packing, policy.model, tokens[:minibatch], mask[:minibatch])  # what the first minibatch would get

    def update(rows: torch.Tensor) -> float:
        t0 = time.perf_counter()
        m = int(amask[rows].sum(1).max())  # as the skeleton's used_slice: columns padding in every row are cut
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logp, ent = policy(tokens[rows, : P + m], mask[rows, : P + m], P, return_entropy=True)
        ratio = torch.exp(logp - logp.detach())
        am = amask[rows, :m]
        loss = ((-(ratio * adv[rows]) - 0.01 * ent) * am).sum() / am.sum()  # no clipping at ratio 1
        opt.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    order = torch.randperm(rows, generator=torch.Generator().manual_seed(2))  # the skeleton's shuffled minibatches

    def epoch() -> float:
        return sum(update(mb) for mb in order.split(minibatch))

    update(order[:8])  # warm-up (one-time costs: kernels, the allocator, the packing check) on a few rows
    best = min(epoch() for _ in range(repeats))
    real = int(mask.sum())
    return {"seconds": best, "threads": torch.get_num_threads(), "real_tokens": real, "padded_tokens": mask.numel(),
            "packed_tokens": None if chose is None else chose.num_tokens, "bins": None if chose is None else chose.tokens.shape[0]}


def matmul_gflops(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=["longtail", "even"], choices=["longtail", "even"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--even-bins", action="store_true", help="also time bins on the even shape")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "DTYPE", "SHAPE", "PACKING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(*args.one, rows=args.rows, minibatch=args.minibatch, repeats=args.repeats)))
        return
    from _isolate import run_child

    out: dict = {"threads": args.threads, "rows": args.rows, "minibatch": args.minibatch, "matmul_gflops": round(matmul_gflops(args.threads), 1),
                 "cpu_bf16": bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                 "runs": {}}
    for model in args.models:
        for dtype in args.dtypes:
            for shape in args.shapes:
                for packing in ("off", "auto", "bins") if shape == "even" and args.even_bins else ("off", "auto"):
                    key = f"{model}/{dtype}/{shape}/{packing}"
                    r = run_child(__file__, ["--one", model, dtype, shape, packing, "--rows", str(args.rows), "--minibatch", str(args.minibatch),
                                             "--threads", str(args.threads), "--repeats", str(args.repeats)])
                    out["runs"][key] = r
                    print(f"{key}: {r['seconds']:.2f} s", file=sys.stderr, flush=True)
                runs = out["runs"]
                if shape == "longtail" and runs[f"{model}/{dtype}/longtail/auto"]["bins"] is not None:
                    runs[f"{model}/{dtype}/longtail/bins"] = runs[f"{model}/{dtype}/longtail/auto"]  # auto packed: the same run
                for mode in ("auto", "bins"):
                    if f"{model}/{dtype}/{shape}/{mode}" not in runs:
                        continue
                    base = out["runs"][f"{model}/{dtype}/{shape}/off"]["seconds"]
                    out[f"{model}_{dtype}_{shape}_speedup_{mode}"] = round(base / out["runs"][f"{model}/{dtype}/{shape}/{mode}"]["seconds"], 3)
    first = f"{args.models[0]}_{args.dtypes[0]}"
    for key in ("longtail_speedup", "even_speedup"):
        shape = key.split("_")[0]
        out[key if shape == "longtail" else "even_speedup_auto"] = out.get(f"{first}_{shape}_speedup_auto")
        out[f"{key}_bins"] = out.get(f"{first}_{shape}_speedup_bins")
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

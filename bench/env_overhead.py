"""Per-step overhead of TokenVectorEnv.step against one KV-cached decode step of a ~1M-param Llama.

Prints one JSON line. Both are measured in the same run, on the same machine, at the same batch:
    python bench/env_overhead.py [--num-envs 64] [--repeats 5] [--threads 1]

``step_us_no_events``: steps where no slot stops (the common case: pure tensor bookkeeping + one sync).
``step_us_episode``: whole Arithmetic episodes with random tokens, including episode ends, decoding
and verifier calls, divided by the number of steps.
``overhead_fraction``: step_us_episode / decode_us (goal: < 0.10).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokengym.envs import TokenVectorEnv


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def time_decode(model, n: int, prompt_len: int, steps: int) -> float:
    # transformers >= 5.2x names the KV cache argument `cache`; older releases `past_key_values`.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(3, model.config.vocab_size, (n, prompt_len))
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache, tok = getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            out = model(input_ids=tok, use_cache=True, **{kw: cache})
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, use_cache=True, **{kw: cache})
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t0) / steps * 1e6


def time_env_no_events(env: TokenVectorEnv, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    acts = torch.randint(3, env.vocab_size, (steps, env.num_envs), generator=g)  # never EOS (id 2)
    env.reset(seed=0)
    t0 = time.perf_counter()
    for t in range(steps):
        env.step(acts[t])
    return (time.perf_counter() - t0) / steps * 1e6


def time_env_episodes(env: TokenVectorEnv, episodes: int) -> float:
    g = torch.Generator().manual_seed(1)
    n_steps, total = 0, 0.0
    for e in range(episodes):
        env.reset(seed=e)
        acts = torch.randint(0, env.vocab_size, (env.max_new_tokens, env.num_envs), generator=g)
        t0 = time.perf_counter()
        for t in range(env.max_new_tokens):
            env.step(acts[t])
            n_steps += 1
            if bool(env.done.all()):
                break
        total += time.perf_counter() - t0
    return total / n_steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-envs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings sane on a shared 2-core box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = args.num_envs
    env = TokenVectorEnv(n, "arithmetic", max_new_tokens=64)
    model = tiny_llama(env.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    decode = min(time_decode(model, n, 16, 64) for _ in range(args.repeats))
    no_events = min(time_env_no_events(env, env.max_new_tokens - 1) for _ in range(args.repeats))
    episode = min(time_env_episodes(env, 4) for _ in range(args.repeats))
    print(json.dumps({
        "num_envs": n, "model_params": params, "threads": torch.get_num_threads(),
        "decode_us": round(decode, 1), "step_us_no_events": round(no_events, 1), "step_us_episode": round(episode, 1),
        "overhead_fraction": round(episode / decode, 4), "overhead_fraction_no_events": round(no_events / decode, 4),
    }))


if __name__ == "__main__":
    main()

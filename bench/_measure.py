"""What several benches measure the same way: one timed HF ``generate`` call, a rollout's FLOP count, and held-out
accuracy against training time.

Kept apart from the bench scripts so that they import it and not each other.
"""

from __future__ import annotations

import time

import torch


def timed_generate(model, env, seed: int, **kwargs) -> tuple[torch.Tensor, float]:
    """``(output, seconds)`` of one sampled ``model.generate`` (T=1, no top-k/p, KV cache) on the prompts that
    ``env.reset(seed=seed)`` draws, left-padded as the env lays them out; ``kwargs`` add to the generate call."""
    P = env.max_prompt_len
    env.reset(seed=seed)
    prompts, mask = env.tokens[:, :P].clone(), env.attention_mask[:, :P].long()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             use_cache=True, **kwargs)
    return out, time.perf_counter() - t0


def flops_per_rollout(model, n: int, prompt_len: int, new_tokens: int) -> float:
    cfg = model.config
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_per_ctx = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd
    L = prompt_len + new_tokens
    # prefill: every prompt column attends to (col + 1) columns on average (P + 1) / 2; decode step t to P + t + 1
    ctx = prompt_len * (prompt_len + 1) / 2 + sum(prompt_len + t + 1 for t in range(new_tokens))
    return n * (2 * matmul_params * L + attn_per_ctx * ctx)


def accuracy_curve(agent, env, eval_env, samples, seconds: float, eval_seconds: float) -> dict:
    """Train ``agent`` on ``env`` for ``seconds`` of training time; its policy's greedy held-out accuracy on
    ``samples`` at the start, after the first step past every ``eval_seconds`` and at the end (evaluation time is not
    training time). ``{"start", "final", "steps", "curve": [(seconds, accuracy), ...]}``."""
    from tokengym.agents.engine.rollout import evaluate

    def acc() -> float:
        agent.policy.eval()
        return float(evaluate(agent.policy, eval_env, samples, greedy=True)["accuracy"])

    curve = [(0.0, acc())]
    state = {"train": 0.0, "t": time.perf_counter()}

    def callback(record: dict) -> bool:
        state["train"] += time.perf_counter() - state["t"]
        if state["train"] >= curve[-1][0] + eval_seconds or state["train"] >= seconds:
            curve.append((round(state["train"], 1), acc()))
        state["t"] = time.perf_counter()
        return state["train"] < seconds

    agent.learn(env, callback=callback)
    return {"start": curve[0][1], "final": curve[-1][1], "steps": agent.global_step, "curve": curve}

"""Rollouts through the generation seam: an engine's whole generations, replayed through the env one token at a time.

:func:`collect_generated` is what :func:`~tokengym.agents.engine.rollout.collect` runs for a
:class:`~tokengym.agents.engine.generation.Generator` (vLLM, a remote worker, :class:`PolicyGenerator`). Each round
asks the engine to continue every live row from its whole token history, under the env's stop rule and remaining
budget, then steps the env with the generated tokens; a row that has used its tokens, or whose turn the env ended,
sits the remaining steps of the round out (``env.step(..., hold=)``). So the env still acts one token at a time: its
stops, step and PRM rewards, replies and layout are what the token-level loop gives.

- Where the env ends a row's turn before the engine's generation did, the rest of it is dropped (counted per row in
  ``Rollout.generation_counts["dropped"]``); where the engine stopped first (a stop string spelled with other tokens
  than the env matches), the row asks again in the next round.
- A multi-turn row's reply is appended by the env; the next round generates from the history with it (an engine's
  prefix cache saves re-encoding the shared part).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tokengym.agents.engine.seam import FINISH_REASONS, GenerationRequest, stream_seed
from tokengym.agents.engine.resources import check_fits
from tokengym.agents.engine.rollout_data import Rollout, attach_values, check_collect_args, snapshot_rollout

__all__ = ["collect_generated"]


def collect_generated(env, generator, critic=None, *, greedy: bool = False, seed: int | None = None,
                      samples: list | None = None) -> Rollout:
    """One lockstep batch of ``env`` (``disabled`` autoreset) with ``generator``; the same ``Rollout`` as
    :func:`~tokengym.agents.engine.rollout.collect`, with ``policy_version`` the generator's and ``generation_counts``
    (requests, dropped tokens) per episode."""
    check_collect_args("collect", env, greedy)
    if env.autoreset_mode.name != "DISABLED":
        raise ValueError("collect() runs lockstep batches: create the env with autoreset_mode='disabled'")
    check_fits(generator, env)
    with torch.inference_mode():
        logps, counts, version = _replay(env, generator, greedy, seed, samples)
    ro = snapshot_rollout(env, logps.clone())
    ro.policy_version = version
    ro.generation_counts = {k: v.clone() for k, v in counts.items()}
    return ro if critic is None else attach_values(ro, critic)


def _replay(env, gen, greedy: bool, seed: int | None, samples: list | None):
    env.reset(seed=seed, options={"samples": samples} if samples is not None else None)
    N, M, dev = env.num_envs, env.max_new_tokens, env.device
    rule = env.stop_rule()
    key = None if greedy else gen.rollout_key()
    offset = gen.row_offset
    logps = torch.zeros((N, M + 1), dtype=torch.float32, device=dev)
    counts = {k: torch.zeros(N, dtype=torch.long, device=dev) for k in ("requests", "dropped")}
    pad = torch.full((N,), env.pad_id, dtype=torch.long, device=dev)
    version: list[int | None] = []
    while not env.all_done:
        ready = (~env.done & ~env.waiting).nonzero().flatten()
        if not len(ready):  # every live row waits for a reply: a step of held rows collects it
            env.step(pad, hold=torch.ones(N, dtype=torch.bool, device=dev))
            continue
        rows = ready.tolist()
        tokens, mask = env.tokens[ready].tolist(), env.attention_mask[ready].tolist()
        gen_len, ids = env.gen_len[ready].tolist(), env.episode_id[ready].tolist()
        masker = getattr(env, "masker", None)  # the env's grammar: the engine applies it (and the env checks it)
        requests = [GenerationRequest(
            prompt_ids=[t for t, m in zip(tokens[i], mask[i]) if m], max_tokens=M - gen_len[i], sampling=gen.sampling,
            stop_token_ids=rule.token_ids, stop_sequences=rule.sequences, stop_strings=rule.strings, greedy=greedy,
            seed=None if key is None else stream_seed(key, ids[i] + offset), step=gen_len[i],
            grammar=None if masker is None else masker.engine_grammar(rows[i])) for i in range(len(rows))]
        outs = gen.generate(requests)
        _check_outputs(gen, requests, outs, rows, version, env.vocab_size)
        counts["requests"][ready] += 1
        _step_through(env, ready, outs, logps, counts["dropped"])
    return logps[:, :M], counts, (version[0] if version else None)


def _step_through(env, ready: torch.Tensor, outs: list, logps: torch.Tensor, dropped: torch.Tensor) -> None:
    """Step ``env`` with the generated tokens of rows ``ready`` (every other row held) until each has used its tokens
    or the env ended its turn; record their log-probs at their columns, count what the env cut off."""
    N, dev = env.num_envs, env.device
    lens = torch.tensor([len(o.token_ids) for o in outs], device=dev)
    K = int(lens.max())
    toks = torch.tensor([o.token_ids + [env.pad_id] * (K - len(o.token_ids)) for o in outs], dtype=torch.long, device=dev)
    lps = torch.tensor([o.logprobs + [0.0] * (K - len(o.logprobs)) for o in outs], dtype=torch.float32, device=dev)
    acting = torch.ones(len(ready), dtype=torch.bool, device=dev)
    actions = torch.full((N,), env.pad_id, dtype=torch.long, device=dev)
    for t in range(K):
        acting &= t < lens
        if not bool(acting.any()):
            break
        rows = ready[acting]
        actions[rows] = toks[acting, t]
        hold = torch.ones(N, dtype=torch.bool, device=dev)
        hold[rows] = False
        logps[rows, env.gen_len[rows]] = lps[acting, t]
        env.step(actions, hold=hold)
        ended = env.done[ready] | env.waiting[ready]  # the env ended the turn (or the episode)
        if env.replied:
            answered = torch.zeros(N, dtype=torch.bool, device=dev)
            answered[torch.tensor(env.replied, device=dev)] = True
            ended |= answered[ready]
        cut = acting & ended
        dropped[ready[cut]] += lens[cut] - (t + 1)
        acting &= ~ended


def _check_outputs(gen: Any, requests: list[GenerationRequest], outs: list, rows: list[int], version: list,
                   vocab_size: int) -> None:
    """``RuntimeError`` naming the generator and the row of an answer the replay cannot use."""
    name = type(gen).__name__
    if not isinstance(outs, list) or len(outs) != len(requests):
        raise RuntimeError(f"{name}.generate() answered {len(outs) if isinstance(outs, list) else type(outs).__name__} "
                           f"generations to {len(requests)} requests")
    for r, req, o in zip(rows, requests, outs):
        n = len(o.token_ids)
        if not 1 <= n <= req.max_tokens or len(o.logprobs) != n:
            raise RuntimeError(f"{name} generated {n} tokens with {len(o.logprobs)} log-probs for row {r}, whose "
                               f"budget is {req.max_tokens}: each generation has 1 to max_tokens tokens, one log-prob each")
        bad = next((t for t in o.token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
        if bad is not None:
            raise RuntimeError(f"{name} generated token id {bad!r} for row {r}, outside the vocabulary [0, {vocab_size})")
        if o.finish_reason not in FINISH_REASONS:
            raise RuntimeError(f"{name} ended row {r} with finish reason {o.finish_reason!r}; expected one of {FINISH_REASONS}")
        if not all(math.isfinite(x) and x <= 1e-4 for x in o.logprobs):
            raise RuntimeError(f"{name} reported a log-prob that is not finite or is above 0 for row {r}")
        if version and o.version != version[0]:
            raise RuntimeError(f"{name} answered with weights of versions {version[0]} and {o.version} in one rollout")
        version[:1] = [o.version]

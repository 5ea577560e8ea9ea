"""The rollout engine: drive a ``TokenVectorEnv`` with a policy (any :class:`~tokengym.agents.engine.sampler.Sampler`,
whose declared capabilities decide which of the tricks below run) and collect a ``Rollout``.

``collect`` resets the env (``DISABLED`` autoreset: one batch of episodes), prefills the prompts once (a GRPO group's
shared prompt once for its G rows), then samples and decodes one token per step until every slot is done, dropping
finished rows from the policy's cache as it goes. ``collect_episodes`` streams a prompt list through a ``NEXT_STEP``
env instead (continuous batching). Each episode samples from its own stream, so neither trick changes a token.
Everything stays on the env's device; the only host syncs are the env's one-per-step stop check, a live-row count
every few steps and the reward calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import torch

from tokengym.envs.masks import TokenMasks
from tokengym.agents.engine.generation import is_generation_backend
from tokengym.agents.engine.resources import check_fits
from tokengym.agents.engine.rollout_data import Rollout, attach_values, check_collect_args, snapshot_rollout
from tokengym.agents.engine.sampler import SamplerCapabilities, capabilities_of
from tokengym.agents.runtime.sharding import full_weights

__all__ = ["Rollout", "attach_values", "collect", "collect_episodes", "evaluate", "evaluate_at_k", "heldout_samples", "turn_metrics", "used_columns", "used_slice", "trimmed_logprobs"]


def concat_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """One rollout of the episodes of ``parts`` (rollouts of the same env), in order."""
    out = {}
    for f in dataclasses.fields(parts[0]):
        vs = [getattr(p, f.name) for p in parts]
        if isinstance(vs[0], torch.Tensor):
            out[f.name] = torch.cat(vs)
        elif isinstance(vs[0], list):
            out[f.name] = [x for v in vs for x in v]
        elif isinstance(vs[0], dict):
            out[f.name] = {k: torch.cat([v[k] for v in vs]) for k in vs[0]}
        elif f.name == "token_masks":
            out[f.name] = TokenMasks.cat(vs)
        else:
            out[f.name] = vs[0]
    return Rollout(**out)


def turn_metrics(ro: Rollout) -> dict[str, float]:
    """Multi-turn counters of a rollout for the logs (``env/replies_per_episode`` is a tool env's call rate)."""
    if not ro.turn_counts:
        return {}
    n = max(ro.num_episodes, 1)
    st = ro.turn_stats
    return {"env/turns_per_episode": st["turns"] / n, "env/replies_per_episode": st["replies"] / n,
            "env/tool_errors": float(st["tool_errors"]), "env/tool_timeouts": float(st["tool_timeouts"]),
            "env/reply_overflows": float(st["reply_overflows"]), "env/max_turns_truncations": float(st["max_turns"]),
            **({"agent/errors": float(st["agent_errors"]), "agent/timeouts": float(st["agent_timeouts"])}
               if "agent_errors" in st else {})}  # an agent env's


def used_columns(action_mask: torch.Tensor) -> int:
    """Generated columns up to the end of the longest row of ``action_mask[N, M]`` (at least 1). Later
    columns are padding in every row and no real token attends to them, so a full pass over the batch
    (reference, pi_old, a minibatch update) can skip them. That pays when the token budget is generous
    for the task, not when the longest completion nearly fills it (default Arithmetic-v0: ``bench/RESULTS.md``)."""
    return max(int(action_mask.sum(1).max()), 1) if action_mask.numel() else 1


def used_slice(ro: "Rollout", rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(tokens, mask, prompt_len, m)`` of the rollout's ``rows`` (default: all) without the columns that are
    padding in every one of them: generated columns past :func:`used_columns` ``m``, and the leading prompt
    columns left of the longest prompt (the env pads to ``max_prompt_len``, which a chat template or a BPE
    tokenizer can make far longer than the prompts). Positions come from the mask, so a full pass over the slice
    (reference, pi_old, an update) gives the same log-probs of the first ``m`` generated tokens."""
    P = ro.prompt_len
    tokens, mask = (ro.tokens, ro.attention_mask) if rows is None else (ro.tokens[rows], ro.attention_mask[rows])
    longest, m = torch.stack([mask[:, :P].sum(1).max(), mask[:, P:].sum(1).max()]).tolist() if len(mask) else (P, 1)
    lead, m = P - max(int(longest), 1), max(int(m), 1)
    return tokens[:, lead : P + m], mask[:, lead : P + m], P - lead, m


def trimmed_logprobs(fn, ro: "Rollout", masked: bool = True) -> torch.Tensor:
    """``fn(tokens, mask, prompt_len)`` (a policy or reference) over :func:`used_slice` only, zero-padded back to
    ``[N, M]``; with ``masked`` and a rollout sampled under action masks, of the masked distributions
    (``fn(..., allowed=masks)``)."""
    tokens, mask, p, m = used_slice(ro)
    kw = {"allowed": ro.token_masks.columns(m)} if masked and ro.token_masks is not None else {}
    return torch.nn.functional.pad(fn(tokens, mask, p, **kw), (0, ro.action_mask.shape[1] - m))


COMPACT_EVERY = 8
"""Decode steps between checks for finished rows to drop from the policy's cache (one host sync per check)."""
COMPACT_BELOW = 0.75
"""Drop finished rows once the live ones are at most this fraction of the rows the cache holds."""


def collect(env, policy, critic=None, *, greedy: bool = False, seed: int | None = None, samples: list | None = None,
            compact: bool = True, share_prefix: bool | None = None) -> Rollout:
    """Run one lockstep batch of episodes of ``env`` with ``policy``; return the finished ``Rollout``.

    Args:
        env: a :class:`~tokengym.envs.TokenVectorEnv` in ``DISABLED`` autoreset mode.
        policy: a :class:`~tokengym.agents.Policy` or any other :class:`~tokengym.agents.engine.sampler.Sampler`, or
            an inference engine that serves only the generation seam (:class:`~tokengym.agents.engine.generation.Generator`,
            e.g. :class:`~tokengym.agents.engine.vllm_backend.VLLMGenerator`), whose generations
            :func:`~tokengym.agents.engine.replay.collect_generated` replays through the env.
        critic: optional :class:`~tokengym.agents.Critic`; its values are computed in one pass at the end.
        greedy: argmax decoding (evaluation).
        seed: passed to ``env.reset``.
        samples: explicit prompts for ``env.reset(options={"samples": ...})`` (one per group).
        compact: every :data:`COMPACT_EVERY` steps, drop finished rows from the policy's cache
            (``Policy.compact``; samplers with the ``compact`` capability), so a long-tailed batch pays only for its
            live rows. Each row samples from its own stream (``Policy.sample(ids=, steps=)``), so the tokens do not
            change; log-probs agree to float rounding (a matrix product's rounding can depend on its row count).
        share_prefix: encode each group's prompt once for its G rows (``Policy.prefill(copies=G)``; samplers with
            the ``shared_prefix`` capability, the others encode every row). ``None``: when ``group_size > 1`` and
            every group's rows hold the same prompt (always, for prompts the env draws); ``True`` with rows of a
            group holding different prompts is an error.
    """
    check_collect_args("collect", env, greedy)
    if env.autoreset_mode.name != "DISABLED":
        raise ValueError("collect() runs lockstep batches: create the env with autoreset_mode='disabled'")
    if is_generation_backend(policy):  # an inference engine: whole generations, replayed token by token
        from tokengym.agents.engine.replay import collect_generated

        return collect_generated(env, policy, critic, greedy=greedy, seed=seed, samples=samples)
    check_fits(policy, env)
    with torch.inference_mode():
        logps = _run_episodes(env, policy, greedy, seed, samples, compact, share_prefix)
    ro = snapshot_rollout(env, logps.clone())
    return ro if critic is None else attach_values(ro, critic)


def _prefix_copies(env, tokens: torch.Tensor, mask: torch.Tensor, share_prefix: bool | None) -> int:
    """G if each group's prompt can be encoded once for its G rows, else 1 (``share_prefix=True`` on groups whose rows
    hold different prompts is an error)."""
    G = env.group_size
    if share_prefix is False or G == 1:
        return 1
    t, m = tokens.view(-1, G, tokens.shape[1]), mask.view(-1, G, mask.shape[1])
    differ = ((t != t[:, :1]) | (m != m[:, :1])).any(2).any(1)
    if not bool(differ.any()):
        return G
    if share_prefix:
        g = int(differ.nonzero()[0])
        raise ValueError(f"share_prefix=True, but the {G} rows of group {g} hold different prompts: prefix sharing "
                         "needs every row of a group to start from the same prompt (pass share_prefix=None or False)")
    return 1


def _capabilities(env, policy, width: int) -> SamplerCapabilities:
    """``policy``'s sampler capabilities for a prefill of ``width`` columns; a multi-turn env needs ``extend``."""
    caps = capabilities_of(policy, width)
    if getattr(env, "multi_turn", False) and not caps.extend:
        raise ValueError(f"{type(policy).__name__} has no 'extend' capability (appending an env's reply tokens to a "
                         "row), so it cannot run a multi-turn env")
    return caps


@contextlib.contextmanager
def _rollout(policy, caps: SamplerCapabilities, greedy: bool) -> Iterator[None]:
    """A rollout's span: its sampling-stream key is drawn at the start (only for per-row streams, and not for greedy
    decoding, which draws nothing, so evaluating leaves the training stream alone); the policy's cache is freed at
    the end. An FSDP2-sharded policy decodes from its weights gathered once for the whole rollout."""
    with full_weights(policy):
        try:
            if not greedy and caps.row_streams:
                policy.begin_rollout()
            yield
        finally:
            policy.end_rollout()


def _run_episodes(env, policy, greedy: bool, seed: int | None, samples: list | None, compact: bool = True,
                  share_prefix: bool | None = None) -> torch.Tensor:
    """Reset ``env`` and step it to the end with ``policy``; return the sampled tokens' log-probs ``[N, M]``."""
    obs, _ = env.reset(seed=seed, options={"samples": samples} if samples is not None else None)
    P, M = env.max_prompt_len, env.max_new_tokens
    lead = P - max(int(obs["mask"][:, :P].sum(1).max()), 1)  # prompt columns that are padding in every row
    caps = _capabilities(env, policy, P - lead + M)
    with _rollout(policy, caps, greedy):
        tokens, mask = obs["tokens"][:, lead:P], obs["mask"][:, lead:P]
        copies = _prefix_copies(env, tokens, mask, share_prefix)
        logits = (policy.prefill(tokens, mask, max_new_tokens=M, copies=copies) if copies > 1 and caps.shared_prefix
                  else policy.prefill(tokens, mask, max_new_tokens=M))
        # every live row writes a column per step (or waits for a slow reply: bounded by its timeout)
        return _decode_loop(env, policy, caps, logits, greedy, compact, M + 1000)


def _decode_loop(env, policy, caps: SamplerCapabilities, logits: torch.Tensor, greedy: bool, compact: bool, limit: int,
                 on_ended=None) -> torch.Tensor:
    """Sample, step ``env`` and decode until every slot has finished (at most ``limit`` steps); return the sampled
    tokens' log-probs ``[N, M]`` (of each slot's current episode).

    ``rows`` are the env slots the policy's cache holds, in cache order (all of them until finished rows are
    compacted away, where ``caps.compact``); the policy samples and decodes those rows only, and the env's other slots
    get a pad action, which it ignores. Slots the env restarts with a new episode (next-step mode) get their prompt
    encoded into their cache rows, and ``on_ended(slots, logps)`` sees the slots whose episode ended in a step, before
    a restart overwrites them.
    """
    P, M, N = env.max_prompt_len, env.max_new_tokens, env.num_envs
    multi_turn = getattr(env, "multi_turn", False)
    streams, compact = caps.row_streams, compact and caps.compact
    logps = torch.zeros((N, M + 1), dtype=torch.float32, device=env.device)  # column M: finished rows' samples
    rows = torch.arange(N, device=env.device)
    actions = torch.full((N,), env.pad_id, dtype=torch.long, device=env.device)
    # slots that restart move at their own pace: per-row cache columns from the first step
    hold0 = torch.zeros(N, dtype=torch.bool, device=env.device) if env.autoreset_mode.name == "NEXT_STEP" else None
    masker = getattr(env, "masker", None)
    for step in range(limit):
        gen = env.gen_len[rows]
        if masker is not None:  # sample from the masked, renormalised distribution: its log-probs are the behaviour's
            logits = env.mask_logits(logits, rows)
        a, lp = (policy.sample(logits, greedy=greedy, ids=env.episode_id[rows], steps=gen) if streams
                 else policy.sample(logits, greedy=greedy))
        actions[rows] = a
        held = env.waiting[rows].clone() if multi_turn and env.pending_replies else None  # actions the env ignores
        skip = (env.done | env.finished)[rows]  # ended, or (next-step mode) idle: the action is ignored
        logps[rows, torch.where(skip if held is None else skip | held, M, gen)] = lp
        env.step(actions)
        if on_ended is not None and env.ended:
            on_ended(env.ended, logps[:, :M])
        if env.all_done:
            break
        hold = held if held is not None else None if hold0 is None else hold0[: len(rows)]
        logits = policy.decode(a) if hold is None else policy.decode(a, hold=hold)
        if multi_turn and env.replied:  # the env answered some rows: append their replies to those caches
            logits = _extend_replies(env, policy, logits, rows)
        if env.restarted:  # slots that took a new prompt: encode it into their cache rows
            slots = torch.tensor(env.restarted, device=env.device)  # (their old log-probs past the new episode's end
            r = _cache_rows(env, rows, slots)                      # are masked out by the snapshot)
            logits = logits.clone()
            logits[r] = policy.refill(r, env.tokens[slots, :P], env.attention_mask[slots, :P])
        if compact and step % COMPACT_EVERY == COMPACT_EVERY - 1:
            live = ~env.finished[rows]
            if int(live.sum()) <= COMPACT_BELOW * len(rows):
                keep = live.nonzero().flatten()
                if policy.compact(keep):
                    rows, logits = rows[keep], logits[keep]
                else:  # the policy cannot drop rows (generic transformers path)
                    compact = False
    return logps[:, :M]


def collect_episodes(env, policy, samples: Sequence[Any] | None = None, n: int | None = None, *, greedy: bool = False,
                     seed: int | None = None) -> Rollout:
    """Run ``samples`` (or the task's next ``n`` prompts) with continuous batching; return them as one ``Rollout``.

    The env (``autoreset_mode="next_step"``, ``group_size=1``) runs the list through next-step autoresets
    (``reset(options={"episodes": ...})``): a slot whose episode ends takes the next prompt at once, and the policy
    encodes it into that row of its cache (``Policy.refill``) while the other rows go on, so no step waits for the
    batch's longest episode. Rows left idle at the end are dropped from the cache, as in :func:`collect`.

    The episodes are exactly the given prompts and come back **in start order** (row ``i`` is ``samples[i]``), never
    in finish order: a caller that stopped at the first ``n`` finished episodes would keep the short ones and bias
    every average towards them. Each episode samples from its own stream (keyed by its index in the list), so the
    tokens do not depend on which slot ran it or on the batch size.
    """
    check_collect_args("collect_episodes", env, greedy)
    if env.autoreset_mode.name != "NEXT_STEP":
        raise ValueError("collect_episodes() refills finished slots through next-step autoresets: create the env with "
                         "autoreset_mode='next_step' (collect() runs lockstep batches)")
    if env.group_size != 1:  # the env refuses next_step with groups; this guards envs built otherwise
        raise ValueError(f"continuous batching needs group_size=1, got {env.group_size}: a GRPO group's episodes must "
                         "start together, which collect() does")
    if is_generation_backend(policy):
        raise ValueError(f"continuous batching (a 'next_step' env) runs token-level samplers; {type(policy).__name__} "
                         "serves whole generations (an engine batches them itself): use collect() on a 'disabled' env")
    if (samples is None) == (n is None):
        raise ValueError("give collect_episodes() either samples or n (the task's next n prompts), not both")
    check_fits(policy, env)
    episodes = list(samples) if samples is not None else int(n)
    caps = _capabilities(env, policy, env.seq_len)
    if not caps.refill:
        raise ValueError(f"continuous batching needs a sampler with the 'refill' capability "
                         f"({caps.why_not or type(policy).__name__}); use collect() on a 'disabled' env instead")
    parts: list[tuple[list[int], Rollout]] = []
    with torch.inference_mode():
        _run_continuous(env, policy, caps, episodes, greedy, seed, parts)
    order = [e for ids, _ in parts for e in ids]
    # concatenated outside inference mode: fresh tensors that autograd accepts
    return concat_rollouts([p for _, p in parts]).select(sorted(range(len(order)), key=order.__getitem__))


def _run_continuous(env, policy, caps: SamplerCapabilities, episodes: list | int, greedy: bool, seed: int | None,
                    parts: list) -> None:
    """:func:`collect_episodes`' loop: appends ``(episode ids, Rollout of them)`` to ``parts`` as episodes end."""
    obs, _ = env.reset(seed=seed, options={"episodes": episodes})
    n = episodes if isinstance(episodes, int) else len(episodes)
    P, M = env.max_prompt_len, env.max_new_tokens

    def ended(slots: list[int], logps: torch.Tensor) -> None:
        parts.append((env.episode_id[slots].tolist(), snapshot_rollout(env, logps, slots)))

    with _rollout(policy, caps, greedy):
        logits = policy.prefill(obs["tokens"][:, :P], obs["mask"][:, :P], max_new_tokens=M)  # full width: refills
        _decode_loop(env, policy, caps, logits, greedy, True, n * (M + 1000), on_ended=ended)


def _extend_replies(env, policy, logits: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Feed the reply tokens the env just appended (slots ``env.replied``) to ``policy``, whose cache holds the slots
    ``held`` in that order; their logits replace those rows'."""
    slots = torch.tensor(env.replied, device=env.device)
    rows = _cache_rows(env, held, slots)  # answered slots are live, so the cache holds them
    n = env.reply_len[slots]
    k = int(n.max())
    start = env.max_prompt_len + env.gen_len[slots] - n
    cols = (start[:, None] + torch.arange(k, device=env.device)).clamp(max=env.seq_len - 1)
    logits = logits.clone()
    logits[rows] = policy.extend(rows, env.tokens[slots[:, None], cols], n)
    return logits


def _cache_rows(env, held: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows of env ``slots``, for a cache that holds the slots ``held`` in that order."""
    at = torch.full((env.num_envs,), -1, dtype=torch.long, device=env.device)
    at[held] = torch.arange(len(held), device=env.device)
    return at[slots]


def heldout_samples(task, n: int, seed: int = 10_007) -> list[dict[str, Any]]:
    """``n`` prompts from ``task`` drawn from a fixed seed kept apart from training seeds (a task with a held-out
    split of its own, such as an agent env's ``eval_data``, gives them from it: ``heldout_batch``)."""
    import numpy as np

    if hasattr(task, "heldout_batch"):
        return task.heldout_batch(n, seed)
    return task.batch(np.random.default_rng(seed), n)


def _eval_episodes(policy, env, samples: list[dict[str, Any]], greedy: bool) -> list[Rollout]:
    """The episodes of ``samples`` in order, as rollouts: one continuous-batching pass on a ``next_step`` env, else
    lockstep batches of ``env.num_envs`` (the last one padded, the padding dropped)."""
    if env.group_size != 1:
        raise ValueError("evaluate() needs an env with group_size=1")
    n = env.num_envs
    if env.autoreset_mode.name == "NEXT_STEP":
        return [collect_episodes(env, policy, list(samples), greedy=greedy)]
    parts = []
    for start in range(0, len(samples), n):
        chunk = list(samples[start : start + n])
        ro = collect(env, policy, greedy=greedy, samples=chunk + chunk[:1] * (n - len(chunk)))
        parts.append(ro.select(range(len(chunk))))
    return parts


@torch.inference_mode()
def evaluate_at_k(policy, env, samples: list[dict[str, Any]], n: int, k: int) -> dict[str, Any]:
    """pass@k, maj@k and mean@k (:mod:`~tokengym.agents.engine.eval_metrics`) of ``n`` sampled completions of each
    of ``samples`` (correct: outcome >= 1, as ``accuracy``). The answer that maj@k votes on is the task's
    ``extract_answer(completion)`` where the task has one, else the completion text (stripped).

    Returns the three metrics (named with ``k``), ``n``, ``k``, ``sampled`` (:func:`evaluate`'s metrics of the same
    ``n * len(samples)`` episodes) and ``per_prompt``: for each prompt its ``answers`` and ``correct`` flags in
    sampling order (sample j of every prompt is drawn in the j-th pass over the prompts)."""
    from tokengym.agents.engine.eval_metrics import at_k_metrics

    parts = _eval_episodes(policy, env, list(samples) * n, greedy=False)
    outcome = torch.cat([ro.outcome for ro in parts]).tolist()
    texts = [t for ro in parts for t in ro.completions]
    extract = getattr(getattr(env, "task", None), "extract_answer", None)
    answers = [extract(t) if callable(extract) else t.strip() for t in texts]
    p = len(samples)
    per_prompt = [{"answers": [answers[j * p + i] for j in range(n)],
                   "correct": [outcome[j * p + i] >= 1.0 - 1e-6 for j in range(n)]} for i in range(p)]
    metrics = at_k_metrics([(row["answers"], row["correct"]) for row in per_prompt], k)
    return {**metrics, "n": n, "k": k, "sampled": _eval_summary(parts), "per_prompt": per_prompt}


@torch.inference_mode()
def evaluate(policy, env, samples: list[dict[str, Any]], greedy: bool = True) -> dict[str, float]:
    """Score ``policy`` on ``samples`` (group_size 1 env): in lockstep batches of ``env.num_envs``, or with
    continuous batching (:func:`collect_episodes`) on a ``next_step`` env, which gives the same results faster when
    there are more prompts than slots.

    Returns ``mean_reward`` (the env's outcome reward), ``accuracy`` (fraction with outcome >= 1,
    which for 0/1 verifiers is the fraction solved), ``mean_length`` and ``truncated``; for a multi-turn env also
    ``replies_per_episode`` (a tool env's calls per episode).
    """
    return _eval_summary(_eval_episodes(policy, env, samples, greedy))


def _eval_summary(parts: list[Rollout]) -> dict[str, float]:
    """:func:`evaluate`'s metrics of its episodes."""
    rewards = [ro.outcome for ro in parts]
    lengths = [ro.lengths.float() for ro in parts]
    truncs = [ro.truncated.float() for ro in parts]
    replies = [ro.turn_counts["replies"].float() for ro in parts if ro.turn_counts]
    r = torch.cat(rewards)
    out = {
        "mean_reward": r.mean().item(),
        "accuracy": (r >= 1.0 - 1e-6).float().mean().item(),
        "mean_length": torch.cat(lengths).mean().item(),
        "truncated": torch.cat(truncs).mean().item(),
    }
    if replies:
        out["replies_per_episode"] = torch.cat(replies).mean().item()
    return out

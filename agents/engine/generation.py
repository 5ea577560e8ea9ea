"""The generation seam: what an inference engine can serve (vLLM, a remote worker), beside the token-level ``Sampler``.

A :class:`Generator` takes whole requests and returns whole generations::

    requests = [GenerationRequest(prompt_ids=history, max_tokens=M - g, stop_token_ids=..., stop_sequences=...,
                                  stop_strings=..., sampling=gen.sampling, seed=..., step=g), ...]
    for out in gen.generate(requests):       # one Generation per request, in order
        out.token_ids, out.logprobs, out.finish_reason, out.version
    gen.load_weights(named_tensors, version)  # the trainer's new weights, by name, with their version

:func:`~tokengym.agents.engine.replay.collect_generated` turns generations into a ``Rollout`` by replaying each
token through ``env.step``, so the env's contract (stops, step and PRM rewards, replies, the layout) is untouched.

The contract every generator keeps:

- **Tokens in = tokens out.** ``prompt_ids`` is the whole token history (a multi-turn episode's replies included);
  a generator never decodes it to text and re-tokenizes it.
- **Behaviour log-probs.** ``logprobs[i]`` is token ``i``'s log-probability under the distribution it was drawn from
  (``sampling``'s temperature, top-k and top-p applied; greedy: under the temperature-scaled distribution).
- **Its stop rule is the env's.** A generation ends after a ``stop_token_ids`` token, after a ``stop_sequences``
  sequence completed inside it, or at ``max_tokens``; an engine that matches ``stop_strings`` (their texts) instead
  may stop earlier (the replay then asks it to go on), never later.
- **Streams.** With ``seed`` set, token ``i`` is drawn from the stream ``(seed, step + i)`` only, so an episode's draws
  do not depend on its batch (the in-process :class:`PolicyGenerator` draws exactly what the token-level sampler
  draws); an engine with per-request seeds derives one from ``(seed, step)``.

:func:`~tokengym.agents.engine.backend_check.check_generator` is the conformance check against the token-level path.

**Scoring** (optional): ``gen.score(sequences, starts)`` returns, for each token sequence, the log-probabilities at
temperature 1 of its tokens from ``starts[i]`` on, each given every token before it (an engine's prompt log-probs).
This is how a teacher served by an engine grades a student's tokens (distillation's ``sampled`` estimator);
:func:`policy_score` serves it in process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from tokengym.agents.engine.backends import SAMPLERS  # the backends' names, importable here as before
from tokengym.agents.engine.seam import (FINISH_REASONS, Generation, GenerationRequest, Generator, SamplingSettings,
                                        check_requests, check_scoring, request_seed, signed64, stream_seed)

__all__ = ["FINISH_REASONS", "SAMPLERS", "Generation", "GenerationRequest", "Generator", "PolicyGenerator", "SamplingSettings",
           "is_generation_backend", "policy_generate", "policy_score", "request_seed", "stream_seed"]

def is_generation_backend(obj: Any) -> bool:
    """Whether ``obj`` serves only the generation seam (a token-level ``Sampler`` such as ``Policy`` runs the
    token-level loop, even though ``Policy`` can serve generations too: :class:`PolicyGenerator`)."""
    from tokengym.agents.engine.sampler import Sampler

    return isinstance(obj, Generator) and not isinstance(obj, Sampler)


# ---------------------------------------------------------------------------------------------- the in-process backend
@dataclass
class _Batch:
    """Requests that one decode loop serves together: the same settings, stop rule and greedy flag."""

    index: list[int] = field(default_factory=list)
    requests: list[GenerationRequest] = field(default_factory=list)


def policy_generate(policy: Any, requests: Sequence[GenerationRequest], version: int | None = None) -> list[Generation]:
    """Serve ``requests`` with ``policy``'s KV-cached decoder (the fast path where the model has one): one prefill of
    the left-padded histories (a group's identical prompts encoded once), then one decode step per token, with the
    stop checks on the device and a host sync every few steps to drop finished rows (in chunks, as ``collect`` does).
    Requests with different settings or stop rules run as separate batches."""
    from tokengym.agents.runtime.sharding import full_weights

    check_requests(requests, policy.model.config.vocab_size if hasattr(policy.model, "config") else None)
    batches: dict[tuple, _Batch] = {}
    for i, r in enumerate(requests):  # (grammars are per row: requests with different ones share a batch)
        b = batches.setdefault((r.sampling, r.stop_token_ids, r.stop_sequences, r.greedy, r.seed is None), _Batch())
        b.index.append(i)
        b.requests.append(r)
    out: list[Generation | None] = [None] * len(requests)
    with torch.inference_mode(), full_weights(policy):
        for b in batches.values():
            for i, g in zip(b.index, _decode_batch(policy, b.requests)):
                g.version = version
                out[i] = g
    return out  # type: ignore[return-value]


def _group_size(requests: Sequence[GenerationRequest]) -> int:
    """G > 1 when the requests are groups of G consecutive identical prompts (a GRPO group's rows), else 1."""
    first = requests[0].prompt_ids
    g = 1
    while g < len(requests) and list(requests[g].prompt_ids) == list(first):
        g += 1
    if g == 1 or len(requests) % g:
        return 1
    for s in range(0, len(requests), g):
        p = list(requests[s].prompt_ids)
        if any(list(requests[s + j].prompt_ids) != p for j in range(1, g)):
            return 1
    return g


COMPACT_EVERY = 8
"""Decode steps between host syncs that look for finished rows (and drop them from the cache)."""


def _decode_batch(policy: Any, reqs: Sequence[GenerationRequest]) -> list[Generation]:
    from tokengym.agents.engine.policy import row_uniforms, sample_logits

    dev, R = policy.device, len(reqs)
    first = reqs[0]
    pad = int(policy.tokenizer.pad_token_id)
    L = max(len(r.prompt_ids) for r in reqs)
    tokens = torch.full((R, L), pad, dtype=torch.long)
    mask = torch.zeros((R, L), dtype=torch.bool)
    for i, r in enumerate(reqs):
        tokens[i, L - len(r.prompt_ids):] = torch.tensor(list(r.prompt_ids), dtype=torch.long)
        mask[i, L - len(r.prompt_ids):] = True
    tokens, mask = tokens.to(dev), mask.to(dev)
    budget = torch.tensor([int(r.max_tokens) for r in reqs], device=dev)
    M = int(budget.max())
    s = first.sampling
    seeds = torch.tensor([signed64(r.seed or 0) for r in reqs], dtype=torch.long, device=dev)
    steps0 = torch.tensor([int(r.step) for r in reqs], dtype=torch.long, device=dev)
    is_stop = torch.zeros(max(int(policy.model.config.vocab_size), 1), dtype=torch.bool, device=dev)
    if first.stop_token_ids:
        is_stop[list(first.stop_token_ids)] = True
    seqs = [torch.tensor(q, device=dev) for q in first.stop_sequences]
    out_tok = torch.full((R, M), pad, dtype=torch.long, device=dev)
    out_lp = torch.zeros((R, M), dtype=torch.float32, device=dev)
    length = torch.zeros(R, dtype=torch.long, device=dev)
    stopped = torch.zeros(R, dtype=torch.bool, device=dev)
    finished = torch.zeros(R, dtype=torch.bool, device=dev)
    g = _group_size(reqs)
    caps = policy.capabilities(L + M)
    masker = _request_masker(policy, reqs, M, dev)
    try:
        logits = (policy.prefill(tokens, mask, max_new_tokens=M, copies=g) if g > 1 and caps.shared_prefix
                  else policy.prefill(tokens, mask, max_new_tokens=M))
        rows = torch.arange(R, device=dev)  # the requests the cache holds, in cache order
        compact = caps.compact
        for t in range(M):
            uniform = None if first.greedy or first.seed is None else row_uniforms(seeds[rows], torch.zeros_like(rows),
                                                                                   steps0[rows] + t)
            if masker is not None:  # the rows' grammars: sample from the masked distribution
                logits = masker.mask_logits(logits, ~finished, rows)
            tok, lp = sample_logits(logits, s.temperature, s.top_k, s.top_p, first.greedy, policy.generator, uniform)
            live = ~finished[rows]
            if masker is not None:
                every = torch.zeros(R, dtype=torch.long, device=dev)
                every[rows] = tok
                masker.take(~finished, every, torch.full((R,), t, device=dev))
            out_tok[rows, t] = torch.where(live, tok, out_tok[rows, t])
            out_lp[rows, t] = torch.where(live, lp, out_lp[rows, t])
            hit = is_stop[tok]
            for q in seqs:  # a stop sequence completed inside this generation
                k = q.numel()
                if t >= k - 1:
                    hit |= (out_tok[rows, t - k + 1 : t + 1] == q).all(1)
            now = live & (hit | (t + 1 >= budget[rows]))
            stopped[rows] |= live & hit
            length[rows] += live.long()
            finished[rows] |= now
            if t + 1 == M:
                break
            if t % COMPACT_EVERY == COMPACT_EVERY - 1:
                live = ~finished[rows]
                n_live = int(live.sum())
                if n_live == 0:
                    break
                if compact and n_live <= 0.75 * len(rows):
                    keep = live.nonzero().flatten()
                    if policy.compact(keep):
                        rows, tok, logits = rows[keep], tok[keep], logits[keep]
                    else:
                        compact = False
            logits = policy.decode(tok)
    finally:
        policy.end_rollout()
    toks, lps, lens, why = out_tok.tolist(), out_lp.tolist(), length.tolist(), stopped.tolist()
    return [Generation(toks[i][: lens[i]], lps[i][: lens[i]], "stop" if why[i] else "length") for i in range(R)]


def _request_masker(policy: Any, reqs: Sequence[GenerationRequest], M: int, dev: torch.device):
    """An :class:`~tokengym.envs.masks.ActionMasker` over the requests where any has a grammar, else ``None``."""
    if all(r.grammar is None for r in reqs):
        return None
    from tokengym.envs.masks import ActionMasker

    masker = ActionMasker(len(reqs), M, len(policy.tokenizer), policy.tokenizer, dev,
                          spec_for=lambda sample, turn: sample["grammar"])
    masker.start(range(len(reqs)), [{"grammar": r.grammar} for r in reqs])
    return masker


@torch.no_grad()
def policy_score(policy: Any, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
    """The scoring call in process: log-probs at temperature 1 of ``sequences[i][starts[i]:]`` under ``policy``'s
    model, in one right-padded forward."""
    check_scoring(sequences, starts)
    if not sequences:
        return []
    width = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long, device=policy.device)
    mask = torch.zeros_like(tokens)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[i, : len(seq)] = 1
    logits = policy.model(input_ids=tokens, attention_mask=mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(2, tokens[:, 1:, None])[..., 0].tolist()
    return [lp[i][int(start) - 1 : len(seq) - 1] for i, (seq, start) in enumerate(zip(sequences, starts))]


class PolicyGenerator:
    """A :class:`~tokengym.agents.Policy` as a :class:`Generator`: its fast decoder serves whole generations (what a
    remote worker serves, and how the generation seam is checked against the token-level path). It shares the
    policy's module, so the trainer's updates are its weights; :meth:`load_weights` records their version."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.model = policy.model  # what resource checks read (positions, vocabulary)
        self.version: int | None = None

    @property
    def sampling(self) -> SamplingSettings:
        p = self.policy
        return SamplingSettings(p.temperature, p.top_k, p.top_p)

    @property
    def row_offset(self) -> int:
        return self.policy.row_offset

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        return policy_generate(self.policy, requests, self.version)

    def rollout_key(self) -> int:
        return self.policy.draw_key()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        self.policy.load_weights(state_dict)
        self.version = version

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """The scoring call (see the module docstring): :func:`policy_score`."""
        return policy_score(self.policy, sequences, starts)

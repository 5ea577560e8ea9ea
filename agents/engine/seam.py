"""The generation seam's data and rules (see :mod:`~tokengym.agents.engine.generation` for the contract): a request,
a generation, the sampling settings, the :class:`Generator` protocol, the checks of a request or scoring call, and the
stream seeds. Every backend builds on these: vLLM's imports them from here, so that ``generation`` (which picks a
backend by name) and the backends it picks need not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["FINISH_REASONS", "Generation", "GenerationRequest", "Generator", "SamplingSettings", "check_requests",
           "check_scoring", "request_seed", "signed64", "stream_seed"]

FINISH_REASONS = ("stop", "length")
"""Why a generation ended: a stop token or sequence (``stop``), or its ``max_tokens`` budget (``length``)."""

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn: ``temperature`` (> 0), then the ``top_k`` most likely (0 = off), then the smallest set
    whose mass reaches ``top_p`` (1 = off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class GenerationRequest:
    """One row's request (see :mod:`~tokengym.agents.engine.generation`)."""

    prompt_ids: Sequence[int]
    """The whole token history to continue (never re-tokenized)."""
    max_tokens: int
    """The most tokens to generate (the env's remaining budget)."""
    sampling: SamplingSettings = SamplingSettings()
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end the generation when it completes one (multi-token stop strings)."""
    stop_strings: tuple[str, ...] = ()
    """The texts of ``stop_sequences``, for engines that match text."""
    greedy: bool = False
    seed: int | None = None
    """The episode's sampling stream (``None``: the generator's own random state; greedy draws nothing)."""
    step: int = 0
    """The position of the first new token in the episode's stream (a multi-turn episode's later turns go on with it)."""
    grammar: Any = None
    """The grammar the generation follows from its first token (:func:`tokengym.envs.masks.grammar_text`'s spec, e.g.
    ``{"json_schema": ...}``), or ``None``: each token is sampled from the masked, renormalised distribution and its
    log-prob is of that distribution."""


@dataclass
class Generation:
    """One request's answer."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int | None = None
    """The policy version of the weights that generated it (``None``: unversioned weights)."""


@runtime_checkable
class Generator(Protocol):
    """A backend of the generation seam (see the module docstring).

    ``sampling``: the settings its rollouts use (the trainer scores tokens with the same temperature). ``version``: the
    version of the weights it holds. ``row_offset``: the first row's index in the global batch (data-parallel ranks; 0
    alone), added to episode ids when streams are keyed.
    """

    sampling: SamplingSettings
    version: int | None
    row_offset: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """One :class:`Generation` per request, in order."""
        ...

    def rollout_key(self) -> int:
        """A fresh key for a sampled rollout's streams, drawn from the generator's seeded state (checkpointed)."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        """Take the trainer's weights (named tensors, ``None``: it shares the trained module) as ``version``."""
        ...


def stream_seed(key: int, episode: int) -> int:
    """An episode's stream seed in a rollout keyed ``key``: the token-level sampler's per-row stream
    (:func:`~tokengym.agents.engine.policy.row_uniforms` of ``(key, episode, step)``) is the stream ``(key ^ episode,
    step)``."""
    return (int(key) ^ int(episode)) & _MASK64


def request_seed(seed: int, step: int) -> int:
    """A 63-bit per-request seed for engines that take one seed per request: a hash of the stream ``(seed, step)``."""
    from tokengym.agents.engine.policy import splitmix64

    z = splitmix64(torch.tensor([signed64(seed) ^ step], dtype=torch.long))
    return int(z) & ((1 << 63) - 1)


def signed64(c: int) -> int:
    """``c`` modulo 2**64 as a signed 64-bit int (what a ``torch.long`` holds)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def check_requests(requests: Sequence[GenerationRequest], vocab_size: int | None = None) -> None:
    """``ValueError`` naming the first request a generator cannot serve (an empty prompt, a budget below 1, ids
    outside the vocabulary, sampling settings out of range)."""
    for i, r in enumerate(requests):
        s = r.sampling
        if not len(r.prompt_ids):
            raise ValueError(f"request {i} has an empty prompt: give at least one token id")
        if int(r.max_tokens) < 1:
            raise ValueError(f"request {i} asks for max_tokens={r.max_tokens}; ask for at least 1")
        if not (s.temperature > 0 and s.top_k >= 0 and 0 < s.top_p <= 1):
            raise ValueError(f"request {i} has sampling settings {s}: temperature > 0, top_k >= 0, 0 < top_p <= 1")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in r.prompt_ids):
            raise ValueError(f"request {i}'s prompt holds a token id outside the vocabulary [0, {vocab_size})")


def check_scoring(sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    """ValueError in one line for a scoring call whose starts do not fit their sequences (a token at position 0 has
    nothing before it to be scored given)."""
    if len(sequences) != len(starts):
        raise ValueError(f"score() got {len(sequences)} sequences but {len(starts)} starts")
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        if not 1 <= int(start) <= len(seq):
            raise ValueError(f"sequence {i} has {len(seq)} tokens; its start must be in 1..{len(seq)}, got {start}")

"""Conformance checks of rollout backends against a trusted one: :func:`check_sampler` for token-level samplers
(:mod:`tokengym.agents.engine.sampler`), :func:`check_generator` for the generation seam
(:mod:`tokengym.agents.engine.generation`). A new backend runs them on the same weights and settings as the
reference; both compare whole rollouts, so they check the backend as the rollout loops use it.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from tokengym.agents.engine.sampler import OPTIONAL_METHODS, SamplerCapabilities

__all__ = ["agent_turns", "check_generator", "check_sampler"]


class _Spy:
    """Forwards to ``sampler``, counts its method calls and fails on an optional method (or ``copies > 1``) that the
    sampler's latest :meth:`Sampler.capabilities` answer did not declare. Methods are spelled out so that
    ``isinstance(spy, Sampler)`` holds on every Python (3.12 checks protocols without ``__getattr__``)."""

    def __init__(self, sampler: Any):
        self._sampler, self.calls, self._caps = sampler, collections.Counter(), SamplerCapabilities()

    def __getattr__(self, name: str) -> Any:  # plain attributes (``model`` for check_fits)
        return getattr(self._sampler, name)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in OPTIONAL_METHODS and not getattr(self._caps, name):
            raise AssertionError(f"the rollout called {name}() on a sampler that declares {name}=False")
        self.calls[name] += 1
        return getattr(self._sampler, name)(*args, **kwargs)

    def capabilities(self, width=None):
        self._caps = self._call("capabilities", width)
        return self._caps

    def begin_rollout(self):
        if not self._caps.row_streams:
            raise AssertionError("the rollout called begin_rollout() on a sampler that declares row_streams=False")
        return self._call("begin_rollout")

    def end_rollout(self):
        return self._call("end_rollout")

    def prefill(self, tokens, mask, max_new_tokens=None, copies=1):
        if copies != 1 and not self._caps.shared_prefix:
            raise AssertionError(f"the rollout passed copies={copies} to a sampler that declares shared_prefix=False")
        return self._call("prefill", tokens, mask, max_new_tokens=max_new_tokens, copies=copies)

    def decode(self, tokens, hold=None):
        return self._call("decode", tokens, hold=hold)

    def sample(self, logits, greedy=False, **rows):
        if rows and not self._caps.row_streams:
            raise AssertionError("the rollout passed ids/steps to a sampler that declares row_streams=False")
        return self._call("sample", logits, greedy=greedy, **rows)

    def load_weights(self, state_dict=None):
        return self._call("load_weights", state_dict)

    def extend(self, rows, tokens, lengths):
        return self._call("extend", rows, tokens, lengths)

    def compact(self, keep):
        return self._call("compact", keep)

    def refill(self, rows, tokens, mask):
        return self._call("refill", rows, tokens, mask)


_COMPARED = ("tokens", "attention_mask", "action_mask", "completions", "rewards", "outcome", "terminated", "truncated",
             "turn_counts")
"""The :class:`~tokengym.agents.engine.rollout.Rollout` fields two conforming samplers agree on exactly (group ids
count resets, and log-probs agree to float rounding)."""


def check_sampler(sampler: Any, reference: Any, env: Any, *, atol: float, seed: int = 0, greedy: bool = False,
                  **collect_kw: Any) -> collections.Counter:
    """Conformance check of a rollout backend: ``collect(env, sampler)`` must give the episodes of
    ``collect(env, reference)`` (a trusted sampler on the same weights and sampling settings, its generator seeded
    like ``sampler``'s): the same tokens, masks and completions, log-probs within ``atol`` and never above 0; and the
    rollout must call no optional method (nor ``copies > 1``) that ``sampler`` does not declare.

    ``env`` is a ``disabled``-autoreset env, or a ``next_step`` one (then :func:`collect_episodes` runs
    ``collect_kw["samples"]``). Returns the counts of ``sampler``'s method calls (e.g. ``calls["compact"]``).
    Raises ``AssertionError`` naming the first difference.
    """
    from tokengym.agents.engine.rollout import collect, collect_episodes

    def run(s: Any):
        if env.autoreset_mode.name == "NEXT_STEP":
            return collect_episodes(env, s, greedy=greedy, seed=seed, **collect_kw)
        return collect(env, s, greedy=greedy, seed=seed, **collect_kw)

    spy = _Spy(sampler)
    _compare(run(spy), run(reference), atol)
    return spy.calls


def _compare(ours: Any, want: Any, atol: float) -> None:
    """``AssertionError`` naming the first :data:`_COMPARED` field in which rollout ``ours`` differs from ``want``, or
    log-probs further apart than ``atol`` or above 0."""
    for name in _COMPARED:
        a, b = getattr(ours, name), getattr(want, name)
        same = (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)) if isinstance(a, dict) else (
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        if not same:
            raise AssertionError(f"Rollout.{name} differs from the reference sampler's")
    gap = (ours.logprobs - want.logprobs).abs().max().item() if ours.logprobs.numel() else 0.0
    if not gap <= atol:
        raise AssertionError(f"log-probs differ from the reference sampler's by {gap:.3g} > atol={atol:g}")
    if bool((ours.logprobs > 0).any()):
        raise AssertionError("a sampled token's log-prob is above 0")


def check_generator(generator: Any, reference: Any, env: Any, *, atol: float, seed: int = 0, greedy: bool = False,
                    samples: list | None = None) -> dict[str, int]:
    """Conformance check of a generation-seam backend: ``collect(env, generator)`` (its generations replayed through
    the env) must give the episodes of the token-level ``collect(env, reference)`` (a trusted sampler on the same
    weights and settings, its generator seeded like ``generator``'s): the same tokens, masks, completions and rewards,
    log-probs within ``atol`` and never above 0; and the engine must stop where the env does (no token dropped, one
    request per agent turn). ``env``: a ``disabled``-autoreset env. Returns the batch's ``generation_counts`` summed;
    raises ``AssertionError`` naming the first difference."""
    from tokengym.agents.engine.replay import collect_generated
    from tokengym.agents.engine.rollout import collect

    ours = collect_generated(env, generator, greedy=greedy, seed=seed, samples=samples)
    want = collect(env, reference, greedy=greedy, seed=seed, samples=samples)
    _compare(ours, want, atol)
    counts = {k: int(v.sum()) for k, v in ours.generation_counts.items()}
    if counts["dropped"]:
        raise AssertionError(f"the engine generated {counts['dropped']} tokens past where the env ended a turn")
    if not torch.equal(ours.generation_counts["requests"], agent_turns(ours)):
        raise AssertionError("the engine stopped before the env did: some turns took more than one request")
    return counts


def agent_turns(ro: Any) -> torch.Tensor:
    """Each episode's agent turns ``[N]``: 1 in a single-turn env; in a multi-turn one the turns the env answered or
    ended, plus a last one cut by the token budget (what an engine that stops where the env does needs one request
    each for)."""
    if not ro.turn_counts:
        return torch.ones_like(ro.terminated, dtype=torch.long)
    tc = ro.turn_counts
    return tc["turns"] + ro.truncated.long() - tc["max_turns"] - tc["reply_overflows"]

"""The sampler protocol: the one seam between the rollout loop and whatever runs the model.

:func:`~tokengym.agents.engine.rollout.collect` and :func:`~tokengym.agents.engine.rollout.collect_episodes` talk to
the model only through a :class:`Sampler`. :class:`~tokengym.agents.Policy` is the in-process implementation (its own
KV cache, the fast decoder); a remote rollout worker or a vLLM / SGLang server would be others. A sampler states what
it can do in :class:`SamplerCapabilities`; the rollout asks those instead of inspecting methods or signatures.

What a rollout does with a sampler (``N`` rows in cache order, logits ``[N, V]`` float32)::

    caps = sampler.capabilities(P + M)                     # before anything else
    sampler.begin_rollout()                                # sampled rollouts of a row_streams sampler only
    logits = sampler.prefill(tokens, mask, max_new_tokens=M, copies=G)   # copies > 1 only with shared_prefix
    tok, logp = sampler.sample(logits, greedy, ids=episode_ids, steps=gen_len)   # without row_streams: no ids/steps
    logits = sampler.decode(tok, hold=held)                # one token per row
    logits[r] = sampler.extend(r, reply, lengths)          # extend: a multi-turn env's reply tokens
    sampler.compact(keep)                                  # compact: drop finished rows
    logits[r] = sampler.refill(r, prompts, mask)           # refill: new episodes in rows r (continuous batching)
    sampler.end_rollout()                                  # always, also after an error

Invariants every sampler keeps:

- **Tokens in = tokens out.** A sampler sees and returns token ids only; it never decodes text and re-tokenizes it,
  so the trainer's forward pass scores exactly the sequence that was sampled.
- **Log-probs of what was sampled.** ``sample`` returns each sampled token's log-probability under the distribution
  it was drawn from (temperature, top-k, top-p applied; for greedy, under the temperature-scaled distribution): the
  behaviour log-probs that importance ratios and KL terms divide by.
- **Positions from the mask.** A row's positions are ``cumsum(mask) - 1``: padding never shifts a real token.
- **Action masks are the rollout's.** Where the env masks its actions (a grammar), the rollout hands ``sample`` logits
  already ``-inf`` outside each row's mask, so the sampled token and its log-prob are the masked distribution's; a
  sampler needs nothing of its own for it.
- A ``hold[n]`` row's token is ignored by the env; its history does not grow, and its reply comes through ``extend``.

Optional capabilities, and what the rollout does without them:

- ``row_streams``: ``sample(logits, greedy, ids, steps)`` draws row ``n``'s token from its logits, its episode id and
  its step only, never from the other rows. Without it ``sample(logits, greedy=...)`` is called (the sampler's own
  random state) and ``begin_rollout`` is not; finished rows then stay in the batch (nothing is compacted).
- ``shared_prefix``: ``prefill(..., copies=G)`` encodes each group's prompt once for its ``G`` rows. Without it every
  row is encoded (same logits).
- ``extend``: multi-turn envs (:meth:`Sampler.extend` appends the env's reply tokens). Without it ``collect`` refuses a
  multi-turn env.
- ``compact``: :meth:`Sampler.compact` drops finished rows from the batch. Needs ``row_streams``. Without it the
  rollout keeps every row to the end (the sampler is never asked).
- ``refill``: :meth:`Sampler.refill` starts new episodes in some rows while the others go on. Without it
  ``collect_episodes`` (continuous batching) is refused; ``collect`` works.

:func:`~tokengym.agents.engine.backend_check.check_sampler` is the conformance check a new backend runs against a
trusted one. Engines that serve whole generations rather than one token at a time implement the generation seam
instead (:mod:`tokengym.agents.engine.generation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

__all__ = ["OPTIONAL_METHODS", "Sampler", "SamplerCapabilities", "capabilities_of"]


@dataclass(frozen=True)
class SamplerCapabilities:
    """What a :class:`Sampler` offers beyond the required methods (each described in the module docstring).

    ``why_not``: a short reason for the capabilities that are off (for error messages), e.g. ``"the fast decode path
    is off: fast_decode=False"``.

    Example:
        >>> SamplerCapabilities(row_streams=True, compact=True).refill
        False
        >>> SamplerCapabilities(compact=True)
        Traceback (most recent call last):
        ...
        ValueError: compact=True needs row_streams=True: ...
    """

    row_streams: bool = False
    shared_prefix: bool = False
    extend: bool = False
    compact: bool = False
    refill: bool = False
    why_not: str | None = None

    def __post_init__(self) -> None:
        if self.compact and not self.row_streams:
            raise ValueError("compact=True needs row_streams=True: dropping rows from the batch must not change the "
                             "other rows' draws")


OPTIONAL_METHODS = ("extend", "compact", "refill")
"""Optional :class:`Sampler` methods: each is called only where the :class:`SamplerCapabilities` flag of its name is
on, so a sampler without the capability need not define it."""


@runtime_checkable
class Sampler(Protocol):
    """The rollout engine's interface to a model (see the module docstring for the call order and invariants).

    Required: the methods below. Optional, called only where :meth:`capabilities` says so:
    ``extend(rows, tokens, lengths) -> logits[R, V]`` (append ``lengths[r]`` tokens of the right-padded
    ``tokens[R, K]`` to row ``rows[r]``), ``compact(keep) -> bool`` (keep only rows ``keep``, ascending; ``False``:
    nothing changed, and the rollout stops asking) and ``refill(rows, tokens, mask) -> logits[R, V]`` (new prompts
    ``tokens[R, P]`` in rows ``rows``, the last prefill's width).
    """

    def capabilities(self, width: int | None = None) -> SamplerCapabilities:
        """What this sampler offers for a rollout whose prefill has ``width`` = prompt columns + ``max_new_tokens``
        (``None``: for any width)."""
        ...

    def begin_rollout(self) -> None:
        """Start a sampled rollout's per-row streams (draw its key); called only with ``row_streams``, never for
        greedy rollouts, so evaluation leaves the training stream alone."""
        ...

    def end_rollout(self) -> None:
        """Free what the rollout held (caches, fused weights); called after every rollout."""
        ...

    def prefill(self, tokens: torch.Tensor, mask: torch.Tensor, max_new_tokens: int | None = None,
                copies: int = 1) -> torch.Tensor:
        """Start fresh rows from left-padded prompts ``tokens[N, P]`` (``mask`` 1 on real tokens); at most
        ``max_new_tokens`` decode steps follow. ``copies=G`` (only with ``shared_prefix``): rows are groups of ``G``
        identical prompts. Returns next-token logits ``[N, V]``."""
        ...

    def decode(self, tokens: torch.Tensor, hold: torch.Tensor | None = None) -> torch.Tensor:
        """Append one token per row (``tokens[N]``; not where ``hold[N]`` is true); return next-token logits."""
        ...

    def sample(self, logits: torch.Tensor, greedy: bool = False, ids: torch.Tensor | None = None,
               steps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens[N], logprobs[N])`` from ``logits[N, V]``; with ``row_streams`` row ``n``'s draw depends only on
        its logits, episode ``ids[n]`` and ``steps[n]``."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take the trainer's new weights before the next rollout: ``None`` when the sampler shares the trained module
        (nothing to copy), else a state dict to copy in (a remote worker's case)."""
        ...


def capabilities_of(sampler: Any, width: int | None = None) -> SamplerCapabilities:
    """``sampler.capabilities(width)``, after checking that ``sampler`` is a :class:`Sampler` (one clear line if not).

    Example:
        >>> capabilities_of(object())
        Traceback (most recent call last):
        ...
        TypeError: a rollout needs a Sampler (tokengym.agents.Sampler); object lacks capabilities, begin_rollout, ...
    """
    if not isinstance(sampler, Sampler):
        missing = [m for m in ("capabilities", "begin_rollout", "end_rollout", "prefill", "decode", "sample",
                               "load_weights") if not callable(getattr(sampler, m, None))]
        raise TypeError(f"a rollout needs a Sampler (tokengym.agents.Sampler); {type(sampler).__name__} lacks "
                        f"{', '.join(missing)}")
    caps = sampler.capabilities(width)
    if not isinstance(caps, SamplerCapabilities):
        raise TypeError(f"{type(sampler).__name__}.capabilities() returned {type(caps).__name__}, not "
                        "SamplerCapabilities")
    return caps

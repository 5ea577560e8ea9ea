"""Reward protocols and the one place where reward outputs are checked.

Outcome reward: ``fn(prompts: list[str], completions: list[str], **task_fields) -> list[float] | Tensor[N]``.
Process reward: ``fn(prompts: list[str], steps: list[list[str]], **task_fields) -> list[list[float]]``
(one score per step; ``steps[i]`` are the reasoning steps of completion ``i`` written so far).

``task_fields`` are the extra columns of the prompt source (e.g. ``answer=[...]``), one list entry per
prompt, the way TRL passes dataset columns to reward functions. A reward function should accept
``**kwargs`` and ignore fields it does not use.

An outcome reward may also expose ``components(prompts, completions, **fields) -> dict[str, values]``
(see :func:`tokengym.rewards.weighted_sum`); the environments then report each component in ``info``.
A component whose name holds a ``/`` (``judge/errors``) is a per-episode count, not a reward term: the on-policy
trainers log its sum over each step's episodes under that name. Component :data:`DROP` (1.0 on an episode) asks them
to leave the episode, with its group, out of the update (a reward that could not score it).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from tokengym.rewards.common import finite32

__all__ = ["OutcomeReward", "ProcessReward", "score_outcome", "score_process", "reward_name", "check_reward", "DROP",
           "is_counter"]

DROP = "reward/dropped"
"""The reward component that flags an episode (1.0) to be left out of the update, with its group."""


def is_counter(component: str) -> bool:
    """Whether reward component ``component`` is a per-episode count that trainers sum into metrics (its name has a
    ``/``) rather than a reward term."""
    return "/" in component


@runtime_checkable
class OutcomeReward(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **task_fields: Any) -> Sequence[float] | torch.Tensor: ...


@runtime_checkable
class ProcessReward(Protocol):
    def __call__(self, prompts: list[str], steps: list[list[str]], **task_fields: Any) -> list[list[float]]: ...


def reward_name(fn: Callable) -> str:
    """A readable name for a reward callable (function name, class name or ``name`` attribute)."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return str(name)


def check_reward(fn: Any, what: str) -> None:
    """Refuse a reward that cannot be called (e.g. ``reward=5``) when the env is built, not when an episode ends."""
    if not callable(fn):
        raise TypeError(f"{what} must be a callable (prompts, completions or steps, **task_fields), got {type(fn).__name__}: {fn!r:.40}")


def as_vector(values: Any, n: int, who: str) -> torch.Tensor:
    """Reward ``who``'s output as a float32 vector of ``n`` finite values; TypeError/ValueError naming it otherwise."""
    try:
        t = torch.as_tensor(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"reward {who!r} must return a list of floats or a 1-D tensor, got {type(values).__name__}: {e}") from None
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"reward {who!r} returned shape {tuple(t.shape)} for {n} completions; expected ({n},)")
    bad = ~torch.isfinite(t)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"reward {who!r} returned a non-finite value ({t[i].item()}) for completion {i}")
    return t


def score_outcome(
    fn: Callable, prompts: list[str], completions: list[str], fields: dict[str, list] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call an outcome reward once for a batch and check what it returns.

    Returns:
        ``(total[N] float32 CPU tensor, {component_name: Tensor[N]})``. A plain function has one
        component named after it; a :func:`weighted_sum` reports each of its terms.

    Raises:
        ValueError: (or TypeError) naming the reward when it returns the wrong length, a non-numeric
            value, or NaN/inf.
    """
    fields = fields or {}
    n = len(completions)
    who = reward_name(fn)
    comps_fn = getattr(fn, "components", None)
    if callable(comps_fn):
        raw = comps_fn(prompts, completions, **fields)
        comps = {k: as_vector(v, n, f"{who}.{k}") for k, v in raw.items()}
        total = as_vector(fn.combine(comps) if hasattr(fn, "combine") else fn(prompts, completions, **fields), n, who)
        return total, comps
    total = as_vector(fn(prompts, completions, **fields), n, who)
    return total, {who: total}


def score_process(
    fn: Callable, prompts: list[str], steps: list[list[str]], fields: dict[str, list] | None = None
) -> list[list[float]]:
    """Call a process reward once for a batch and check one finite score per step."""
    fields = fields or {}
    who = reward_name(fn)
    out = fn(prompts, steps, **fields)
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if not isinstance(out, Sequence) or isinstance(out, str):
        raise TypeError(f"process reward {who!r} returned {type(out).__name__}; it must return list[list[float]], one list per completion")
    if len(out) != len(steps):
        raise ValueError(f"process reward {who!r} returned {len(out)} score lists for {len(steps)} completions")
    scores: list[list[float]] = []
    for i, (row, st) in enumerate(zip(out, steps)):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (int, float)) or not isinstance(row, Sequence) or isinstance(row, str):
            raise TypeError(f"process reward {who!r} returned {type(row).__name__} {row!r:.40} for completion {i}; it must "
                            "return one list of step scores per completion (list[list[float]])")
        row = list(row)
        if len(row) != len(st):
            raise ValueError(f"process reward {who!r} returned {len(row)} scores for completion {i} with {len(st)} steps")
        row = [float(x) for x in row]
        if not all(finite32(x) for x in row):  # kept in float32: 1e308 would be inf there
            raise ValueError(f"process reward {who!r} returned a step score that is not finite in float32 for "
                             f"completion {i}: {row}")
        scores.append(row)
    return scores

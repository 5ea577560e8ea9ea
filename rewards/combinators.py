"""Reward combinators: weighted sums of outcome rewards, and small shaping rewards.

Everything here is an outcome reward ``(prompts, completions, **fields) -> list[float]`` with a
``name``, so it can be used on its own or as a term of :func:`weighted_sum`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

import torch

from .protocols import DROP, as_vector, is_counter, reward_name

__all__ = ["WeightedSum", "weighted_sum", "FormatReward", "format_reward", "LengthPenalty", "length_penalty"]


def _finite_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


class WeightedSum:
    """An outcome reward that adds up weighted terms and reports each term separately.

    ``total[i] = sum_k weights[k] * terms[k](prompts, completions, **fields)[i]``.

    :func:`tokengym.rewards.score_outcome` calls :meth:`components` once, checks every term, then
    :meth:`combine`, so each term is evaluated once per batch and logged under its key.

    Args:
        terms: ``{component_name: outcome_reward}`` (at least one).
        weights: ``{component_name: weight}``; missing names weigh 1.0.
        name: the reward's name in logs (default ``"weighted_sum"``).

    Examples:
        >>> from tokengym.rewards import arithmetic_correct, format_reward
        >>> r = weighted_sum({"correct": arithmetic_correct, "format": format_reward(r".*\\nA: -?\\d+")},
        ...                  weights={"format": 0.1})
        >>> r(["1+2\\n"] * 2, ["1+2=3\\nA: 3", "three"], answer=[3, 3])
        [1.1, 0.0]
    """

    def __init__(self, terms: Mapping[str, Callable], weights: Mapping[str, float] | None = None, name: str = "weighted_sum"):
        if not isinstance(terms, Mapping) or not terms:
            raise ValueError(f"terms must be a non-empty dict {{name: reward}}, got {terms!r}")
        for key, fn in terms.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"terms: component names must be non-empty strings, got {key!r}")
            if not callable(fn):
                raise TypeError(f"terms[{key!r}] must be an outcome reward (callable), got {type(fn).__name__}")
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(terms))
        if unknown:
            raise ValueError(f"weights names unknown terms {unknown}; the terms are {sorted(terms)}")
        self.terms: dict[str, Callable] = dict(terms)
        self.weights: dict[str, float] = {k: _finite_number(weights.get(k, 1.0), f"weights[{k!r}]") for k in self.terms}
        self.name = name

    def components(self, prompts: list[str], completions: list[str], **fields: Any) -> dict[str, Any]:
        """Each term's raw scores: ``{component_name: list[float] | Tensor[N]}`` (unweighted), and the counters and
        :data:`~tokengym.rewards.protocols.DROP` flags of terms that report them (an LLM judge's), added up by name."""
        out: dict[str, Any] = {}
        extra: dict[str, torch.Tensor] = {}
        for key, fn in self.terms.items():
            sub = getattr(fn, "components", None)
            if not (callable(sub) and hasattr(fn, "combine")):
                out[key] = fn(prompts, completions, **fields)
                continue
            parts = sub(prompts, completions, **fields)
            out[key] = fn.combine(parts)
            for name, v in parts.items():
                if is_counter(name):
                    v = as_vector(v, len(completions), f"{self.name}.{key}.{name}")
                    extra[name] = extra[name] + v if name in extra else v
        if DROP in extra:
            extra[DROP] = extra[DROP].clamp(max=1.0)
        return {**out, **{k: v for k, v in extra.items() if k not in out}}

    def combine(self, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weighted total ``Tensor[N]`` of component tensors (float32 from ``score_outcome``)."""
        missing = sorted(set(self.terms) - set(components))
        if missing:
            raise ValueError(f"{self.name}.combine: missing components {missing}")
        total = None
        for key, w in self.weights.items():
            term = torch.as_tensor(components[key])
            term = (term if term.is_floating_point() else term.float()) * w
            total = term if total is None else total + term
        return total

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        n = len(completions)
        comps = {}
        for k, v in self.components(prompts, completions, **fields).items():
            as_vector(v, n, f"{self.name}.{k}")  # checks length and finiteness, names the term
            comps[k] = torch.as_tensor(v.detach().cpu() if isinstance(v, torch.Tensor) else v, dtype=torch.float64)
        return self.combine(comps).tolist()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={reward_name(fn)}*{self.weights[k]:g}" for k, fn in self.terms.items())
        return f"WeightedSum({inner})"


def weighted_sum(terms: Mapping[str, Callable], weights: Mapping[str, float] | None = None, name: str = "weighted_sum") -> WeightedSum:
    """Combine outcome rewards into one weighted total that still reports each term.

    See :class:`WeightedSum`.
    """
    return WeightedSum(terms, weights, name=name)


class FormatReward:
    """``reward`` when the completion has the format given by a regular expression, else 0.0.

    Args:
        pattern: a regular expression (str).
        reward: the score of a well-formatted completion.
        mode: ``"fullmatch"`` (default): the whole completion, with surrounding whitespace stripped, must
            match; ``"search"``: the pattern may match anywhere in the completion (unstripped).
        flags: ``re`` flags; the default ``re.DOTALL`` lets ``.`` cross newlines.

    Examples:
        >>> f = format_reward(r"(.*\\n)?A: -?\\d+")
        >>> f(["1+2\\n"] * 3, ["1+2=3\\nA: 3\\n", "A: 3", "1+2=3"])
        [1.0, 1.0, 0.0]
    """

    name = "format"

    def __init__(self, pattern: str, reward: float = 1.0, mode: str = "fullmatch", flags: int = re.DOTALL):
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a regular expression string, got {type(pattern).__name__}")
        if mode not in ("fullmatch", "search"):
            raise ValueError(f"mode must be 'fullmatch' or 'search', got {mode!r}")
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as e:
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
        self.reward = _finite_number(reward, "reward")
        self.mode = mode

    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        if self.mode == "fullmatch":
            return [self.reward if self.regex.fullmatch(c.strip()) else 0.0 for c in completions]
        return [self.reward if self.regex.search(c) else 0.0 for c in completions]

    def __repr__(self) -> str:
        return f"FormatReward({self.regex.pattern!r}, reward={self.reward:g}, mode={self.mode!r})"


def format_reward(pattern: str, reward: float = 1.0, mode: str = "fullmatch", flags: int = re.DOTALL) -> FormatReward:
    """A regular-expression format reward; see :class:`FormatReward`."""
    return FormatReward(pattern, reward, mode=mode, flags=flags)


class LengthPenalty:
    """A non-positive reward for completions longer than ``max_len`` characters.

    ``score = -coef * max(0, len(completion) - max_len)``, lengths in characters of the completion as
    given (no stripping). Add it to a task reward with :func:`weighted_sum`.

    Args:
        max_len: the free length in characters (>= 0).
        coef: the penalty per character beyond ``max_len`` (>= 0).

    Examples:
        >>> length_penalty(max_len=4, coef=0.5)(["p"] * 2, ["abc", "abcdefg"])
        [0.0, -1.5]
    """

    name = "length_penalty"

    def __init__(self, max_len: int, coef: float):
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
            raise ValueError(f"max_len must be an int >= 0, got {max_len!r}")
        coef = _finite_number(coef, "coef")
        if coef < 0:
            raise ValueError(f"coef must be >= 0 (the penalty is subtracted), got {coef!r}")
        self.max_len = max_len
        self.coef = coef

    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [-self.coef * (len(c) - self.max_len) if len(c) > self.max_len else 0.0 for c in completions]

    def __repr__(self) -> str:
        return f"LengthPenalty(max_len={self.max_len}, coef={self.coef:g})"


def length_penalty(max_len: int, coef: float) -> LengthPenalty:
    """A penalty proportional to the characters beyond ``max_len``; see :class:`LengthPenalty`."""
    return LengthPenalty(max_len, coef)

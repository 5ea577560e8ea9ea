"""pass@k, maj@k and mean@k of n sampled completions per prompt: pure functions on per-sample correctness and answers.

* ``pass@k``: the chance that at least one of k completions drawn without replacement from the n is correct, by the
  unbiased estimator 1 - C(n-c, k) / C(n, k) (c correct of n), computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i)
  so that no binomial overflows or cancels.
* ``mean@k``: the mean correctness of the first k completions.
* ``maj@k``: the correctness of the majority answer among the first k completions. A completion without an answer
  (``None``) does not vote; a tie goes to the answer that came first among the k (so the result never depends on
  dict or hash order); the majority answer is correct when its first completion is. No answer at all: incorrect.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

__all__ = ["pass_at_k", "mean_at_k", "maj_at_k", "at_k_metrics"]


def _check(n: int, k: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n] (n = {n} samples per prompt), got k={k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (1 <= k <= n, 0 <= c <= n)."""
    _check(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n], got c={c}, n={n}")
    if n - c < k:  # every draw of k holds a correct one
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_at_k(correct: Sequence[bool], k: int) -> float:
    """Mean correctness of the first ``k`` of ``correct``."""
    _check(len(correct), k)
    return sum(bool(x) for x in correct[:k]) / k


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer among the first ``k`` completions is correct, else 0.0 (rules in the module
    docstring)."""
    _check(len(correct), k)
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct differ in length: {len(answers)} vs {len(correct)}")
    votes: dict[Any, list[int]] = {}  # answer -> [count, first index]
    for i, a in enumerate(answers[:k]):
        if a is not None:
            votes.setdefault(a, [0, i])[0] += 1
    if not votes:
        return 0.0
    count, first = max(votes.values(), key=lambda v: (v[0], -v[1]))
    return float(bool(correct[first]))


def at_k_metrics(per_prompt: Sequence[tuple[Sequence[Hashable | None], Sequence[bool]]], k: int) -> dict[str, float]:
    """``{"pass@k", "maj@k", "mean@k"}`` (k in the names), each the mean over prompts of ``(answers, correct)``."""
    if not per_prompt:
        raise ValueError("at_k_metrics needs at least one prompt")
    rows = [(pass_at_k(len(c), sum(bool(x) for x in c), k), maj_at_k(a, c, k), mean_at_k(c, k)) for a, c in per_prompt]
    return {f"{name}@{k}": sum(r[i] for r in rows) / len(rows) for i, name in enumerate(("pass", "maj", "mean"))}

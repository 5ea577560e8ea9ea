"""Reverse a random string: the smallest task a tiny character-level model can learn."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tokengym.rewards import char_accuracy, exact_match

from .base import Task, check_seed, int_range
from .registry import register_task

__all__ = ["ReverseTask"]


@register_task(
    "reverse", description="reverse a string of letters; exact-match reward",
    prompt_format="completion: the letters in reverse order; reward 1 iff exact",
    models="the presets start at 0%: SFT first (tokengym train sft --env tokengym/Reverse-v0), then GRPO")
class ReverseTask(Task):
    """Random letters to write backwards: prompt ``"abcd\\n"``, solution ``"dcba"``.

    Args:
        length: string length, an int or an inclusive ``(min, max)`` range (>= 1), drawn uniformly.
        alphabet: the characters to draw from (uniformly, independently); distinct, no whitespace.
        partial_credit: reward the fraction of correct positions (:func:`tokengym.rewards.char_accuracy`)
            instead of exact match (:func:`tokengym.rewards.exact_match`); both strip whitespace.
        seed: seeds a private generator used only when :meth:`sample` gets no generator.

    Samples: ``{"prompt": "abcd\\n", "solution": "dcba", "answer": "dcba"}``.

    Examples:
        >>> s = ReverseTask(length=4).sample(np.random.default_rng(0))
        >>> s["solution"] == s["prompt"].strip()[::-1] == s["answer"]
        True
    """

    name = "reverse"
    stop_strings: tuple[str, ...] = ()
    step_delimiter = None

    def __init__(self, length: int | tuple[int, int] = (3, 8), alphabet: str = "abcdefghij", partial_credit: bool = False, seed: int | None = None):
        self.length = int_range("length", length, 1, 4096)
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet must not repeat a character, got {alphabet!r}")
        if any(ch.isspace() for ch in alphabet):
            raise ValueError(f"alphabet must not contain whitespace (the prompt ends with a newline), got {alphabet!r}")
        if not isinstance(partial_credit, bool):
            raise ValueError(f"partial_credit must be a bool, got {partial_credit!r}")
        self.alphabet = alphabet
        self.partial_credit = partial_credit
        self.seed = check_seed(seed)
        self._rng = np.random.default_rng(self.seed)
        self.max_prompt_chars = self.length[1] + 1
        self.default_max_new_tokens = self.length[1] + 4

    def sample(self, rng: np.random.Generator | None = None) -> dict[str, Any]:
        """One random string and its reverse (deterministic given ``rng``)."""
        rng = self._rng if rng is None else rng
        n = int(rng.integers(self.length[0], self.length[1] + 1))
        text = "".join(self.alphabet[int(i)] for i in rng.integers(0, len(self.alphabet), size=n))
        return {"prompt": text + "\n", "solution": text[::-1], "answer": text[::-1]}

    def reward(self) -> Callable:
        """Exact match, or the fraction of correct positions with ``partial_credit=True``."""
        return char_accuracy if self.partial_credit else exact_match

    def extract_answer(self, completion: str | None) -> str | None:
        """The completion without surrounding whitespace, as the rewards compare it (``None`` when empty)."""
        return (completion or "").strip() or None

    def __repr__(self) -> str:
        return f"ReverseTask(length={self.length}, alphabet={self.alphabet!r}, partial_credit={self.partial_credit})"

"""Multi-step integer arithmetic, small enough for a ~1M-parameter character-level model.

Format (other code relies on it, keep it exact)::

    prompt   "12+7+30\\n"                   expression without spaces, then a newline
    solution "12+7=19\\n19+30=49\\nA: 49"     one reduction "a<op>b=c" per line, then "A: <answer>"

Canonical order (see :mod:`tokengym.rewards.arithmetic_prm`): multiplications first, left to right,
then ``+``/``-`` left to right; ``a`` and ``b`` are the current (already reduced) values, negative
numbers are written ``-5``: ``"3-8+2\\n"`` -> ``"3-8=-5\\n-5+2=-3\\nA: -3"``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from tokengym.rewards import (arithmetic_correct, arithmetic_step_reward, extract_final_answer, extract_number,
                              number_match, parse_int, solve_expression)

from ..chat import user_prompt

from .arithmetic_data import arithmetic_pairs, arithmetic_step_labels
from .base import Task, check_seed, int_range
from .registry import register_task

__all__ = ["ArithmeticTask"]

_OPERATORS = "+-*"


def _first_line(completion: str | None) -> str | None:
    return completion.split("\n", 1)[0] if isinstance(completion, str) else completion


def few_shot_number_match(prompts: list[str], completions: list[str], answer: Any = None, **kw: Any) -> list[float]:
    """:func:`tokengym.rewards.number_match` on the reply's first line: the few-shot form's answer. A base model goes
    on past it when its tokenizer folds the ending newline into a longer token (Gemma's ``"\\n\\n"``), and the
    next made-up example must not be read as the answer."""
    return number_match(prompts, [_first_line(c) for c in completions], answer=answer, **kw)


@register_task(
    "arithmetic", description="multi-step integer arithmetic, one step per line; verifier + rule-based PRM",
    prompt_format="completion: one reduction per line, then 'A: <answer>'; reward 1 iff the answer is right",
    models="tiny-arithmetic was trained on this default task: GRPO/PPO lift it; from the tiny or small preset, "
           "SFT first")
class ArithmeticTask(Task):
    """Integer expressions such as ``"12+7*3\\n"`` solved one reduction per line.

    Args:
        n_operands: number of operands, an int or an inclusive ``(min, max)`` range (>= 2), drawn
            uniformly per sample.
        digits: number of digits ``d`` of an operand, an int or an inclusive ``(min, max)`` range
            (1..18). Each operand draws ``d`` uniformly from the range, then its value uniformly from
            ``[0, 10**d - 1]`` (so ``digits=2`` gives operands in ``[0, 99]``).
        operators: the operators to draw from, a string of distinct characters from ``"+-*"``; each
            operator slot draws one uniformly. The defaults (2-3 two-digit operands, ``"+"``) are the task
            the shipped ``tiny-arithmetic`` warm start was trained on.
        seed: seeds a private generator used only when :meth:`sample` gets no generator (environments
            always pass theirs).
        chat: pose the problem to a chat model in words (``"What is 17+25? Answer with just the number."`` as a
            user message), judged by :func:`tokengym.rewards.number_match`; the env needs a tokenizer with a
            chat template. The solution is then just the answer, and there is no process reward.
        system_prompt: an optional system message for the chat form.
        few_shot: for a base model (no chat template): pose the problem as ``few_shot`` solved examples and the
            expression, one per line (``"3+45=48\\n12+7=19\\n17+25="``), drawn from the same generator. The reply
            ends at a newline, and the number on its first line is the answer (:func:`few_shot_number_match`); no
            process reward.

    Samples: ``{"prompt": "12+7+30\\n", "solution": "12+7=19\\n19+30=49\\nA: 49", "answer": 49}``.

    Attributes:
        max_prompt_chars: the exact maximum prompt length, ``n_max * (d_max + 1)``.
        max_solution_chars: an upper bound on the solution length (computed from the knobs).
        default_max_new_tokens: ``max_solution_chars + 4`` (room for EOS with a character tokenizer).

    Examples:
        >>> task = ArithmeticTask(n_operands=3, digits=2, operators="+-")
        >>> s = task.sample(np.random.default_rng(0))
        >>> sorted(s), s["prompt"].endswith("\\n"), s["solution"].endswith(f"A: {s['answer']}")
        (['answer', 'prompt', 'solution'], True, True)
    """

    name = "arithmetic"
    stop_strings: tuple[str, ...] = ()
    step_delimiter = "\n"
    bundled_data: tuple[str, ...] = ("preference_pairs", "step_labels")

    QUESTION = "What is {expression}? Answer with just the number."
    """The chat form's user message (``chat=True``)."""

    def __init__(self, n_operands: int | tuple[int, int] = (2, 3), digits: int | tuple[int, int] = 2, operators: str = "+",
                 seed: int | None = None, chat: bool = False, system_prompt: str | None = None, few_shot: int = 0):
        self.n_operands = int_range("n_operands", n_operands, 2, 64)
        self.digits = int_range("digits", digits, 1, 18)
        if not isinstance(operators, str) or not operators:
            raise ValueError(f"operators must be a non-empty string of characters from {_OPERATORS!r}, got {operators!r}")
        bad = sorted(set(operators) - set(_OPERATORS))
        if bad:
            raise ValueError(f"operators may only contain {_OPERATORS!r}, got {operators!r} (unknown: {''.join(bad)!r})")
        if len(set(operators)) != len(operators):
            raise ValueError(f"operators must not repeat a character, got {operators!r}")
        self.operators = operators
        self.seed = check_seed(seed)
        self._rng = np.random.default_rng(self.seed)

        if not isinstance(chat, bool):
            raise ValueError(f"chat must be true or false, got {chat!r}")
        if system_prompt is not None and (not chat or not isinstance(system_prompt, str)):
            raise ValueError("system_prompt needs chat=True and must be a string")
        self.chat, self.system_prompt = chat, system_prompt
        if isinstance(few_shot, bool) or not isinstance(few_shot, int) or not 0 <= few_shot <= 64:
            raise ValueError(f"few_shot must be an integer from 0 to 64 (solved examples before the question), got {few_shot!r}")
        if few_shot and chat:
            raise ValueError("few_shot is for base models and chat=True for chat models: choose one")
        self.few_shot = few_shot

        n, d = self.n_operands[1], self.digits[1]
        self.max_prompt_chars = n * (d + 1)
        self.max_solution_chars = self._solution_bound(n, d, operators)
        self.default_max_new_tokens = self.max_solution_chars + 4
        if chat:  # a free-form reply, then the model's end-of-turn token
            self.step_delimiter = None
            self.bundled_data = ()  # corruptions rewrite reduction lines, which the chat form has none of
            self.max_prompt_chars += len(self.QUESTION.format(expression="")) - 1 + len(system_prompt or "")  # no "\n"
            self.default_max_new_tokens = 64
        if few_shot:  # "a+b=c\n" lines, then "a+b=": the reply is the answer and a newline
            m = 10 ** self.digits[1] - 1
            answer_chars = len(str(m ** n if "*" in operators else n * m)) + ("-" in operators)
            self.max_prompt_chars = (few_shot + 1) * (self.max_prompt_chars + answer_chars + 1)
            self.step_delimiter, self.bundled_data, self.stop_strings = None, (), ("\n", "\n\n")
            self.max_solution_chars, self.default_max_new_tokens = answer_chars, answer_chars + 4

    @staticmethod
    def _solution_bound(n: int, d: int, operators: str) -> int:
        """Upper bound on the solution length for ``n`` operands of at most ``d`` digits.

        With ``M = 10**d - 1`` and one extra character for a minus sign when ``"-"`` is allowed:
        without ``*``, step ``k`` (1-based) has ``|a| <= k*M``, ``0 <= b <= M``, ``|c| <= (k+1)*M``.
        With ``*``, every value is a sum of products of operands; since ``M >= 9``, ``M**i + M**j <=
        M**(i+j)``, so ``|a|, b <= M**(n-1)`` (they leave at least one operand out) and ``|c| <= M**n``.
        """
        m = 10**d - 1
        sign = 1 if "-" in operators else 0

        def width(x: int) -> int:
            return len(str(x))

        total = 0
        if "*" in operators:
            line = (width(m ** (n - 1)) + sign) + 1 + width(m ** (n - 1)) + 1 + (width(m**n) + sign) + 1
            total = (n - 1) * line
            biggest = width(m**n) + sign
        else:
            for k in range(1, n):
                total += (width(k * m) + sign) + 1 + d + 1 + (width((k + 1) * m) + sign) + 1
            biggest = width(n * m) + sign
        return total + len("A: ") + biggest

    def expression(self, rng: np.random.Generator | None = None) -> str:
        """One expression such as ``"12+7+30"`` (what :meth:`sample` poses), drawn from ``rng``."""
        rng = self._rng if rng is None else rng
        n = int(rng.integers(self.n_operands[0], self.n_operands[1] + 1))
        values = []
        for _ in range(n):
            d = int(rng.integers(self.digits[0], self.digits[1] + 1))
            values.append(int(rng.integers(0, 10**d)))
        ops = [self.operators[int(i)] for i in rng.integers(0, len(self.operators), size=n - 1)]
        return str(values[0]) + "".join(f"{op}{v}" for op, v in zip(ops, values[1:]))

    def sample(self, rng: np.random.Generator | None = None) -> dict[str, Any]:
        """One expression, its canonical solution and its value (deterministic given ``rng``)."""
        expression = self.expression(rng)
        steps, answer = solve_expression(expression)
        if self.chat:
            question = self.QUESTION.format(expression=expression)
            return {"prompt": user_prompt(question, self.system_prompt), "solution": str(answer), "answer": answer}
        if self.few_shot:
            shots = [self.expression(rng) for _ in range(self.few_shot)]
            lines = "".join(f"{e}={solve_expression(e)[1]}\n" for e in shots)
            return {"prompt": f"{lines}{expression}=", "solution": str(answer), "answer": answer}
        return {"prompt": expression + "\n", "solution": "\n".join([*steps, f"A: {answer}"]), "answer": answer}

    def reward(self) -> Callable:
        """:func:`tokengym.rewards.arithmetic_correct` (1.0 iff the final answer is right); for the chat form
        :func:`tokengym.rewards.number_match` (the number the reply answers with), as for the few-shot form."""
        if self.few_shot:
            return few_shot_number_match
        return number_match if self.chat else arithmetic_correct

    def extract_answer(self, completion: str | None) -> int | None:
        """The integer that :meth:`reward` reads as ``completion``'s answer (``None``: none it can read): the last
        ``A: <n>`` line (:func:`~tokengym.rewards.extract_final_answer`), or for the chat and few-shot forms the
        number the reply answers with (:func:`~tokengym.rewards.extract_number`). maj@k votes on these, so
        ``"A: 49"`` and ``"A = 49."`` are one answer."""
        if self.few_shot:
            return parse_int(extract_number(_first_line(completion)))
        read = extract_number if self.reward() is number_match else extract_final_answer
        return parse_int(read(completion))

    def process_reward(self) -> Callable | None:
        """:data:`tokengym.rewards.arithmetic_step_reward` (rule-based 0/1 score per line); none for the chat and
        few-shot forms."""
        return None if self.chat or self.few_shot else arithmetic_step_reward

    def preference_pairs(self, n: int, seed: int = 0, exclude_prompts: Iterable[str] = ()) -> list[dict[str, Any]]:
        """Reference solution (chosen) vs one with a wrong digit (rejected), ``kind`` and ``answer`` as metadata:
        :func:`~tokengym.envs.tasks.arithmetic_data.arithmetic_pairs`."""
        if not self.has_bundled_data("preference_pairs"):
            raise self._no_bundled_data("preference_pairs")
        return arithmetic_pairs(self, n, seed=seed, exclude_prompts=exclude_prompts)

    def step_labels(self, n: int, seed: int = 0, exclude_prompts: Iterable[str] = ()) -> list[dict[str, Any]]:
        """Reference and corrupted solutions labelled by the rule-based step checker, ``source`` and ``answer`` as
        metadata: :func:`~tokengym.envs.tasks.arithmetic_data.arithmetic_step_labels`."""
        if not self.has_bundled_data("step_labels"):
            raise self._no_bundled_data("step_labels")
        return arithmetic_step_labels(self, n, seed=seed, exclude_prompts=exclude_prompts)

    def __repr__(self) -> str:
        form = f", chat=True, system_prompt={self.system_prompt!r}" if self.chat else ""
        form += f", few_shot={self.few_shot}" if self.few_shot else ""
        return f"ArithmeticTask(n_operands={self.n_operands}, digits={self.digits}, operators={self.operators!r}{form})"

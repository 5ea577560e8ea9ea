"""A rule-based process reward model (PRM) for the arithmetic task, and the task's canonical order.

The arithmetic task writes an expression such as ``"12+7*3-5"`` and its solution reduces it one binary
operation per line, then states the answer::

    7*3=21
    12+21=33
    33-5=28
    A: 28

**Canonical order.** The expression state is a list of values and the operators between them. The next
reduction is the first ``*`` from the left when there is one, otherwise the first operator (so all
multiplications go first, left to right, then ``+``/``-`` left to right; the result is the expression's
standard value). The two values next to that operator are replaced by the result. A step line reads
``a<op>b=c`` with ``a`` and ``b`` the current values (negative values written ``-5``); the last line is
``A: <answer>``.

:class:`ArithmeticStepReward` checks each line of a (partial) solution against this order.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from .verifiers import answer_line_value, parse_int

__all__ = ["parse_expression", "next_reduction", "solve_expression", "ArithmeticStepReward", "arithmetic_step_reward"]

_EXPRESSION = re.compile(r"\s*\d+(?:\s*[-+*]\s*\d+)*\s*")
_TOKEN = re.compile(r"\d+|[-+*]")
_STEP = re.compile(r"\s*(?P<a>[+-]?\d+)\s*(?P<op>[-+*])\s*(?P<b>[+-]?\d+)\s*=\s*(?P<c>[+-]?\d+)\s*")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_COMMUTATIVE = frozenset("+*")


def parse_expression(text: str) -> tuple[list[int], list[str]]:
    """Read an arithmetic expression (non-negative integers joined by ``+``, ``-``, ``*``).

    The expression is the last non-empty line of ``text`` (so a prompt ``"12+7+30\\n"`` works);
    spaces between tokens are allowed.

    Args:
        text: the prompt or expression.

    Returns:
        ``(values, operators)`` with ``len(operators) == len(values) - 1``.

    Raises:
        ValueError: when the last non-empty line is not such an expression.

    Examples:
        >>> parse_expression("12+7*3\\n")
        ([12, 7, 3], ['+', '*'])
    """
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    if not lines or not _EXPRESSION.fullmatch(lines[-1]):
        raise ValueError(f"not an arithmetic expression (non-negative integers joined by +, -, *): {text!r}")
    tokens = _TOKEN.findall(lines[-1])
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def next_reduction(operators: Sequence[str]) -> int:
    """Index of the operator the canonical order reduces next: the first ``*``, else the first one.

    Examples:
        >>> next_reduction(["+", "*", "*"]), next_reduction(["-", "+"])
        (1, 0)
    """
    if not operators:
        raise ValueError("the expression is already fully reduced")
    for i, op in enumerate(operators):
        if op == "*":
            return i
    return 0


def solve_expression(expression: str) -> tuple[list[str], int]:
    """The canonical solution steps of an expression and its value.

    Args:
        expression: an expression as accepted by :func:`parse_expression`.

    Returns:
        ``(steps, answer)``: the step lines ``"a<op>b=c"`` in canonical order (no answer line) and the
        expression's value.

    Examples:
        >>> solve_expression("3-8+2")
        (['3-8=-5', '-5+2=-3'], -3)
        >>> solve_expression("2+3*4-5")
        (['3*4=12', '2+12=14', '14-5=9'], 9)
    """
    values, ops = parse_expression(expression)
    steps = []
    while ops:
        i = next_reduction(ops)
        a, op, b = values[i], ops[i], values[i + 1]
        c = _APPLY[op](a, b)
        steps.append(f"{a}{op}{b}={c}")
        values[i : i + 2] = [c]
        del ops[i]
    return steps, values[0]


def _find_pair(values: list[int], ops: list[str], a: int, op: str, b: int) -> int | None:
    """Leftmost position where ``a op b`` (or ``b op a`` for + and *) is an adjacent pair of the state."""
    for j, o in enumerate(ops):
        if o != op:
            continue
        x, y = values[j], values[j + 1]
        if (x, y) == (a, b) or (op in _COMMUTATIVE and (x, y) == (b, a)):
            return j
    return None


class ArithmeticStepReward:
    """Rule-based PRM for the arithmetic task: one 0/1 score per solution line.

    The expression is parsed from the prompt (its last non-empty line). Lines are then read in order
    while tracking the *expression state produced by the lines written so far*:

    * A computation step ``a<op>b=c`` (spaces allowed: ``"12 + 7 = 19"``) scores 1.0 iff
      ``(a, op, b)`` is exactly the reduction the canonical order performs next on the current state
      (same operand order) **and** ``c == a <op> b``. The written result ``c`` then replaces the pair in
      the state, *even when it is wrong*: a later step that correctly uses a previous step's wrong result
      is consistent and scores 1.0 (the mistake is only charged once, to the step that made it).
    * A step that is not the canonical next reduction scores 0.0. If its operands still name an adjacent
      pair of the state (a step skipping ahead, or ``+``/``*`` operands swapped), the state is updated
      with its result so that the following steps are judged against what was actually written;
      otherwise the state is unchanged.
    * The answer line (``"A: 49"``, also ``"Answer = 49."`` etc.) scores 1.0 iff its value equals the true
      value of the prompt's expression, whatever the steps before it did.
    * Malformed lines (including empty lines and a partial last line cut by truncation that does not
      parse), every line after the answer line, and computation steps after the state is fully reduced
      score 0.0. Malformed lines leave the state unchanged.

    Call signature: ``(prompts, steps, **fields) -> list[list[float]]`` where ``steps[i]`` are the lines
    of completion ``i`` without their trailing ``"\\n"``. Unknown fields are ignored.

    Examples:
        >>> prm = ArithmeticStepReward()
        >>> prm(["12+7+30\\n"], [["12+7=19", "19+30=49", "A: 49"]])
        [[1.0, 1.0, 1.0]]
        >>> prm(["12+7+30\\n"], [["12+7=18", "18+30=48", "A: 48"]])
        [[0.0, 1.0, 0.0]]
    """

    name = "arithmetic_steps"

    def __call__(self, prompts: list[str], steps: list[list[str]], **_: Any) -> list[list[float]]:
        if len(prompts) != len(steps):
            raise ValueError(f"{self.name}: got {len(prompts)} prompts for {len(steps)} step lists")
        return [self.score(prompt, lines) for prompt, lines in zip(prompts, steps)]

    def score(self, prompt: str, lines: Sequence[str]) -> list[float]:
        """Scores of the lines of one completion (see the class docstring)."""
        values, ops = parse_expression(prompt)
        true_answer = solve_expression(prompt)[1]
        scores: list[float] = []
        answered = False
        for line in lines:
            if answered:
                scores.append(0.0)
                continue
            value = answer_line_value(line)
            if value is not None:
                answered = True
                scores.append(1.0 if parse_int(value) == true_answer else 0.0)
                continue
            m = _STEP.fullmatch(line)
            if m is None or not ops:
                scores.append(0.0)
                continue
            a, op, b, c = int(m["a"]), m["op"], int(m["b"]), int(m["c"])
            i = next_reduction(ops)
            if (values[i], ops[i], values[i + 1]) == (a, op, b):
                scores.append(1.0 if c == _APPLY[op](a, b) else 0.0)
                j: int | None = i
            else:
                scores.append(0.0)
                j = _find_pair(values, ops, a, op, b)
            if j is not None:
                values[j : j + 2] = [c]
                del ops[j]
        return scores

    def __repr__(self) -> str:
        return "ArithmeticStepReward()"


arithmetic_step_reward = ArithmeticStepReward()
"""The default instance of :class:`ArithmeticStepReward` (``name == "arithmetic_steps"``)."""

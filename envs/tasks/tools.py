"""Multi-turn tasks in which the environment answers: a calculator tool, and a number-guessing game.

Calculator (``tokengym/Calculator-v0``): the Arithmetic task, plus a tool. The agent may write ``<calc>38+87</calc>``;
the env answers ``=125`` and a newline, and the agent goes on (usually to ``A: 125``)::

    prompt "38+87\\n"    agent "<calc>38+87</calc>"    env "=125\\n"    agent "A: 125" <eos>

GuessNumber (``tokengym/GuessNumber-v0``): the env picks a number in ``[1, high]``; each agent turn is a guess ending
with ``?`` (``50?``), answered ``higher``, ``lower`` (then a newline) or ``correct``. No tool, just interaction.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from tokengym.rewards import arithmetic_correct
from tokengym.rewards.arithmetic_prm import parse_expression, solve_expression

from ..chat import user_prompt
from ..multiturn import Reply
from .arithmetic import ArithmeticTask
from .base import Task
from .registry import register_task

__all__ = ["CalculatorTask", "GuessNumberTask", "calculator_solution", "calculator_turns", "count_calls"]

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


def count_calls(text: str) -> int:
    """Calculator calls in an episode's text."""
    return len(CALL.findall(text or ""))


def calculator_turns(prompt: str) -> list[str]:
    """A reference episode that makes one call per reduction, as turns that alternate agent and env:
    ``["<calc>12+7</calc>", "=19\\n", "<calc>19+30</calc>", "=49\\n", "A: 49"]``."""
    lines, answer = solve_expression(prompt.strip())
    turns = []
    for line in lines:
        expr, value = line.split("=", 1)
        turns += [f"<calc>{expr}</calc>", f"={value}\n"]
    return turns + [f"A: {answer}"]


def calculator_solution(prompt: str) -> str:
    """:func:`calculator_turns` as one text: ``"<calc>12+7</calc>=19\\n<calc>19+30</calc>=49\\nA: 49"``."""
    return "".join(calculator_turns(prompt))


@register_task(
    "calculator", description="multi-turn: Arithmetic with a calculator tool, <calc>38+87</calc> is answered =125",
    prompt_format="completion: '<calc>EXPR</calc>' calls (the env writes '=VALUE' and a newline), then 'A: <answer>'; "
                  "reward 1 iff right, minus call_cost per call",
    models="tiny-calculator (the default model of tokengym train for this env) knows the syntax, not when calling "
           "pays: GRPO learns that")
class CalculatorTask(ArithmeticTask):
    """Arithmetic with a calculator tool: ``<calc>EXPR</calc>`` is answered ``=VALUE`` (then a newline).

    Args:
        tool_rate: the fraction of reference solutions (for SFT) that use the calculator, one call per reduction;
            the rest are the plain Arithmetic solutions (``bench/tiny_calculator.py`` mixes tool episodes with a
            model's own answers instead, so that SFT teaches the syntax and not arithmetic).
        call_cost: reward subtracted per call (a turn reward on the call's ``</calc>``), so that calling only
            where it pays is what maximises the return.
        max_turns: agent turns per episode (a call is a turn; the final answer is one more).
        **arithmetic: the :class:`ArithmeticTask` knobs (operands, digits, operators, chat).

    The outcome reward is the Arithmetic verifier on the episode's text (``A: <answer>`` after the calls).
    An expression the calculator cannot read (``<calc>12+</calc>``) is answered ``=error``.
    """

    name = "calculator"
    turn_stop_strings = ("</calc>",)
    reply_timeout = 5.0
    bundled_data: tuple[str, ...] = ()  # Arithmetic's pairs and step labels are plain solutions, not tool episodes

    def __init__(self, tool_rate: float = 1.0, call_cost: float = 0.0, max_turns: int = 6, **arithmetic: Any):
        super().__init__(**arithmetic)
        if isinstance(tool_rate, bool) or not isinstance(tool_rate, (int, float)) or not 0.0 <= tool_rate <= 1.0:
            raise ValueError(f"tool_rate must be a number in [0, 1], got {tool_rate!r}")
        self.tool_rate = float(tool_rate)
        if not isinstance(call_cost, (int, float)) or isinstance(call_cost, bool) or not np.isfinite(call_cost):
            raise ValueError(f"call_cost must be a finite number, got {call_cost!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.call_cost, self.max_turns = float(call_cost), max_turns
        self.step_delimiter = None  # the Arithmetic PRM does not know calls
        if not self.chat:  # room for one call and reply per reduction next to the plain solution
            self.default_max_new_tokens = 2 * self.max_solution_chars + 16 * self.n_operands[1]

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        s = super().sample(rng)
        use_tool = bool(rng.random() < self.tool_rate)
        if not self.chat:  # SFT scores the even turns only: the agent's (the env's replies are context)
            s["solution_turns"] = calculator_turns(s["prompt"]) if use_tool else [s["solution"]]
            s["solution"] = "".join(s["solution_turns"])
        return s

    def respond(self, sample: dict[str, Any], history: list[str]) -> Reply | str | None:
        calls = CALL.findall(history[-1])
        if not calls:
            return None  # no call: that was the final answer
        reply = f"={calculate(calls[-1])}\n"
        return Reply(text=reply, reward=-self.call_cost) if self.call_cost else reply

    def reward(self) -> Callable:
        return arithmetic_correct if not self.chat else super().reward()

    def process_reward(self) -> Callable | None:
        return None  # the Arithmetic PRM scores reduction lines, and here the calculator writes them


def calculate(expression: str) -> str:
    """The value of an integer expression of ``+``, ``-``, ``*`` (at most 64 characters), or ``"error"``."""
    expression = expression.strip()
    if not expression or len(expression) > 64:
        return "error"
    try:
        parse_expression(expression)
        return str(solve_expression(expression)[1])
    except (ValueError, IndexError):
        return "error"


MAX_HIGH = 10**18
MAX_TURNS = 1000


@register_task(
    "guess_number", description="multi-turn: find a hidden number from the env's higher/lower replies",
    prompt_format="each turn: a number and '?', answered higher/lower/correct; reward 1 - 0.1 per extra guess when "
                  "found", models="a demo of interaction without a tool; chat=True for an instruct model")
class GuessNumberTask(Task):
    """Find a hidden number in ``[1, high]``: each guess (a number, then ``?``) is answered ``higher``,
    ``lower`` (then a newline) or ``correct``. Reward ``1 - 0.1 * (guesses - 1)`` (at least 0.1) when found, else 0.

    Args:
        high: the largest number (the smallest is 1).
        max_turns: guesses per episode.
        chat: pose it in words to a chat model; each guess is then a chat turn, and replies are user messages.
    """

    name = "guess_number"
    turn_stop_strings = ("?",)

    def __init__(self, high: int = 100, max_turns: int = 8, chat: bool = False):
        if not isinstance(high, int) or isinstance(high, bool) or not 2 <= high <= MAX_HIGH:
            raise ValueError(f"high must be an int from 2 to {MAX_HIGH:.0e} (numbers are drawn as int64), got {high!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or not 1 <= max_turns <= MAX_TURNS:
            raise ValueError(f"max_turns must be an int from 1 to {MAX_TURNS}, got {max_turns!r}")
        self.high, self.max_turns, self.chat = high, max_turns, bool(chat)
        self.question = f"I am thinking of a number from 1 to {high}. Guess it: reply with just a number, and I will say higher or lower."
        self.max_prompt_chars = len(self.question) if chat else len(f"guess 1-{high}\n")
        self.default_max_new_tokens = max_turns * (len(str(high)) + 10) + (64 if chat else 0)
        if chat:
            self.turn_stop_strings = ()  # a chat turn ends with the model's end-of-turn token

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        answer = int(rng.integers(1, self.high + 1))
        prompt = user_prompt(self.question) if self.chat else f"guess 1-{self.high}\n"
        return {"prompt": prompt, "answer": answer}

    def respond(self, sample: dict[str, Any], history: list[str]) -> Reply | str | None:
        guess = _last_int(history[-1])
        if guess is None:
            return "a number please\n" if not self.chat else "Please reply with just a number."
        if guess == sample["answer"]:
            return Reply(text="correct", done=True)
        word = "higher" if guess < sample["answer"] else "lower"
        return f"{word}\n" if not self.chat else word.capitalize() + "."

    def reward(self) -> Callable:
        return guess_reward


def _last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


def guess_reward(prompts: list[str], completions: list[str], answer: list[Any] | None = None, **_: Any) -> list[float]:
    """1 - 0.1 per extra guess (at least 0.1) if a guess hit ``answer``; a guess is the last number of each line."""
    out = []
    for text, target in zip(completions, answer or [None] * len(completions)):
        guesses = [_last_int(line) for line in (text or "").splitlines() if _last_int(line) is not None]
        hit = next((i for i, g in enumerate(guesses) if g == int(target)), None) if target is not None else None
        out.append(0.0 if hit is None else max(0.1, 1.0 - 0.1 * hit))
    return out

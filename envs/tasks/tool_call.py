"""ToolCall: the Arithmetic prompts, answered with one calculator call written as JSON under a JSON schema.

The agent's whole completion is the call ``{"expression":"12+7+30"}``; the (imagined) calculator evaluates it, and the
reward is 1 iff the call parses against the schema and its expression has the prompt's value. The task declares the
schema as its grammar, so the env masks every action to it (an env made with ``grammar=False`` does not: free text, to
measure how often unconstrained calls parse)::

    prompt "12+7+30\\n"    agent '{"expression":"12+7+30"}' <eos>    reward 1
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from tokengym.rewards.arithmetic_prm import solve_expression

from ..chat import user_prompt
from .arithmetic import ArithmeticTask
from .registry import register_task

__all__ = ["ToolCallTask", "parse_call", "tool_call_correct", "call_schema"]

_EXPRESSION = r"^[0-9]+([+*-][0-9]+)*$"


def call_schema(max_chars: int) -> dict[str, Any]:
    """The call's JSON schema: one ``expression`` of digits and ``+-*``, at most ``max_chars`` characters."""
    return {"type": "object", "properties": {"expression": {"type": "string", "pattern": _EXPRESSION,
                                                           "maxLength": int(max_chars)}},
            "required": ["expression"], "additionalProperties": False}


def parse_call(text: str | None) -> str | None:
    """The expression of a completion that is exactly one call under :func:`call_schema` (surrounding whitespace
    aside), else ``None``.

    Example:
        >>> parse_call('{"expression":"12+7"}'), parse_call('{"expression": "12+7"} extra'), parse_call("A: 19")
        ('12+7', None, None)
    """
    try:
        call = json.loads((text or "").strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"expression"} or not isinstance(call["expression"], str):
        return None
    return call["expression"] if re.fullmatch(_EXPRESSION, call["expression"]) else None


def tool_call_correct(prompts: list[str], completions: list[str], answer: list[Any] | None = None, **_: Any) -> list[float]:
    """1.0 per completion that is one call (:func:`parse_call`) whose expression evaluates to ``answer``."""
    if answer is None or len(answer) != len(completions):
        raise ValueError("tool_call_correct needs one answer per completion")
    out = []
    for text, want in zip(completions, answer):
        expr = parse_call(text)  # digits joined by +-*: always an expression the calculator reads
        out.append(1.0 if expr is not None and solve_expression(expr)[1] == int(want) else 0.0)
    return out


@register_task("tool_call", description="Arithmetic answered by one calculator call in JSON, masked to its JSON schema",
               prompt_format="completion: {\"expression\":\"<expr>\"}; reward 1 iff the call parses and has the "
                             "prompt's value; needs llguidance (pip install 'tokengym[grammar]')",
               models="tiny-arithmetic after a short SFT on the calls (well formed under the mask from the start, "
                      "right after SFT + GRPO); without the mask it never writes JSON")
class ToolCallTask(ArithmeticTask):
    """:class:`ArithmeticTask` prompts, answered with a JSON calculator call (see the module docstring).

    Args:
        **kwargs: :class:`ArithmeticTask`'s (operands, digits, operators, seed, and ``chat``: the call is asked for in
            words, as a chat model needs). The task's :attr:`grammar` is :func:`call_schema`.
    """

    QUESTION = ('Call the calculator to compute {expression}. Reply with only the call, as JSON: '
                '{{"expression": "<the expression>"}}')

    name = "tool_call"
    step_delimiter = None
    bundled_data = ()

    def __init__(self, chat: bool = False, system_prompt: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)  # the completion form's prompts; the chat form words them below
        longest = self.max_prompt_chars - 1  # the expression, without its newline
        self.grammar = {"json_schema": call_schema(longest)}
        self.default_max_new_tokens = len('{"expression":""}') + longest + 2
        if not isinstance(chat, bool):
            raise ValueError(f"chat must be true or false, got {chat!r}")
        if system_prompt is not None and (not chat or not isinstance(system_prompt, str)):
            raise ValueError("system_prompt needs chat=True and must be a string")
        self.chat, self.system_prompt = chat, system_prompt
        if chat:  # free text may wander: room for it to show that it does
            self.max_prompt_chars += len(self.QUESTION.format(expression="")) + len(system_prompt or "")
            self.default_max_new_tokens = 48

    def sample(self, rng=None) -> dict[str, Any]:
        expression = self.expression(rng)
        prompt = user_prompt(self.QUESTION.format(expression=expression), self.system_prompt) if self.chat else expression + "\n"
        return {"prompt": prompt, "solution": json.dumps({"expression": expression}, separators=(",", ":")),
                "answer": solve_expression(expression)[1]}

    def reward(self) -> Callable:
        return tool_call_correct

    def extract_answer(self, completion: str | None) -> int | None:
        """The value of the completion's call (what :func:`tool_call_correct` compares), ``None`` without one."""
        expr = parse_call(completion)
        return None if expr is None else solve_expression(expr)[1]

    def process_reward(self) -> Callable | None:
        return None

    def __repr__(self) -> str:
        return super().__repr__().replace("ArithmeticTask(", "ToolCallTask(", 1)

"""Verifiers: rule-based outcome rewards that check a completion's final answer.

Every verifier follows the outcome-reward protocol
``(prompts, completions, **fields) -> list[float]`` and ignores fields it does not use, so the
environments can pass all task fields to every reward.

Answer extraction comes in two flavours:

* :func:`extract_final_answer` for arithmetic-style text, whose answer is a number on an answer line
  (``"A: 49"``, ``"Answer = 49."``, ...) or a final line that is just a number;
* :func:`extract_answer` for free-form answers: the last ``<answer>...</answer>`` block, else the last
  answer line, else the last non-empty line.
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Sequence

__all__ = [
    "parse_int",
    "extract_final_answer",
    "extract_answer",
    "extract_number",
    "arithmetic_correct",
    "number_match",
    "exact_match",
    "answer_match",
    "char_accuracy",
]

# An answer line: optional "final", then "a", "ans" or "answer", then ":" or "=", then the value.
# Matched on a stripped line, case-insensitively.
_ANSWER_LINE = re.compile(r"(?:final\s+)?(?:answer|ans|a)\s*[:=]\s*(?P<value>.*)", re.IGNORECASE | re.DOTALL)
# Trailing punctuation that ends a sentence but is not part of the value.
_TRAILING_PUNCT = re.compile(r"[\s.,;!]+$")
# An integer: optional sign, digits (or digits grouped by commas in threes), optional ".", ".0", ".00"...
_INT = re.compile(r"(?P<sign>[+-]?)(?P<digits>\d+|\d{1,3}(?:,\d{3})+)(?:\.0*)?")
# A plain number (integer or decimal, optional sign and thousands separators) on a line of its own.
_NUMBER = re.compile(r"[+-]?(?:\d+|\d{1,3}(?:,\d{3})+)(?:\.\d*)?")
_ANSWER_TAG = re.compile(r"<answer>(?P<value>.*?)</answer>", re.IGNORECASE | re.DOTALL)
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-"})


def parse_int(text: Any) -> int | None:
    """Parse an integer written in a lenient but unambiguous way.

    Accepted: surrounding whitespace, a leading ``+`` or ``-`` (also the Unicode minus sign), a
    trailing ``"."`` or a zero fractional part (``"49."``, ``"49.0"``), and thousands separators when
    they group digits by three (``"1,234"``, ``"-12,345,678"``). Rejected (``None``): anything else,
    e.g. ``"49.5"``, ``"4 9"``, ``"12,34"``, ``"+ 49"``, ``"49a"``, ``""`` or ``None``. Python ints
    (not bools) are returned unchanged.

    Args:
        text: the string to parse (or an int).

    Returns:
        The integer, or ``None`` when ``text`` is not an integer written in an accepted form.

    Examples:
        >>> parse_int(" +49 "), parse_int("49.0"), parse_int("1,234"), parse_int("-5")
        (49, 49, 1234, -5)
        >>> parse_int("4 9") is None, parse_int("49.5") is None, parse_int("12,34") is None
        (True, True, True)
    """
    if isinstance(text, numbers.Integral) and not isinstance(text, bool):
        return int(text)
    if not isinstance(text, str):
        return None
    m = _INT.fullmatch(text.strip().translate(_MINUS_SIGNS))
    if m is None:
        return None
    value = int(m.group("digits").replace(",", ""))
    return -value if m.group("sign") == "-" else value


def answer_line_value(line: str) -> str | None:
    """The value written on an answer line (``"A: 49."`` -> ``"49"``), or ``None`` if ``line`` is not one."""
    m = _ANSWER_LINE.fullmatch(line.strip())
    if m is None:
        return None
    return _TRAILING_PUNCT.sub("", m.group("value").strip())


def extract_final_answer(text: str | None) -> str | None:
    """Extract the final answer from arithmetic-style text.

    The answer is taken from the last *answer line* of ``text``: a line that (after stripping
    surrounding spaces) starts with ``A``, ``Ans``, ``Answer`` or ``Final answer`` in any case, then
    ``:`` or ``=``, then the value (``"A: 49"``, ``"a : 49"``, ``"Answer = 49."``, ``"A=49"``).
    Trailing sentence punctuation (``.``, ``,``, ``;``, ``!``) and spaces are removed from the value.
    When ``text`` has no answer line, a last non-empty line that is just a number (``"49"``,
    ``"+49."``, ``"1,234"``) is the answer. Otherwise there is none.

    Args:
        text: a completion.

    Returns:
        The answer as written (e.g. ``"+49"``; use :func:`parse_int` to read it), or ``None``.

    Examples:
        >>> extract_final_answer("12+7=19\\n19+30=49\\nA: 49\\n")
        '49'
        >>> extract_final_answer("Answer = 49."), extract_final_answer("19+30=49\\n49  ")
        ('49', '49')
        >>> extract_final_answer("12+7=19") is None
        True
    """
    if not text:
        return None
    lines = [ln.strip() for ln in text.splitlines()]
    for line in reversed(lines):
        value = answer_line_value(line)
        if value is not None:
            return value
    nonempty = [ln for ln in lines if ln]
    if nonempty:
        last = _TRAILING_PUNCT.sub("", nonempty[-1].translate(_MINUS_SIGNS))
        if _NUMBER.fullmatch(last):
            return last
    return None


def extract_answer(text: str | None) -> str | None:
    """Extract a free-form answer from a completion.

    In order of preference: the content of the last ``<answer>...</answer>`` block (stripped; may span
    lines), the value of the last answer line (as in :func:`extract_final_answer`), else the last
    non-empty line (stripped).

    Args:
        text: a completion.

    Returns:
        The answer text, or ``None`` for an empty completion.

    Examples:
        >>> extract_answer("I count 4 legs.\\n<answer> 12 </answer>")
        '12'
        >>> extract_answer("thinking...\\nAnswer: Paris"), extract_answer("first\\nsecond\\n\\n")
        ('Paris', 'second')
    """
    if not text:
        return None
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    lines = [ln.strip() for ln in text.splitlines()]
    for line in reversed(lines):
        value = answer_line_value(line)
        if value is not None:
            return value
    nonempty = [ln for ln in lines if ln]
    return nonempty[-1] if nonempty else None


_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\**\s*([+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)", re.IGNORECASE)
_ANY_NUMBER = re.compile(r"(?<![\w.])[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_number(text: str | None) -> str | None:
    """The number a free-form completion answers with (a chat model's reply).

    In order of preference: the last ``\\boxed{...}``, the number after the last "answer is" / "answer:" /
    "answer =", the final answer of :func:`extract_final_answer`, else the last number in the text.

    Examples:
        >>> extract_number("17 + 25 = 42"), extract_number("The answer is **42**."), extract_number("so \\boxed{42}")
        ('42', '42', '42')
        >>> extract_number("Answer: 1,234 apples"), extract_number("no digits") is None
        ('1,234', True)
    """
    if not text:
        return None
    text = text.translate(_MINUS_SIGNS)
    for pattern in (_BOXED, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    final = extract_final_answer(text)
    if final is not None and _NUMBER.fullmatch(final):
        return final
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def number_match(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 when the number a free-form completion answers with (:func:`extract_number`) equals the integer
    reference answer, else 0.0: the verifier for tasks posed to chat models.

    Examples:
        >>> number_match(["What is 17+25?"] * 3, ["17 + 25 = 42", "The answer is 42.", "17 + 25 = 32"], answer=[42] * 3)
        [1.0, 1.0, 0.0]
    """
    return _int_match("number_match", extract_number, completions, answer)


def _check_lengths(who: str, completions: Sequence, **columns: Any) -> None:
    n = len(completions)
    for key, col in columns.items():
        if col is None:
            raise ValueError(f"{who} needs the task field {key!r} (one entry per completion); it was not passed")
        try:
            m = len(col)
        except TypeError:
            raise TypeError(f"{who}: field {key!r} must be a sequence with one entry per completion, got {type(col).__name__}") from None
        if m != n:
            raise ValueError(f"{who}: field {key!r} has {m} entries for {n} completions")


def _reference_int(ref: Any, who: str) -> int:
    if hasattr(ref, "item") and not isinstance(ref, (str, bytes)):  # numpy / torch scalars
        ref = ref.item()
    value = parse_int(ref)
    if value is None:
        raise ValueError(f"{who}: reference answer {ref!r} is not an integer")
    return value


def arithmetic_correct(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 when the completion's final answer equals the integer reference answer, else 0.0.

    The answer is read with :func:`extract_final_answer` and :func:`parse_int`, so ``"A: 49"``,
    ``"A:49"``, ``"a : 49"``, ``"Answer: 49"``, ``"A = 49."``, ``"A: +49"`` and a last line ``"49"`` are
    all correct for 49; ``"A: 490"``, ``"A: 4 9"`` or a completion without an answer are not.

    Args:
        prompts: the prompts (unused).
        completions: the completions to score.
        answer: the integer reference answers (ints or integer strings), one per completion.

    Returns:
        One score in ``{0.0, 1.0}`` per completion.

    Examples:
        >>> arithmetic_correct(["12+7+30\\n"] * 3, ["A: 49", "a = 49.", "A: 48"], answer=[49, 49, 49])
        [1.0, 1.0, 0.0]
    """
    return _int_match("arithmetic_correct", extract_final_answer, completions, answer)


def _int_match(who: str, extract: Any, completions: list[str], answer: Sequence[Any] | None) -> list[float]:
    """1.0 per completion whose ``extract``-ed answer parses (:func:`parse_int`) to the integer reference."""
    _check_lengths(who, completions, answer=answer)
    out = []
    for completion, ref in zip(completions, answer):
        got = parse_int(extract(completion))
        out.append(1.0 if got is not None and got == _reference_int(ref, who) else 0.0)
    return out


def _matches(candidate: str | None, ref: Any) -> bool:
    """Exact comparison: ints as ints, everything else as stripped strings."""
    if candidate is None:
        return False
    if hasattr(ref, "item") and not isinstance(ref, (str, bytes)):
        ref = ref.item()
    if isinstance(ref, numbers.Integral) and not isinstance(ref, bool):
        got = parse_int(candidate)
        return got is not None and got == int(ref)
    return candidate.strip() == str(ref).strip()


def exact_match(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 when the whole completion equals the reference answer, else 0.0.

    Both sides are compared after stripping surrounding whitespace; when the reference is an int, the
    completion is parsed with :func:`parse_int` and compared as an int (so ``" +49 "`` matches ``49``).
    No answer extraction happens: use :func:`answer_match` for completions with reasoning before the
    answer.

    Args:
        prompts: the prompts (unused).
        completions: the completions to score.
        answer: the reference answers, one per completion.

    Returns:
        One score in ``{0.0, 1.0}`` per completion.

    Examples:
        >>> exact_match(["abc\\n"] * 3, ["cba", " cba\\n", "cb"], answer=["cba"] * 3)
        [1.0, 1.0, 0.0]
        >>> exact_match(["q"], ["+49"], answer=[49])
        [1.0]
    """
    _check_lengths("exact_match", completions, answer=answer)
    return [1.0 if _matches(c, ref) else 0.0 for c, ref in zip(completions, answer)]


def answer_match(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 when the answer extracted from the completion equals the reference answer, else 0.0.

    The answer is extracted with :func:`extract_answer` (``<answer>`` block, else answer line, else the
    last non-empty line) and compared as in :func:`exact_match`. A single trailing period of the
    extracted answer is ignored when the reference does not end with one (``"Answer: Paris."``).

    Args:
        prompts: the prompts (unused).
        completions: the completions to score.
        answer: the reference answers, one per completion.

    Returns:
        One score in ``{0.0, 1.0}`` per completion.

    Examples:
        >>> answer_match(["q"] * 3, ["so...\\nAnswer: Paris.", "<answer>Paris</answer>", "Rome"], answer=["Paris"] * 3)
        [1.0, 1.0, 0.0]
    """
    _check_lengths("answer_match", completions, answer=answer)
    out = []
    for completion, ref in zip(completions, answer):
        got = extract_answer(completion)
        ok = _matches(got, ref)
        if not ok and got is not None and got.endswith(".") and not str(ref).strip().endswith("."):
            ok = _matches(got[:-1], ref)
        out.append(1.0 if ok else 0.0)
    return out


def char_accuracy(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """Fraction of positions where the completion matches the reference string (partial credit).

    Both are stripped of surrounding whitespace; the score is the number of equal characters at equal
    positions divided by the longer of the two lengths (so missing and extra characters both cost).
    Two empty strings score 1.0.

    Args:
        prompts: the prompts (unused).
        completions: the completions to score.
        answer: the reference strings, one per completion.

    Returns:
        One score in ``[0, 1]`` per completion.

    Examples:
        >>> char_accuracy(["abcd\\n"] * 3, ["dcba", "dcbx", "dcbaa"], answer=["dcba"] * 3)
        [1.0, 0.75, 0.8]
    """
    _check_lengths("char_accuracy", completions, answer=answer)
    out = []
    for completion, ref in zip(completions, answer):
        got, want = completion.strip(), str(ref).strip()
        longest = max(len(got), len(want))
        if longest == 0:
            out.append(1.0)
            continue
        out.append(sum(a == b for a, b in zip(got, want)) / longest)
    return out

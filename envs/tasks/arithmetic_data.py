"""The Arithmetic task's bundled training data: preference pairs and step-labelled solutions.

Both come from corrupting reference solutions (:data:`CORRUPTIONS`), so they need no model; they live with
the task (:meth:`ArithmeticTask.preference_pairs <tokengym.envs.tasks.ArithmeticTask.preference_pairs>`,
:meth:`~tokengym.envs.tasks.ArithmeticTask.step_labels`) so that trainers ask the task instead of knowing it.
Step labels mixed with a policy's own samples are :func:`tokengym.agents.data.reward_data.arithmetic_step_labels`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch

from tokengym.rewards.arithmetic_prm import arithmetic_step_reward, next_reduction, parse_expression, solve_expression

from .base import fresh_samples

__all__ = ["CORRUPTIONS", "corrupt_solution", "arithmetic_pairs", "arithmetic_step_labels"]


def _change_digit(value: int, rng: np.random.Generator) -> int:
    """``value`` with one decimal digit replaced by a different one, drawn uniformly (no new leading zero)."""
    s = str(abs(value))
    pos = int(rng.integers(len(s)))
    choices = [d for d in "0123456789" if d != s[pos] and not (pos == 0 and d == "0" and len(s) > 1)]
    s = s[:pos] + choices[int(rng.integers(len(choices)))] + s[pos + 1:]
    return -int(s) if value < 0 else int(s)


def _replay(expression: str, step: int, fault: str, rng: np.random.Generator) -> tuple[list[str], int]:
    """Solve ``expression`` in canonical order with one fault at ``step``, carrying it to the answer.

    ``fault="result"``: the step's result gets one wrong digit; ``"operand"``: one of its operands is
    miscopied (one wrong digit) and the result is computed from the miscopied value.
    """
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    values, ops = parse_expression(expression)
    lines = []
    k = 0
    while ops:
        i = next_reduction(ops)
        a, op, b = values[i], ops[i], values[i + 1]
        if k == step and fault == "operand":
            if rng.integers(2):
                a = _change_digit(a, rng)
            else:
                b = _change_digit(b, rng)
        c = apply[op](a, b)
        if k == step and fault == "result":
            c = _change_digit(c, rng)
        lines.append(f"{a}{op}{b}={c}")
        values[i: i + 2] = [c]
        del ops[i]
        k += 1
    return lines, values[0]


def _corrupt_answer(expression: str, rng: np.random.Generator, complete: bool) -> str:
    steps, answer = solve_expression(expression)
    return "\n".join([*steps, f"A: {_change_digit(answer, rng)}"])


def _corrupt_step(fault: str):
    def corrupt(expression: str, rng: np.random.Generator, complete: bool) -> str:
        n_steps = len(parse_expression(expression)[1])
        step = int(rng.integers(n_steps))
        lines, answer = _replay(expression, step, fault, rng)
        if not complete:
            return "\n".join(lines[: step + 1])  # stop at the end of the first wrong line
        return "\n".join([*lines, f"A: {answer}"])

    return corrupt


CORRUPTIONS = {
    "answer_digit": _corrupt_answer,
    "step_digit": _corrupt_step("result"),
    "step_operand": _corrupt_step("operand"),
}
"""How :func:`arithmetic_pairs` builds a rejected solution (the chosen one is the reference solution):

* ``"answer_digit"``: every step right, one digit of the final answer ``A: ...`` wrong.
* ``"step_digit"``: one digit of one step's result wrong (a slip in a sum).
* ``"step_operand"``: a wrong step: one operand of one step miscopied (one wrong digit), the step's
  result computed from the miscopied value.

A wrong digit is drawn uniformly from the nine others (never a new leading zero). Off-by-one digits
(``d +- 1``, the carry slips a small model makes) were tried and were worse: such near-identical pairs
make DPO displace probability onto the neighbouring digits ("likelihood displacement", Razin et al.
2024); on the tiny warm start greedy accuracy fell further (0.41 -> 0.28 vs 0.31-0.36 here).

For the two step kinds, ``complete=False`` (the default) ends the rejected solution with its first
wrong line, so chosen and rejected share everything up to the wrong digit and differ only in that
line (the pair of Step-DPO, Lai et al. 2024). ``complete=True`` carries the error on through the
later steps to a wrong final answer. Sequence-level DPO pushes down *every* rejected token after the
divergence, and in a carried solution those are correct arithmetic on the wrong value ("114+2=116",
"A: 116"), so it also learns to stop computing and copying consistently; on the tiny warm start that
cost greedy accuracy, the truncated pairs did not. Every rejected solution fails the verifier (a
truncated one has no answer line).
"""


def corrupt_solution(prompt: str, kind: str, rng: np.random.Generator, complete: bool = False, max_tries: int = 20) -> str:
    """A wrong solution of an arithmetic ``prompt`` (see :data:`CORRUPTIONS`).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> corrupt_solution("12+7+30\\n", "answer_digit", rng).splitlines()[:2]
        ['12+7=19', '19+30=49']
        >>> len(corrupt_solution("12+7+30\\n", "step_digit", rng).splitlines()) <= 2
        True
    """
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption kind {kind!r}; choose from {sorted(CORRUPTIONS)}")
    expression = prompt.strip()
    steps, answer = solve_expression(expression)
    right = "\n".join([*steps, f"A: {answer}"])
    for _ in range(max_tries):
        text = CORRUPTIONS[kind](expression, rng, complete)
        # a complete solution must reach a wrong answer (a fault multiplied by 0 can vanish); try again
        if not right.startswith(text) and not text.endswith(f"A: {answer}"):
            return text
    return CORRUPTIONS["answer_digit"](expression, rng, complete)


def arithmetic_pairs(task: Any, n: int, seed: int = 0, kinds: Sequence[str] = tuple(CORRUPTIONS),
                     exclude_prompts: Iterable[str] = (), complete: bool = False) -> list[dict[str, Any]]:
    """``n`` seeded pairs from an :class:`~tokengym.envs.tasks.ArithmeticTask`: reference solution (chosen) vs corrupted (rejected).

    Each pair draws its corruption kind uniformly from ``kinds`` (see :data:`CORRUPTIONS`, which also
    explains ``complete``); prompts in ``exclude_prompts`` (e.g. held-out evaluation prompts) are
    skipped. Records also carry ``"answer"`` and ``"kind"``.

    Example:
        >>> from tokengym.envs.tasks import ArithmeticTask
        >>> p = arithmetic_pairs(ArithmeticTask(n_operands=2, digits=1, operators="+"), 1, seed=3)[0]
        >>> sorted(p), p["chosen"] != p["rejected"]
        (['answer', 'chosen', 'kind', 'prompt', 'rejected'], True)
    """
    kinds = list(kinds)
    bad = [k for k in kinds if k not in CORRUPTIONS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {sorted(CORRUPTIONS)}, got {kinds!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    excluded = set(exclude_prompts)
    out: list[dict[str, Any]] = []
    tries = 0
    while len(out) < n:
        for s in task.batch(rng, n - len(out)):
            if s["prompt"] in excluded:
                continue
            kind = kinds[int(rng.integers(len(kinds)))]
            out.append({"prompt": s["prompt"], "chosen": s["solution"], "rejected": corrupt_solution(s["prompt"], kind, rng, complete),
                        "answer": s["answer"], "kind": kind})
        tries += 1
        if tries > 1000:
            raise RuntimeError("could not draw enough prompts outside exclude_prompts: the task's prompt space is too small")
    return out


def _steps(text: str, delimiter: str) -> list[str]:
    """The steps of a completion the way the environment cuts them (non-blank pieces)."""
    return [p for p in text.split(delimiter) if p.strip()]


def arithmetic_step_labels(task: Any, n: int, seed: int = 0, exclude_prompts: Iterable[str] = (), reference_fraction: float = 0.2,
                           kinds: Sequence[str] = ("step_digit", "step_operand", "answer_digit"),
                           sampled: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """``n`` step-labelled arithmetic solutions for :func:`tokengym.rewards.train_prm`.

    ``reference_fraction`` of ``n`` are reference solutions (every step good), the rest of the fresh prompts
    get a complete corrupted solution (``kinds`` from :data:`CORRUPTIONS`, the error carried on to the answer).
    ``sampled``: records with ``prompt``, ``completion`` (and ``answer``) that come first and count towards
    ``n`` (a policy's samples, see :func:`tokengym.agents.data.reward_data.arithmetic_step_labels`). Every solution is
    labelled by the rule-based checker :data:`~tokengym.rewards.arithmetic_step_reward`, so a later step that
    correctly uses an earlier wrong value is good, and only the answer line compares with the truth.

    Returns:
        dicts with ``prompt``, ``steps`` (list of str), ``labels`` (0/1 per step), ``answer`` and
        ``source`` (``"reference"``, ``"sampled"`` or the corruption kind), shuffled with ``seed``.

    Example:
        >>> from tokengym.envs.tasks import ArithmeticTask
        >>> ex = arithmetic_step_labels(ArithmeticTask(n_operands=3, operators="+"), 10, seed=1)
        >>> sorted(ex[0]), all(len(e["steps"]) == len(e["labels"]) for e in ex)
        (['answer', 'labels', 'prompt', 'source', 'steps'], True)
        >>> any(0.0 in e["labels"] for e in ex)
        True
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= reference_fraction <= 1:
        raise ValueError(f"reference_fraction must be in [0, 1], got {reference_fraction}")
    bad = [k for k in kinds if k not in CORRUPTIONS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {sorted(CORRUPTIONS)}, got {list(kinds)!r}")
    if len(sampled) > n:
        raise ValueError(f"got {len(sampled)} sampled solutions for n={n}")
    delim = task.step_delimiter or "\n"
    rng = np.random.default_rng(seed)
    exclude = set(exclude_prompts) | {r["prompt"] for r in sampled}
    n_ref = round(reference_fraction * n)
    rows: list[tuple[dict[str, Any], str, str]] = [(r, r["completion"], "sampled") for r in sampled]  # (sample, completion, source)
    for i, s in enumerate(fresh_samples(task, n - len(sampled), rng, exclude)):
        if i < n_ref:
            rows.append((s, s["solution"], "reference"))
        else:
            kind = kinds[int(rng.integers(len(kinds)))]
            rows.append((s, corrupt_solution(s["prompt"], kind, rng, complete=True), kind))
    rows = [(s, c, src) for s, c, src in rows if _steps(c, delim)]
    labels = arithmetic_step_reward([s["prompt"] for s, _, _ in rows], [_steps(c, delim) for _, c, _ in rows])
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{"prompt": rows[i][0]["prompt"], "steps": _steps(rows[i][1], delim), "labels": labels[i],
             "answer": rows[i][0].get("answer"), "source": rows[i][2]} for i in order]

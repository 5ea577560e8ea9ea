"""ArithmeticTask and ReverseTask: format, determinism, length bounds, validation."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokengym.envs.tasks import TASKS, ArithmeticTask, CalculatorTask, GuessNumberTask, ReverseTask, Task, ToolCallTask
from tokengym.rewards import arithmetic_correct, arithmetic_step_reward, extract_final_answer, parse_int, score_process

STEP = re.compile(r"(-?\d+)([-+*])(\d+)=(-?\d+)")


def test_registry_and_defaults():
    assert TASKS == {"arithmetic": ArithmeticTask, "reverse": ReverseTask, "calculator": CalculatorTask,
                     "guess_number": GuessNumberTask, "tool_call": ToolCallTask}
    t = ArithmeticTask()
    assert isinstance(t, Task) and t.name == "arithmetic"
    assert t.step_delimiter == "\n" and t.stop_strings == ()
    assert t.n_operands == (2, 3) and t.digits == (2, 2) and t.operators == "+"  # the shipped warm start's task
    assert t.reward() is arithmetic_correct and t.process_reward() is arithmetic_step_reward
    assert t.max_prompt_chars == 3 * 3  # "99+99+99\n"


def test_same_seed_same_prompts():
    t = ArithmeticTask(n_operands=(2, 5), digits=(1, 3), operators="+-*")
    a = t.batch(np.random.default_rng(123), 20)
    b = t.batch(np.random.default_rng(123), 20)
    c = t.batch(np.random.default_rng(124), 20)
    assert a == b
    assert [s["prompt"] for s in a] != [s["prompt"] for s in c]
    # the task's own seed is used only when no generator is given
    assert ArithmeticTask(seed=5).batch(None, 10) == ArithmeticTask(seed=5).batch(None, 10)
    assert ArithmeticTask(seed=5).batch(None, 10) == ArithmeticTask().batch(np.random.default_rng(5), 10)


def test_exact_format_of_a_sample():
    s = ArithmeticTask(n_operands=3, digits=2, operators="+-").sample(np.random.default_rng(0))
    assert set(s) == {"prompt", "solution", "answer"}
    assert re.fullmatch(r"\d{1,2}[-+]\d{1,2}[-+]\d{1,2}\n", s["prompt"])
    lines = s["solution"].split("\n")
    assert len(lines) == 3 and all(STEP.fullmatch(x) for x in lines[:2]) and lines[2] == f"A: {s['answer']}"
    assert not s["solution"].endswith("\n")


knobs = st.fixed_dictionaries(
    {
        "n_operands": st.one_of(st.integers(2, 6), st.tuples(st.integers(2, 4), st.integers(4, 7))),
        "digits": st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 2), st.integers(2, 4))),
        "operators": st.sampled_from(["+", "-", "*", "+-", "-+", "+*", "-*", "+-*", "*-+"]),
    }
)


@given(knobs, st.integers(0, 2**32 - 1))
def test_solutions_are_correct_and_bounded(kw, seed):
    task = ArithmeticTask(**kw)
    samples = task.batch(np.random.default_rng(seed), 8)
    n_lo, n_hi = task.n_operands
    d_lo, d_hi = task.digits
    for s in samples:
        prompt, solution, answer = s["prompt"], s["solution"], s["answer"]
        assert isinstance(answer, int) and answer == eval(prompt)
        expr = prompt[:-1]
        assert prompt.endswith("\n") and "\n" not in expr and " " not in expr
        operands = re.split(r"[-+*]", expr)
        assert n_lo <= len(operands) <= n_hi
        assert all(len(x) <= d_hi and int(x) < 10**d_hi for x in operands)
        assert set(re.findall(r"[-+*]", expr)) <= set(task.operators)
        lines = solution.split("\n")
        assert len(lines) == len(operands)  # n-1 steps + the answer line
        assert all(STEP.fullmatch(x) for x in lines[:-1]), lines
        assert lines[-1] == f"A: {answer}"
        assert parse_int(extract_final_answer(solution)) == answer
        # bounds really bound
        assert len(prompt) <= task.max_prompt_chars
        assert len(solution) <= task.max_solution_chars < task.default_max_new_tokens
    prompts = [s["prompt"] for s in samples]
    steps = [s["solution"].split("\n") for s in samples]
    assert score_process(task.process_reward(), prompts, steps) == [[1.0] * len(x) for x in steps]
    assert task.reward()(prompts, [s["solution"] for s in samples], answer=[s["answer"] for s in samples]) == [1.0] * len(samples)


def test_multiplication_precedence_and_negatives_appear():
    task = ArithmeticTask(n_operands=(3, 4), digits=2, operators="+-*")
    samples = task.batch(np.random.default_rng(0), 300)
    assert any(s["answer"] < 0 for s in samples)
    # a sample where * follows + or -: the product must be the first step
    mixed = [s for s in samples if re.search(r"[-+]\d+\*", s["prompt"])]
    assert mixed
    for s in mixed:
        first = s["solution"].split("\n")[0]
        assert "*" in first and STEP.fullmatch(first)
    negative_operand_steps = [ln for s in samples for ln in s["solution"].split("\n") if ln.startswith("-")]
    assert negative_operand_steps and all(STEP.fullmatch(ln) for ln in negative_operand_steps)


def test_max_prompt_chars_is_attained():
    task = ArithmeticTask(n_operands=(2, 3), digits=(1, 2), operators="+")
    samples = task.batch(np.random.default_rng(0), 500)
    assert max(len(s["prompt"]) for s in samples) == task.max_prompt_chars == 9
    operands = [int(x) for s in samples for x in s["prompt"][:-1].split("+")]
    assert set(operands) == set(range(100))  # uniform over [0, 10**d - 1]: every value appears
    # d is drawn uniformly from {1, 2} first: P(operand < 10) = 0.5 * 1 + 0.5 * 0.1 = 0.55
    assert 0.45 < np.mean([x < 10 for x in operands]) < 0.65


def test_solution_bound_is_reasonably_tight():
    task = ArithmeticTask(n_operands=3, digits=2, operators="+-")
    longest = max(len(s["solution"]) for s in task.batch(np.random.default_rng(0), 2000))
    assert longest <= task.max_solution_chars <= longest + 12


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_operands=1), r"n_operands must be >= 2 and <= 64, got 1"),
        (dict(n_operands=(3, 2)), r"n_operands range must have min <= max, got \(3, 2\)"),
        (dict(n_operands="3"), r"n_operands must be an int or an inclusive \(min, max\) pair of ints, got '3'"),
        (dict(n_operands=(2, 3, 4)), r"n_operands must be an int or an inclusive"),
        (dict(n_operands=True), r"n_operands must be an int"),
        (dict(digits=0), r"digits must be >= 1 and <= 18, got 0"),
        (dict(digits=19), r"digits must be >= 1 and <= 18, got 19"),
        (dict(digits=(2, 1)), r"digits range must have min <= max"),
        (dict(digits=2.0), r"digits must be an int"),
        (dict(operators=""), r"operators must be a non-empty string"),
        (dict(operators="+/"), r"operators may only contain '\+-\*', got '\+/'"),
        (dict(operators="++"), r"operators must not repeat a character, got '\+\+'"),
        (dict(operators=["+"]), r"operators must be a non-empty string"),
        (dict(seed=-1), r"seed must be None or an int >= 0, got -1"),
        (dict(few_shot=-1), r"few_shot must be an integer from 0 to 64"),
        (dict(few_shot=True), r"few_shot must be an integer from 0 to 64"),
        (dict(few_shot=2, chat=True), r"few_shot is for base models and chat=True for chat models: choose one"),
    ],
)
def test_arithmetic_argument_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


@pytest.mark.parametrize("operators", ["+", "+-*"])
def test_the_few_shot_form_for_base_models(operators):
    """k solved ``a+b=c`` lines, then the question; the answer is the reply's number; the bounds hold."""
    task = ArithmeticTask(n_operands=(2, 3), digits=(1, 2), operators=operators, few_shot=3)
    samples = task.batch(np.random.default_rng(0), 300)
    for s in samples:
        *shots, question = s["prompt"].split("\n")
        assert len(shots) == 3 and question.endswith("=") and s["solution"] == str(s["answer"])
        for line in shots:
            expression, value = line.split("=")
            assert int(value) == solve_expression_value(expression)
        assert solve_expression_value(question[:-1]) == s["answer"]
    assert max(len(s["prompt"]) for s in samples) <= task.max_prompt_chars
    assert max(len(s["solution"]) for s in samples) <= task.max_solution_chars
    assert task.stop_strings == ("\n", "\n\n") and task.process_reward() is None
    reward = task.reward()([s["prompt"] for s in samples[:2]], [f"{samples[0]['answer']}\n", "7"],
                           answer=[s["answer"] for s in samples[:2]])
    assert reward == [1.0, float(samples[1]["answer"] == 7)]
    went_on = task.reward()(["x"], [f"{samples[0]['answer']}\n\n3+4=7"], answer=[samples[0]["answer"]])
    assert went_on == [1.0]  # the first line answers, not the made-up example after it
    assert ArithmeticTask().stop_strings == () and ArithmeticTask().process_reward() is not None  # default unchanged


def solve_expression_value(expression: str) -> int:
    from tokengym.rewards import solve_expression

    return solve_expression(expression)[1]


# ---------------------------------------------------------------- reverse


def test_reverse_task_format_and_rewards():
    task = ReverseTask()
    assert task.name == "reverse" and task.step_delimiter is None and task.stop_strings == ()
    assert task.process_reward() is None
    s = task.sample(np.random.default_rng(0))
    assert set(s) == {"prompt", "solution", "answer"}
    assert s["prompt"] == s["solution"][::-1] + "\n" and s["answer"] == s["solution"]
    r = task.reward()
    assert r(["abcd\n"] * 4, ["dcba", " dcba\n", "dcbx", "abcd"], answer=["dcba"] * 4) == [1.0, 1.0, 0.0, 0.0]
    pr = ReverseTask(partial_credit=True).reward()
    assert pr(["abcd\n"] * 3, ["dcba", "dcbx", "dc"], answer=["dcba"] * 3) == [1.0, 0.75, 0.5]


@given(st.one_of(st.integers(1, 12), st.tuples(st.integers(1, 5), st.integers(5, 12))), st.sampled_from(["ab", "abcdefghij", "xyz01"]), st.integers(0, 2**32 - 1))
def test_reverse_task_bounds_and_determinism(length, alphabet, seed):
    task = ReverseTask(length=length, alphabet=alphabet)
    samples = task.batch(np.random.default_rng(seed), 10)
    assert samples == task.batch(np.random.default_rng(seed), 10)
    lo, hi = task.length
    for s in samples:
        text = s["prompt"][:-1]
        assert lo <= len(text) <= hi and set(text) <= set(alphabet)
        assert len(s["prompt"]) <= task.max_prompt_chars
        assert len(s["solution"]) < task.default_max_new_tokens
    assert task.reward()([s["prompt"] for s in samples], [s["solution"] for s in samples], answer=[s["answer"] for s in samples]) == [1.0] * 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(length=0), r"length must be >= 1 and <= 4096, got 0"),
        (dict(length=(5, 3)), r"length range must have min <= max"),
        (dict(alphabet=""), r"alphabet must be a non-empty string"),
        (dict(alphabet="aab"), r"alphabet must not repeat a character, got 'aab'"),
        (dict(alphabet="a b"), r"alphabet must not contain whitespace"),
        (dict(partial_credit="yes"), r"partial_credit must be a bool, got 'yes'"),
    ],
)
def test_reverse_argument_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReverseTask(**kwargs)

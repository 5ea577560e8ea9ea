"""The rule-based arithmetic PRM and the canonical reduction order."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokengym.rewards import ArithmeticStepReward, arithmetic_step_reward, next_reduction, parse_expression, score_process, solve_expression

P = "12+7+30\n"


def score(prompt, lines):
    return arithmetic_step_reward([prompt], [lines])[0]


def test_parse_expression():
    assert parse_expression("12+7*3\n") == ([12, 7, 3], ["+", "*"])
    assert parse_expression("Compute:\n 1 - 2 \n\n") == ([1, 2], ["-"])
    for bad in ["", "12+", "+12", "1/2", "1+-2", "abc\n"]:
        with pytest.raises(ValueError, match="not an arithmetic expression"):
            parse_expression(bad)


@pytest.mark.parametrize(
    "expression, steps, answer",
    [
        ("12+7+30", ["12+7=19", "19+30=49"], 49),
        ("3-8+2", ["3-8=-5", "-5+2=-3"], -3),
        ("2+3*4-5", ["3*4=12", "2+12=14", "14-5=9"], 9),
        ("2*3*4+5*6", ["2*3=6", "6*4=24", "5*6=30", "24+30=54"], 54),
        ("10-2-3", ["10-2=8", "8-3=5"], 5),
        ("0-99*2", ["99*2=198", "0-198=-198"], -198),
        ("7", [], 7),
    ],
)
def test_solve_expression_canonical_order(expression, steps, answer):
    assert solve_expression(expression) == (steps, answer)
    assert answer == eval(expression)


def test_next_reduction():
    assert next_reduction(["+", "-"]) == 0
    assert next_reduction(["-", "*", "+", "*"]) == 1
    with pytest.raises(ValueError, match="fully reduced"):
        next_reduction([])


def test_canonical_solution_scores_all_ones():
    assert score(P, ["12+7=19", "19+30=49", "A: 49"]) == [1.0, 1.0, 1.0]
    assert score("2+3*4-5\n", ["3*4=12", "2+12=14", "14-5=9", "A: 9"]) == [1.0] * 4


def test_whitespace_and_answer_variants_are_tolerated():
    assert score(P, ["12 + 7 = 19", " 19+30 =49 ", "Answer = 49."]) == [1.0, 1.0, 1.0]
    assert score(P, ["12+7=19", "19+30=49", "a:49"]) == [1.0, 1.0, 1.0]


def test_wrong_result_then_consistent_step():
    # 12+7 is 19, not 18 (0.0); 18+30=48 correctly uses the written 18 (1.0); 48 is not the answer (0.0)
    assert score(P, ["12+7=18", "18+30=48", "A: 48"]) == [0.0, 1.0, 0.0]
    # a step that "repairs" the earlier mistake is inconsistent with what was written
    assert score(P, ["12+7=18", "19+30=49", "A: 49"]) == [0.0, 0.0, 1.0]


def test_wrong_operand_order():
    # 7+12 is arithmetically right but not the canonical reduction 12+7
    assert score(P, ["7+12=19", "19+30=49", "A: 49"]) == [0.0, 1.0, 1.0]
    assert score("12-7+1\n", ["7-12=-5", "-5+1=-4"]) == [0.0, 0.0]


def test_step_skipping_ahead():
    # reducing 7+30 before 12+7 breaks left-to-right order; the next step is judged on the written state
    assert score(P, ["7+30=37", "12+37=49", "A: 49"]) == [0.0, 1.0, 1.0]
    # with *, the product must come first
    assert score("2+3*4\n", ["2+3=5", "5*4=20", "A: 20"]) == [0.0, 1.0, 0.0]
    # jumping straight to a later step whose operands are not in the state
    assert score(P, ["19+30=49", "A: 49"]) == [0.0, 1.0]


def test_malformed_lines():
    assert score(P, ["", "12+7=19", "hello", "19+30=49", "A: 49"]) == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert score(P, ["12+7", "12+7=", "12+7=19=19", "12/7=1", "12+7=19"]) == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_lines_after_the_answer_and_extra_steps():
    assert score(P, ["12+7=19", "19+30=49", "A: 49", "A: 49", "49+0=49"]) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert score(P, ["12+7=19", "19+30=49", "49+0=49", "A: 49"]) == [1.0, 1.0, 0.0, 1.0]
    assert score(P, ["A: 48", "12+7=19"]) == [0.0, 0.0]


def test_answer_line_judged_against_true_answer():
    assert score(P, ["A: 49"]) == [1.0]
    assert score(P, ["12+7=19", "A: 49"]) == [1.0, 1.0]
    assert score(P, ["12+7=19", "19+30=49", "A: 4 9"]) == [1.0, 1.0, 0.0]


def test_partial_last_line_at_truncation():
    assert score(P, ["12+7=19", "19+3"]) == [1.0, 0.0]
    assert score(P, ["12+7=19", "19+30=4"]) == [1.0, 0.0]
    assert score(P, ["12+7=19", "19+30=49", "A:"]) == [1.0, 1.0, 0.0]
    assert score(P, []) == []


def test_batched_call_and_unknown_fields():
    prm = ArithmeticStepReward()
    out = prm(["1+2\n", "3*4\n"], [["1+2=3", "A: 3"], ["3*4=13"]], answer=[3, 12], solution=["", ""])
    assert out == [[1.0, 1.0], [0.0]]
    assert prm.name == "arithmetic_steps" == arithmetic_step_reward.name
    with pytest.raises(ValueError, match="2 prompts for 1 step lists"):
        prm(["1+2\n", "1+2\n"], [["1+2=3"]])


expressions = st.tuples(
    st.lists(st.integers(0, 999), min_size=2, max_size=6),
    st.lists(st.sampled_from("+-*"), min_size=5, max_size=5),
).map(lambda t: str(t[0][0]) + "".join(f"{op}{v}" for op, v in zip(t[1], t[0][1:])))


@given(expressions)
def test_canonical_solutions_score_all_ones(expression):
    steps, answer = solve_expression(expression)
    assert answer == eval(expression)
    lines = [*steps, f"A: {answer}"]
    assert score_process(arithmetic_step_reward, [expression + "\n"], [lines]) == [[1.0] * len(lines)]


@given(expressions, st.data())
def test_corrupting_a_result_digit_zeroes_that_step(expression, data):
    steps, answer = solve_expression(expression)
    k = data.draw(st.integers(0, len(steps) - 1), label="step")
    a, _, c = steps[k].rpartition("=")
    digit_positions = [i for i, ch in enumerate(c) if ch.isdigit()]
    pos = data.draw(st.sampled_from(digit_positions), label="position")
    new = data.draw(st.sampled_from([d for d in "0123456789" if d != c[pos]]), label="digit")
    corrupted = list(steps)
    corrupted[k] = f"{a}={c[:pos]}{new}{c[pos + 1:]}"
    scores = score(expression + "\n", [*corrupted, f"A: {answer}"])
    assert scores[k] == 0.0
    assert scores[:k] == [1.0] * k  # earlier steps are unaffected
    assert scores[-1] == 1.0  # the answer line is judged against the true answer


@given(expressions, st.data())
def test_steps_consistent_with_a_wrong_result_score_one(expression, data):
    values, ops = parse_expression(expression)
    steps, _ = solve_expression(expression)
    k = data.draw(st.integers(0, len(steps) - 1), label="step")
    delta = data.draw(st.integers(1, 50), label="delta")
    # replay the canonical order, writing a wrong result at step k and correct ones (from the written state) after it
    lines = []
    for s in range(len(steps)):
        i = next_reduction(ops)
        x, op, y = values[i], ops[i], values[i + 1]
        c = {"+": x + y, "-": x - y, "*": x * y}[op] + (delta if s == k else 0)
        lines.append(f"{x}{op}{y}={c}")
        values[i : i + 2] = [c]
        del ops[i]
    scores = score(expression + "\n", [*lines, f"A: {values[0]}"])
    assert scores == [1.0] * k + [0.0] + [1.0] * (len(steps) - k - 1) + [0.0]

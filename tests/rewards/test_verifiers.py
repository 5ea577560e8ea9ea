"""Verifiers: integer parsing, answer extraction and the outcome rewards built on them."""

import doctest

import numpy as np
import pytest
import torch

import tokengym.rewards as R
from tokengym.rewards import (
    answer_match,
    arithmetic_correct,
    char_accuracy,
    exact_match,
    extract_answer,
    extract_final_answer,
    parse_int,
)


@pytest.mark.parametrize(
    "text, value",
    [("49", 49), (" 49 ", 49), ("+49", 49), ("-49", -49), ("49.0", 49), ("49.", 49), ("49.00", 49),
     ("1,234", 1234), ("-12,345,678", -12345678), ("0", 0), ("-0", 0), ("\u22125", -5), ("007", 7), (12, 12)],
)
def test_parse_int_accepts(text, value):
    assert parse_int(text) == value


@pytest.mark.parametrize("text", ["", " ", "4 9", "49.5", "12,34", "1,2345", "+ 49", "49a", "--4", "4-9", "A: 49", None, True, 4.0])
def test_parse_int_rejects(text):
    assert parse_int(text) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12+7=19\n19+30=49\nA: 49", "49"),
        ("A:49", "49"),
        ("a : 49", "49"),
        ("Answer: 49", "49"),
        ("answer = 49", "49"),
        ("A = 49.", "49"),
        ("A=49", "49"),
        ("A: +49", "+49"),
        ("  A: 49  \n\n  \n", "49"),
        ("Final answer: -3!", "-3"),
        ("19+30=49\n49", "49"),
        ("19+30=49\n49.\n\n", "49"),
        ("A: 48\nA: 49", "49"),  # the last answer line wins
        ("A: 49\n12+7=19", "49"),  # an answer line beats a later non-answer line
        ("A: 4 9", "4 9"),
        ("12+7=19", None),
        ("", None),
        ("the answer is forty-nine", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


CORRECT_49 = ["A: 49", "A:49", "a : 49", "Answer: 49", "A = 49.", "12+7=19\n19+30=49\n49", "A: +49", "A: 49\n", "A: 49   \n\n",
              "  A:  49", "ANSWER=49", "12+7=19\n19+30=49\nA: 49", "A: 49.0", "answer: 49,"]
WRONG_49 = ["A: 48", "A: 490", "A: 4 9", "", "12+7=19\n19+30=49", "A: -49", "A: 49.5", "A:", "A: 49 apples", "B: 49", "4 9"]


def test_arithmetic_correct_has_no_false_negatives():
    n = len(CORRECT_49)
    assert arithmetic_correct(["12+7+30\n"] * n, CORRECT_49, answer=[49] * n) == [1.0] * n


def test_arithmetic_correct_rejects_wrong_answers():
    n = len(WRONG_49)
    assert arithmetic_correct(["12+7+30\n"] * n, WRONG_49, answer=[49] * n) == [0.0] * n


def test_arithmetic_correct_reference_types_and_negatives():
    comps = ["3-8=-5\n-5+2=-3\nA: -3", "A: 1234", "A: 7", "A: 7"]
    refs = [-3, "1,234", np.int64(7), torch.tensor(7)]
    assert arithmetic_correct(["p"] * 4, comps, answer=refs) == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="reference answer 'x' is not an integer"):
        arithmetic_correct(["p"], ["A: 1"], answer=["x"])


def test_verifiers_ignore_unknown_fields_and_check_lengths():
    assert arithmetic_correct(["p"], ["A: 1"], answer=[1], solution=["A: 1"], whatever=[object()]) == [1.0]
    with pytest.raises(ValueError, match="field 'answer' has 1 entries for 2 completions"):
        arithmetic_correct(["p", "q"], ["A: 1", "A: 2"], answer=[1])
    with pytest.raises(ValueError, match="needs the task field 'answer'"):
        exact_match(["p"], ["x"])


def test_exact_match():
    comps = ["dcba", " dcba\n", "dcb", "dcbaa", "DCBA", "+49", "49", "A: 49"]
    refs = ["dcba", "dcba", "dcba", "dcba", "dcba", 49, "49", 49]
    assert exact_match(["p"] * 8, comps, answer=refs) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_extract_answer_and_answer_match():
    assert extract_answer("hmm\n<answer>a\nb</answer>\nbye") == "a\nb"
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("work\nAnswer: Paris") == "Paris"
    assert extract_answer("work\nParis\n\n") == "Paris"
    assert extract_answer("") is None
    comps = ["x\nAnswer: Paris.", "<answer>Paris</answer>", "Rome", "so\nParis", "Paris is it", "", "A: 12", "A: 12.0"]
    refs = ["Paris", "Paris", "Paris", "Paris", "Paris", "Paris", 12, "12"]
    assert answer_match(["p"] * 8, comps, answer=refs) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_char_accuracy():
    comps = ["dcba", "dcbx", "xcba", "dcbaa", "dc", "", " dcba "]
    assert char_accuracy(["p"] * 7, comps, answer=["dcba"] * 7) == [1.0, 0.75, 0.75, 0.8, 0.5, 0.0, 1.0]
    assert char_accuracy(["p"], [""], answer=[""]) == [1.0]


@pytest.mark.parametrize("module", ["verifiers", "arithmetic_prm", "combinators"])
def test_docstring_examples_run(module):
    result = doctest.testmod(getattr(R, module), verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_public_names_are_exported():
    for name in R.__all__:
        assert hasattr(R, name), name
    for name in ["OutcomeReward", "ProcessReward", "score_outcome", "score_process", "arithmetic_step_reward", "weighted_sum",
                 "format_reward", "length_penalty", "extract_final_answer", "parse_int", "arithmetic_correct", "exact_match"]:
        assert name in R.__all__, name

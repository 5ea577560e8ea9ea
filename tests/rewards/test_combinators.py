"""weighted_sum, format_reward and length_penalty."""

import math

import pytest
import torch

from tokengym.rewards import (
    arithmetic_correct,
    format_reward,
    length_penalty,
    reward_name,
    score_outcome,
    weighted_sum,
)

PROMPTS = ["1+2\n", "1+2\n", "1+2\n"]
COMPS = ["1+2=3\nA: 3", "A: 4", "three"]
FIELDS = {"answer": [3, 3, 3]}


def test_weighted_sum_total_and_components():
    fmt = format_reward(r"(.*\n)?A: -?\d+")
    r = weighted_sum({"correct": arithmetic_correct, "format": fmt}, weights={"format": 0.25})
    assert r.name == "weighted_sum" and reward_name(r) == "weighted_sum"
    assert r(PROMPTS, COMPS, **FIELDS) == [1.25, 0.25, 0.0]
    comps = r.components(PROMPTS, COMPS, **FIELDS)
    assert comps == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}

    total, logged = score_outcome(r, PROMPTS, COMPS, FIELDS)
    assert total.tolist() == [1.25, 0.25, 0.0]
    assert set(logged) == {"correct", "format"}
    assert logged["format"].tolist() == [1.0, 1.0, 0.0]  # components are reported unweighted


def test_weighted_sum_combine_and_tensor_terms():
    def t(prompts, completions, **_):
        return torch.tensor([2.0, -1.0, 0.5])

    r = weighted_sum({"a": t, "b": length_penalty(2, 1.0)}, {"a": -2.0}, name="mix")
    combined = r.combine({"a": torch.tensor([1.0, 1.0, 1.0]), "b": torch.tensor([0.0, 1.0, 2.0])})
    assert combined.tolist() == [-2.0, -1.0, 0.0]
    # len("1+2=3\nA: 3") = 10 -> -8; len("A: 4") = 4 -> -2; len("three") = 5 -> -3
    assert r(PROMPTS, COMPS) == [-4.0 - 8.0, 2.0 - 2.0, -1.0 - 3.0]
    with pytest.raises(ValueError, match=r"missing components \['b'\]"):
        r.combine({"a": torch.zeros(3)})


def test_weighted_sum_nested():
    inner = weighted_sum({"c": arithmetic_correct}, {"c": 2.0}, name="inner")
    outer = weighted_sum({"inner": inner, "len": length_penalty(0, 0.5)}, {"inner": 3.0})
    assert outer(["p"], ["A: 3"], answer=[3]) == [6.0 - 2.0]


def test_weighted_sum_validation():
    with pytest.raises(ValueError, match="non-empty dict"):
        weighted_sum({})
    with pytest.raises(ValueError, match=r"weights names unknown terms \['typo'\]; the terms are \['a'\]"):
        weighted_sum({"a": arithmetic_correct}, {"typo": 1.0})
    with pytest.raises(TypeError, match=r"terms\['a'\] must be an outcome reward"):
        weighted_sum({"a": 3})
    with pytest.raises(ValueError, match=r"weights\['a'\] must be a finite number, got nan"):
        weighted_sum({"a": arithmetic_correct}, {"a": math.nan})


def test_weighted_sum_checks_its_terms_when_called_directly():
    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(ValueError, match=r"reward 'weighted_sum\.s' returned shape \(1,\) for 2 completions"):
        weighted_sum({"s": short})(["p", "q"], ["a", "b"])


def test_format_reward_fullmatch_vs_search():
    full = format_reward(r"A: \d+", reward=0.5)
    assert full.name == "format"
    assert full(["p"] * 4, ["A: 3", "  A: 3\n", "x\nA: 3", "A: 3 extra"]) == [0.5, 0.5, 0.0, 0.0]
    search = format_reward(r"A: \d+", mode="search")
    assert search(["p"] * 4, ["A: 3", "  A: 3\n", "x\nA: 3", "nothing"]) == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward("(")
    with pytest.raises(ValueError, match="mode must be 'fullmatch' or 'search', got 'match'"):
        format_reward("x", mode="match")


def test_length_penalty():
    lp = length_penalty(max_len=3, coef=0.1)
    assert lp.name == "length_penalty"
    out = lp(["p"] * 4, ["", "abc", "abcd", "abcdefghij"], answer=[1, 2, 3, 4])
    assert out[:2] == [0.0, 0.0] and out[2] == pytest.approx(-0.1) and out[3] == pytest.approx(-0.7)
    for bad in [dict(max_len=-1, coef=1.0), dict(max_len=1.5, coef=1.0), dict(max_len=1, coef=-0.1), dict(max_len=1, coef=math.inf)]:
        with pytest.raises(ValueError, match="max_len|coef"):
            length_penalty(**bad)

"""score_outcome / score_process: the checks every reward output goes through."""

import math

import pytest
import torch

from tokengym.rewards import OutcomeReward, ProcessReward, arithmetic_step_reward, exact_match, score_outcome, score_process, weighted_sum


def const(values):
    def reward(prompts, completions, **_):
        return values

    return reward


def test_score_outcome_plain_function():
    total, comps = score_outcome(exact_match, ["p", "q"], ["a", "b"], {"answer": ["a", "c"]})
    assert total.dtype == torch.float32 and total.tolist() == [1.0, 0.0]
    assert list(comps) == ["exact_match"] and comps["exact_match"].tolist() == [1.0, 0.0]


def test_score_outcome_accepts_tensors():
    total, _ = score_outcome(const(torch.tensor([0.5, 2.0], dtype=torch.float64)), ["p", "q"], ["a", "b"])
    assert total.tolist() == [0.5, 2.0] and total.dtype == torch.float32


def test_score_outcome_wrong_length():
    with pytest.raises(ValueError, match=r"reward 'reward' returned shape \(2,\) for 3 completions; expected \(3,\)"):
        score_outcome(const([1.0, 0.0]), ["p"] * 3, ["c"] * 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_score_outcome_non_finite(bad):
    with pytest.raises(ValueError, match=r"returned a non-finite value \((nan|inf|-inf)\) for completion 1"):
        score_outcome(const([1.0, bad]), ["p"] * 2, ["c"] * 2)


def test_score_outcome_non_numeric():
    with pytest.raises(TypeError, match="must return a list of floats or a 1-D tensor"):
        score_outcome(const(["yes", "no"]), ["p"] * 2, ["c"] * 2)


def test_score_outcome_names_the_bad_component():
    ws = weighted_sum({"good": const([1.0, 1.0]), "bad": const([1.0, math.nan])}, name="mix")
    with pytest.raises(ValueError, match=r"reward 'mix\.bad' returned a non-finite value"):
        score_outcome(ws, ["p"] * 2, ["c"] * 2)


def test_score_process_checks():
    prompts = ["1+2\n", "1+2\n"]
    steps = [["1+2=3", "A: 3"], ["1+2=4"]]
    assert score_process(arithmetic_step_reward, prompts, steps) == [[1.0, 1.0], [0.0]]

    def wrong_rows(prompts, steps, **_):
        return [[1.0, 1.0]]

    with pytest.raises(ValueError, match="process reward 'wrong_rows' returned 1 score lists for 2 completions"):
        score_process(wrong_rows, prompts, steps)

    def wrong_count(prompts, steps, **_):
        return [[1.0] * len(s) for s in steps[:-1]] + [[1.0, 1.0]]

    with pytest.raises(ValueError, match="returned 2 scores for completion 1 with 1 steps"):
        score_process(wrong_count, prompts, steps)

    def nan_step(prompts, steps, **_):
        return [[1.0] * len(s) for s in steps[:-1]] + [[math.nan]]

    with pytest.raises(ValueError, match="not finite in float32 for completion 1"):
        score_process(nan_step, prompts, steps)

    def huge_step(prompts, steps, **_):  # a finite float, and inf in the float32 buffers the env keeps
        return [[1e308] * len(s) for s in steps]

    with pytest.raises(ValueError, match="not finite in float32 for completion 0"):
        score_process(huge_step, prompts, steps)


def test_builtins_satisfy_the_protocols():
    assert isinstance(exact_match, OutcomeReward)
    assert isinstance(weighted_sum({"a": exact_match}), OutcomeReward)
    assert isinstance(arithmetic_step_reward, ProcessReward)

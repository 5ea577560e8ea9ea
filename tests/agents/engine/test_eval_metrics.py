"""pass@k / maj@k / mean@k: properties of the pure functions, and ``tokengym eval --k`` agreeing with them."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokengym.agents.cli import main
from tokengym.agents.engine.eval_metrics import at_k_metrics, maj_at_k, mean_at_k, pass_at_k


@st.composite
def n_c(draw):
    n = draw(st.integers(1, 60))
    return n, draw(st.integers(0, n))


@given(n_c())
def test_pass_at_k_is_monotone_bounded_and_exact_at_the_ends(nc):
    n, c = nc
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))  # more draws never lower the chance
    assert values[0] == pytest.approx(c / n, abs=1e-12)  # pass@1 is the mean correctness
    assert (values[-1] == 1.0) == (c > 0)  # all n drawn: solved iff any sample was correct


@given(n_c(), st.data())
def test_pass_at_k_matches_the_binomial_form(nc, data):
    n, c = nc
    k = data.draw(st.integers(1, n))
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, fine at these sizes
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_hand_computed_cases():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 4, 2) == 1.0
    assert mean_at_k([True, False, True, True], 2) == 0.5
    # "b" wins 2-1 among the first 3 (the 4th sample is outside k); its first completion is correct
    assert maj_at_k(["a", "b", "b", "a"], [False, True, False, False], 3) == 1.0
    # a 1-1 tie goes to the answer seen first ("a"), whose completion is wrong; None does not vote
    assert maj_at_k([None, "a", "b"], [True, False, True], 3) == 0.0
    assert maj_at_k([None, None], [True, True], 2) == 0.0
    assert at_k_metrics([(["x", "y"], [True, False]), (["z", "z"], [False, False])], 2) == {
        "pass@2": 0.5, "maj@2": 0.5, "mean@2": 0.25}
    with pytest.raises(ValueError, match=r"k must be in \[1, n\]"):
        pass_at_k(3, 1, 4)


def test_eval_k_prints_and_writes_metrics_that_the_pure_functions_reproduce(tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", "tiny-arithmetic", "--prompts", "12", "--samples", "5", "--k", "4", "--threads", "1",
                 "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    res = json.loads(out.read_text())["at_k"]
    rows = res["per_prompt"]
    assert len(rows) == 12 and all(len(r["answers"]) == len(r["correct"]) == 5 for r in rows)
    expect = {
        "pass@4": sum(pass_at_k(5, sum(r["correct"]), 4) for r in rows) / 12,
        "maj@4": sum(maj_at_k(r["answers"], r["correct"], 4) for r in rows) / 12,
        "mean@4": sum(mean_at_k(r["correct"], 4) for r in rows) / 12,
    }
    assert {k: res[k] for k in expect} == pytest.approx(expect, abs=1e-12)
    flat = [x for r in rows for x in r["correct"]]
    assert res["sampled"]["accuracy"] == pytest.approx(sum(flat) / len(flat))  # the table's sampled row: same episodes
    assert 0 < sum(flat) < len(flat)  # some right, some wrong: the metrics are not trivially 0 or 1
    line = f"pass@4 {expect['pass@4']:.1%}  maj@4 {expect['maj@4']:.1%}  mean@4 {expect['mean@4']:.1%}"
    assert line in text, text


def test_eval_k_above_samples_is_one_line_exit_2(capsys):
    assert main(["eval", "--model", "tiny-arithmetic", "--samples", "2", "--k", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--k 4 needs 1 <= k <= --samples" in err, err

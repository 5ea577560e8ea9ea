"""ReasoningGymTask with the leg_counting dataset."""

import numpy as np
import pytest

pytest.importorskip("reasoning_gym")

from tokengym.envs.tasks import ReasoningGymTask  # noqa: E402
from tokengym.rewards import score_outcome  # noqa: E402


@pytest.fixture(scope="module")
def task():
    return ReasoningGymTask("leg_counting", size=20, seed=0)


def fields_of(samples):
    return {k: [s[k] for s in samples] for k in samples[0] if k != "prompt"}


def test_samples_and_determinism(task):
    assert task.name == "reasoning_gym/leg_counting" and len(task) == 20
    a = task.batch(np.random.default_rng(5), 25)
    assert a == task.batch(np.random.default_rng(5), 25)
    assert set(a[0]) == {"prompt", "answer", "solution", "index"}
    for s in a:
        entry = task.entry(s["index"])
        assert s["prompt"] == entry["question"] and s["answer"] == str(entry["answer"])
        assert len(s["prompt"]) <= task.max_prompt_chars
    assert sorted(s["index"] for s in a[:20]) == list(range(20))  # one epoch covers every entry once


def test_reward_scores_right_and_wrong_answers(task):
    samples = task.batch(np.random.default_rng(0), 4)
    prompts = [s["prompt"] for s in samples]
    right = [s["solution"] for s in samples]
    assert task.reward()(prompts, right, **fields_of(samples)) == [1.0] * 4
    ans = samples[0]["answer"]
    variants = [f"<answer>{ans}</answer>", f"Let me count.\n{ans}", f"Answer: {ans}", f"<answer>{int(ans) + 1}</answer>", f"{ans}\nno wait, 3", ""]
    one = [samples[0]] * len(variants)
    total, comps = score_outcome(task.reward(), [samples[0]["prompt"]] * len(variants), variants, fields_of(one))
    assert total[:3].tolist() == [1.0, 1.0, 1.0]
    assert all(x < 1.0 for x in total[3:].tolist())
    assert list(comps) == ["reasoning_gym/leg_counting"]


def test_reward_needs_the_index_field(task):
    with pytest.raises(ValueError, match="needs the task field 'index'"):
        task.reward()(["q"], ["1"], answer=["1"])


def test_unknown_dataset_and_bad_size():
    with pytest.raises(ValueError, match="could not create dataset 'no_such_dataset'"):
        ReasoningGymTask("no_such_dataset", size=3)
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        ReasoningGymTask("leg_counting", size=0)


def test_config_is_passed_to_reasoning_gym():
    small = ReasoningGymTask("leg_counting", size=5, seed=1, min_animals=1, max_animals=1)
    assert all(len(small.entry(i)["metadata"]["animals"]) == 1 for i in range(5))


def test_extract_answer_is_what_the_verifier_scores(task):
    s = task.batch(np.random.default_rng(0), 1)[0]
    ans = s["answer"]
    cases = {f"I count.\n<answer> {ans} </answer>": ans, f"Answer: {ans}.": ans, f"{ans}\nno wait, 3": "no wait, 3", "": None}
    assert {c: task.extract_answer(c) for c in cases} == cases
    scores = task.reward()([s["prompt"]] * len(cases), list(cases), index=[s["index"]] * len(cases))
    assert scores == [1.0, 1.0, 0.0, 0.0]

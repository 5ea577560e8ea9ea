"""DatasetTask: JSONL / list / datasets.Dataset sources, the row walk, and clear errors."""

import json

import numpy as np
import pytest
from gymnasium.utils import seeding

from tokengym.envs.tasks import DatasetTask
from tokengym.rewards import answer_match

ROWS = [{"prompt": f"q{i}?", "answer": i, "topic": "t" * (i % 3)} for i in range(7)]


def prompts_of(samples):
    return [s["prompt"] for s in samples]


def write_jsonl(path, rows, extra_lines=()):
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n", encoding="utf-8")
    return path


def test_from_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3], extra_lines=["", "   "])
    for data in (path, str(path)):
        task = DatasetTask(data, shuffle=False)
        assert len(task) == 3 and task.columns == ["prompt", "answer", "topic"]
        assert task.batch(np.random.default_rng(0), 4) == [
            {"prompt": "q0?", "answer": 0, "topic": ""},
            {"prompt": "q1?", "answer": 1, "topic": "t"},
            {"prompt": "q2?", "answer": 2, "topic": "tt"},
            {"prompt": "q0?", "answer": 0, "topic": ""},
        ]
    assert task.max_prompt_chars == 3 and task.default_max_new_tokens == 64
    assert task.reward() is answer_match and task.process_reward() is None
    assert task.step_delimiter is None and task.stop_strings == ()


def test_from_list_with_prompt_key_and_options():
    rows = [{"question": "a long question", "gold": "x"}, {"question": "short", "gold": "y"}]
    ok = lambda prompts, completions, **_: [1.0] * len(completions)  # noqa: E731
    prm = lambda prompts, steps, **_: [[1.0] * len(s) for s in steps]  # noqa: E731
    task = DatasetTask(rows, prompt_key="question", shuffle=False, reward=ok, process_reward=prm, step_delimiter="\n",
                       stop_strings=["###"], max_new_tokens=9, name="qa")
    assert task.sample(np.random.default_rng(0)) == {"prompt": "a long question", "gold": "x"}
    assert task.max_prompt_chars == len("a long question") and task.default_max_new_tokens == 9
    assert task.reward() is ok and task.process_reward() is prm and task.stop_strings == ("###",) and task.name == "qa"


def test_from_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    task = DatasetTask(ds, shuffle=False)
    assert len(task) == 7 and task.max_prompt_chars == 3
    assert task.batch(np.random.default_rng(0), 2) == [ROWS[0], ROWS[1]]
    shuffled = DatasetTask(ds, shuffle=True).batch(np.random.default_rng(3), 7)
    assert sorted(prompts_of(shuffled)) == sorted(r["prompt"] for r in ROWS)
    # the same rows from a list give the same walk
    assert shuffled == DatasetTask(ROWS).batch(np.random.default_rng(3), 7)
    with pytest.raises(ValueError, match=r"DatasetDict; pick a split, e.g. data\['train'\]"):
        DatasetTask(datasets.DatasetDict({"train": ds}))
    with pytest.raises(ValueError, match=r"prompt_key 'text' is not a column of the data; the columns are \['prompt', 'answer', 'topic'\]"):
        DatasetTask(ds, prompt_key="text")
    with pytest.raises(ValueError, match="data is empty"):
        DatasetTask(ds.select([]))


def test_shuffle_walks_epoch_permutations():
    task = DatasetTask(ROWS, shuffle=True)
    rng = np.random.default_rng(0)
    got = prompts_of(task.batch(rng, 21))
    epochs = [got[0:7], got[7:14], got[14:21]]
    for epoch in epochs:
        assert sorted(epoch) == sorted(r["prompt"] for r in ROWS)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # a fresh permutation each epoch
    assert epochs[0] != [r["prompt"] for r in ROWS]  # shuffled
    # the permutation comes from the generator
    expected = [f"q{i}?" for i in np.random.default_rng(0).permutation(7)]
    assert epochs[0] == expected


def test_reseeding_replays_the_stream():
    task = DatasetTask(ROWS, shuffle=True)
    # what an env does on reset(seed=s): a fresh generator from the seed, and the on_seed hook
    rng, _ = seeding.np_random(11)
    task.on_seed(11)
    first = prompts_of(task.batch(rng, 10))
    rng, _ = seeding.np_random(11)
    task.on_seed(11)
    assert prompts_of(task.batch(rng, 10)) == first
    # a fresh generator alone also restarts the walk
    assert prompts_of(task.batch(seeding.np_random(11)[0], 10)) == first
    # an in-place re-seed of the same generator object replays once on_seed is called
    rng = np.random.default_rng(11)
    state = rng.bit_generator.state
    head = prompts_of(task.batch(rng, 5))
    task.batch(rng, 3)
    rng.bit_generator.state = state
    task.on_seed(11)
    assert prompts_of(task.batch(rng, 5)) == head
    # different seeds give different walks
    assert prompts_of(task.batch(seeding.np_random(12)[0], 10)) != first


def test_in_order_walk_restarts_on_seed():
    task = DatasetTask(ROWS, shuffle=False)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert prompts_of(task.batch(rng, 3)) == ["q0?", "q1?", "q2?"]
    assert prompts_of(task.batch(rng, 2)) == ["q3?", "q4?"]
    assert rng.bit_generator.state == state  # the in-order walk does not consume the generator
    task.on_seed(0)
    assert prompts_of(task.batch(rng, 2)) == ["q0?", "q1?"]


def test_independent_generators_walk_independently():
    task = DatasetTask(ROWS, shuffle=False)
    a, b = np.random.default_rng(0), np.random.default_rng(1)
    assert [task.sample(a)["prompt"], task.sample(b)["prompt"], task.sample(a)["prompt"]] == ["q0?", "q0?", "q1?"]


def test_default_reward_is_extracted_answer_exact_match():
    task = DatasetTask([{"prompt": "2+2?", "answer": 4}, {"prompt": "capital?", "answer": "Paris"}])
    r = task.reward()
    assert r(["2+2?", "2+2?", "capital?", "capital?"], ["2+2 is\nA: 4", "A: 5", "It is\nParis", "paris"],
             answer=[4, 4, "Paris", "Paris"]) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "data, kwargs, match",
    [
        ([], {}, r"data is empty"),
        ([{"text": "a", "answer": 1}], {}, r"prompt_key 'prompt' is not a column of the data; the columns are \['text', 'answer'\]"),
        ([{"prompt": "a", "answer": 1}, {"prompt": "b"}], {}, r"rows have inconsistent keys: row 1 has \['prompt'\] but row 0 has \['answer', 'prompt'\] \(missing \['answer'\]"),
        ([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2, "x": 0}], {}, r"row 1 .*extra \['x'\]"),
        ([{"prompt": "a"}], {}, r"no reward given and the data has no 'answer' column \(columns: \['prompt'\]\); pass reward="),
        ([{"prompt": 3, "answer": 1}], {}, r"row 0: the prompt \('prompt'\) must be a string, like row 0's, got int"),
        ([{"prompt": "a", "answer": 1}, "b"], {}, r"row 1 must be a dict, got str"),
        ([{"q": "a", "prompt": "b", "answer": 1}], {"prompt_key": "q"}, r"has a 'prompt' column and prompt_key='q'"),
        ([{"prompt": "a", "answer": 1}], {"reward": "exact"}, r"reward must be an outcome reward \(callable\) or None, got 'exact'"),
        ([{"prompt": "a", "answer": 1}], {"process_reward": lambda p, s: s}, r"process_reward needs step_delimiter"),
        ([{"prompt": "a", "answer": 1}], {"stop_strings": "##"}, r"stop_strings must be a sequence of non-empty strings, got '##'"),
        ([{"prompt": "a", "answer": 1}], {"max_new_tokens": 0}, r"max_new_tokens must be an int >= 1, got 0"),
        ([{"prompt": "a", "answer": 1}], {"shuffle": "yes"}, r"shuffle must be a bool, got 'yes'"),
        ([{"prompt": "a", "answer": 1}], {"step_delimiter": ""}, r"step_delimiter must be None or a non-empty string, got ''"),
    ],
)
def test_clear_errors(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetTask(data, **kwargs)


def test_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such JSONL file"):
        DatasetTask(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 1}\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        DatasetTask(bad)
    arr = tmp_path / "arr.jsonl"
    arr.write_text('[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"arr\.jsonl:1: each line must be a JSON object, got list"):
        DatasetTask(arr)
    with pytest.raises(TypeError, match="data must be a JSONL path, a list of dicts or a datasets.Dataset, got int"):
        DatasetTask(3)

"""Tasks own their training data: Arithmetic's bundled pairs and step labels, and the error of a task without them."""

import hashlib
import json

import pytest

import tokengym.agents
from tokengym.agents.data import pairs as agent_pairs
from tokengym.agents.data import reward_data
from tokengym.envs.tasks import ArithmeticTask, CalculatorTask, ReverseTask, TargetTask, Task, arithmetic_data

TASKS = {"default": ArithmeticTask(), "mixed": ArithmeticTask(n_operands=(2, 4), digits=(1, 3), operators="+-*")}

# sha256[:16] of json.dumps(..., sort_keys=True) of the outputs of agents.pairs.arithmetic_pairs(task, 37, seed, exclude_prompts=...)
# and agents.reward_data.arithmetic_step_labels(task, 41, seed, exclude_prompts=...) before they moved to envs; exclusions
# are the prompts of the same seed's first 10 pairs, so they change the draw.
BEFORE_THE_MOVE = {
    ("pairs", "default", 0, False): "cb2825eae660b8cb", ("steps", "default", 0, False): "ffc86c6e11c1714b",
    ("pairs", "default", 0, True): "c479c9a9949eb783", ("steps", "default", 0, True): "486629a7740042ab",
    ("pairs", "default", 7, True): "3919c9a2c71d8ed2", ("steps", "default", 7, True): "b2726b5a2fbd9071",
    ("pairs", "mixed", 0, True): "9b1c3a461cae8450", ("steps", "mixed", 0, True): "4e7fa1d88d4825e5",
    ("pairs", "mixed", 7, False): "be1e5be6c30dd899", ("steps", "mixed", 7, False): "ff69349bc92f5445",
}


def _digest(records):
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("kind,task,seed,exclude", sorted(BEFORE_THE_MOVE))
def test_task_methods_give_exactly_the_data_of_the_old_functions(kind, task, seed, exclude):
    t = TASKS[task]
    held = {p["prompt"] for p in t.preference_pairs(10, seed=seed)} if exclude else set()
    if kind == "pairs":
        got = t.preference_pairs(37, seed=seed, exclude_prompts=held)
        assert got == agent_pairs.arithmetic_pairs(t, 37, seed, exclude_prompts=held)
    else:
        got = t.step_labels(41, seed=seed, exclude_prompts=sorted(held))
        assert got == reward_data.arithmetic_step_labels(t, 41, seed, exclude_prompts=sorted(held))
    assert _digest(got) == BEFORE_THE_MOVE[kind, task, seed, exclude]


def test_old_names_are_the_envs_objects():
    assert agent_pairs.arithmetic_pairs is tokengym.agents.arithmetic_pairs is arithmetic_data.arithmetic_pairs
    assert agent_pairs.CORRUPTIONS is arithmetic_data.CORRUPTIONS
    assert agent_pairs.corrupt_solution is arithmetic_data.corrupt_solution


@pytest.mark.parametrize("method", ["preference_pairs", "step_labels"])
def test_exclusions_are_respected(method):
    t = ArithmeticTask(n_operands=2, digits=1, operators="+")  # 100 prompts: exclusions bite
    first = getattr(t, method)(30, seed=1)
    held = {r["prompt"] for r in first[:15]}
    again = getattr(t, method)(30, seed=1, exclude_prompts=iter(held))  # any iterable
    assert len(again) == 30 and not held & {r["prompt"] for r in again}
    assert again == getattr(t, method)(30, seed=1, exclude_prompts=held) != first


def test_record_fields():
    t = ArithmeticTask()
    assert t.has_bundled_data("preference_pairs") and t.has_bundled_data("step_labels")
    p = t.preference_pairs(5)
    assert sorted(p[0]) == ["answer", "chosen", "kind", "prompt", "rejected"] and all(r["chosen"] != r["rejected"] for r in p)
    s = t.step_labels(5)
    assert sorted(s[0]) == ["answer", "labels", "prompt", "source", "steps"]
    assert all(len(r["steps"]) == len(r["labels"]) for r in s)


@pytest.mark.parametrize("task,name", [(ReverseTask(), "ReverseTask"), (TargetTask("ok"), "TargetTask"),
                                       (CalculatorTask(), "CalculatorTask"),
                                       (ArithmeticTask(chat=True), "ArithmeticTask(chat=True)")])
def test_a_task_without_data_says_so_and_what_to_pass(task, name):
    assert not task.has_bundled_data("preference_pairs") and not task.has_bundled_data("step_labels")
    with pytest.raises(NotImplementedError) as e:
        task.preference_pairs(4)
    assert str(e.value) == f"no bundled preference pairs for {name}; pass --pairs FILE.jsonl with prompt/chosen/rejected"
    with pytest.raises(NotImplementedError) as e:
        task.step_labels(4, seed=1, exclude_prompts=["x"])
    assert str(e.value) == f"no bundled step labels for {name}; pass --step-labels FILE.jsonl with prompt/steps/labels"


def test_has_bundled_data_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="preference_pairs"):
        Task().has_bundled_data("pairs")


def test_the_data_needs_no_agents():
    import subprocess
    import sys

    code = ("import sys, tokengym.envs.tasks as t; t.ArithmeticTask().step_labels(3); t.ArithmeticTask().preference_pairs(3); "
            "assert not [m for m in sys.modules if m.startswith('tokengym.agents')]")
    subprocess.run([sys.executable, "-c", code], check=True)

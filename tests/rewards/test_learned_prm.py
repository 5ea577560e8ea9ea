"""Learned PRM: step scores at step ends, a process reward any env takes, training on step labels."""

import json

import numpy as np
import pytest
import torch

from tokengym.agents.engine.models import load_classifier
from tokengym.envs import TokenVectorEnv
from tokengym.rewards import LearnedPRM, PRMConfig, ProcessReward, train_prm


@pytest.fixture(scope="module")
def tiny_prm():
    return load_classifier("tiny", head="token", seed=0)


def marked_examples(n, seed=0):
    """Steps of random letters; a step is bad (label 0) when it contains an 'x'."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        steps = ["".join(rng.choice(list("abcx"), size=int(rng.integers(2, 5)))) for _ in range(int(rng.integers(1, 4)))]
        out.append({"prompt": f"p{i}\n", "steps": steps, "labels": [0.0 if "x" in s else 1.0 for s in steps]})
    return out


def test_scores_sit_at_step_ends_and_ignore_later_steps(tiny_prm):
    model, tok = tiny_prm
    prm = LearnedPRM(model, tok, batch_size=2)
    ids, ends = prm.encode("12+7+30\n", ["12+7=19", "19+30=49", "A: 49"])
    assert [tok.decode([ids[e]]) for e in ends] == ["\n"] * 3
    assert tok.decode(ids[ends[0] - 7 : ends[0]]) == "12+7=19"
    full = prm(["12+7+30\n"] * 2, [["12+7=19", "19+30=49", "A: 49"], ["12+7=18"]])
    assert isinstance(prm, ProcessReward)
    assert [len(s) for s in full] == [3, 1] and all(0.0 < x < 1.0 for x in full[0])
    # causal: a step's score does not depend on what follows it, nor on the batch it is scored in
    partial = prm(["12+7+30\n"], [["12+7=19", "19+30=49"]])
    np.testing.assert_allclose(partial[0], full[0][:2], atol=1e-5)
    assert prm(["1\n"], [[]]) == [[]]


def test_threshold_gives_rule_based_scale(tiny_prm):
    model, tok = tiny_prm
    soft = LearnedPRM(model, tok)(["1+2\n"], [["1+2=3", "A: 3"]])[0]
    hard = LearnedPRM(model, tok, threshold=0.5)(["1+2\n"], [["1+2=3", "A: 3"]])[0]
    assert hard == [1.0 if p >= 0.5 else 0.0 for p in soft]


def test_two_label_head_scores_the_good_class(tiny_prm):
    _, tok = tiny_prm
    model, _ = load_classifier("tiny", head="token", num_labels=2, seed=0)
    prm = LearnedPRM(model, tok)
    ids, ends = prm.encode("1+2\n", ["1+2=3"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, ends[0]]
    assert prm(["1+2\n"], [["1+2=3"]])[0][0] == pytest.approx(torch.softmax(logits, -1)[1].item(), abs=1e-6)


def test_plugs_into_the_arithmetic_env_as_process_reward(tiny_prm):
    model, tok = tiny_prm
    prm = LearnedPRM(model, tok)
    env = TokenVectorEnv(2, "arithmetic", process_reward=prm, max_new_tokens=12)
    env.reset(seed=0)
    text = "1+2=3\nA: 3"
    for ch in text:
        env.step(torch.full((2,), tok.convert_tokens_to_ids(ch)))
    env.step(torch.full((2,), tok.eos_token_id))
    expected = prm(env.prompts, [["1+2=3", "A: 3"]] * 2)
    assert env.step_scores == expected
    ends = env.step_end.nonzero().tolist()
    assert ends == [[0, 5], [0, 10], [1, 5], [1, 10]]  # the "\n" and the episode's last action (EOS)
    torch.testing.assert_close(env.process_rewards[:, 5], torch.tensor([s[0] for s in expected]))


def test_training_learns_step_labels_and_reports_heldout_accuracy():
    model, tok = load_classifier("tiny", head="token", seed=0)
    held = marked_examples(48, seed=1)
    hist = train_prm(model, tok, marked_examples(128), PRMConfig(lr=2e-3, batch_size=16, epochs=2, eval_every=8),
                     eval_examples=held)
    evals = [h for h in hist if "eval/step_accuracy" in h]
    assert [h["step"] for h in evals] == [8, 16]
    assert evals[-1]["eval/step_accuracy"] > 0.93, evals[-1]  # 0.978 measured
    assert evals[-1]["eval/bad_step_accuracy"] > 0.9 and evals[-1]["eval/good_step_accuracy"] > 0.9
    prm = LearnedPRM(model, tok, threshold=0.5)
    scores = prm([e["prompt"] for e in held], [e["steps"] for e in held])
    agree = np.mean([s == y for e, row in zip(held, scores) for s, y in zip(row, e["labels"])])
    assert agree == pytest.approx(evals[-1]["eval/step_accuracy"])


def test_save_and_load_round_trip(tiny_prm, tmp_path):
    model, tok = tiny_prm
    prm = LearnedPRM(model, tok, delimiter="\n", threshold=0.4, name="prm")
    prm.save_pretrained(tmp_path / "prm")
    assert json.loads((tmp_path / "prm" / "learned_prm.json").read_text())["threshold"] == 0.4
    assert not any(p.suffix == ".bin" for p in (tmp_path / "prm").iterdir())
    loaded = LearnedPRM.from_pretrained(tmp_path / "prm", threshold=None)
    assert loaded.threshold is None and loaded.name == "prm"
    steps = [["1+2=3", "A: 3"]]
    assert loaded(["1+2\n"], steps)[0] == pytest.approx(LearnedPRM(model, tok)(["1+2\n"], steps)[0])


def test_bad_inputs_are_named(tiny_prm):
    model, tok = tiny_prm
    with pytest.raises(ValueError, match="one label per step"):
        train_prm(model, tok, [{"prompt": "p", "steps": ["a", "b"], "labels": [1.0]}], PRMConfig(val_fraction=0))
    with pytest.raises(ValueError, match=r"labels must be numbers in \[0, 1\]"):
        train_prm(model, tok, [{"prompt": "p", "steps": ["a"], "labels": [2.0]}], PRMConfig(val_fraction=0))
    with pytest.raises(ValueError, match="'steps' a list of strings"):
        train_prm(model, tok, [{"prompt": "p", "steps": "a", "labels": [1.0]}], PRMConfig(val_fraction=0))
    with pytest.raises(ValueError, match=r"no \['labels'\] column"):
        train_prm(model, tok, [{"prompt": "p", "steps": ["a"]}])
    with pytest.raises(ValueError, match="num_labels=3"):
        LearnedPRM(load_classifier("tiny", head="token", num_labels=3)[0], tok)
    with pytest.raises(ValueError, match="got 1 prompts for 2"):
        LearnedPRM(model, tok)(["p"], [["a"], ["b"]])
    with pytest.raises(ValueError, match="delimiter"):
        LearnedPRM(model, tok, delimiter="")


@pytest.mark.parametrize("field, value", [("lr", -1.0), ("epochs", 0), ("delimiter", ""), ("val_fraction", -0.1), ("max_grad_norm", -1)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"PRMConfig.{field}"):
        PRMConfig(**{field: value})

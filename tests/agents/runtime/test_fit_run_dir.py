"""Run folders written from Python by the offline learners: ``DPOLearner.fit(pairs, ..., run_dir=...)`` and
``SFTLearner.fit(run_dir=...)`` (or ``SFTConfig.run_dir``) write the folder ``tokengym train dpo/sft`` writes
(config.json, checkpoints, metrics.jsonl, model/), refuse a folder that is not empty, resume exactly with
``resume=True``, and ``tokengym eval/plot/sample --run`` work on it."""

import json
import os

import gymnasium as gym
import pytest
import torch

from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.algorithms.sft import SFTConfig, SFTLearner
from tokengym.agents.cli.command import main
from tokengym.agents.data.pairs import arithmetic_pairs
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import heldout_samples
from tokengym.envs.tasks import ArithmeticTask, ReverseTask

pytestmark = pytest.mark.usefixtures("one_thread")

TASK = dict(n_operands=2, digits=1, operators="+")


def policy(seed):
    return Policy(*build_preset("tiny", seed=seed))


def records(run_dir):
    """metrics.jsonl without its wall-clock fields."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith(("time/", "perf/"))}
                for line in f]


def assert_same_weights(a, b):
    for (name, p), q in zip(a.policy.model.named_parameters(), b.policy.model.parameters()):
        assert torch.equal(p, q), name


def crash_at(step):
    def callback(record):
        if record["step"] == step:
            raise KeyboardInterrupt  # a kill: no final checkpoint, no model/
    return callback


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def assert_complete(run_dir, algorithm, steps):
    """The CLI's folder: config.json (the algorithm, its config, the run's env), a checkpoint, model/, metrics."""
    assert {"config.json", "metrics.jsonl", "checkpoints", "model"} <= set(os.listdir(run_dir))
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)
    assert saved["algorithm"] == algorithm and saved["config"]["steps"] == steps
    assert os.listdir(os.path.join(run_dir, "checkpoints")) and os.path.isfile(os.path.join(run_dir, "model", "config.json"))
    rows = records(run_dir)
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]  # held-out accuracy before training
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, steps + 1))
    return saved


# ---------------------------------------------------------------------------------------------- DPO
def _dpo(seed=0, **overrides):
    return DPOLearner(policy(seed), DPOConfig(**{"batch_size": 4, "steps": 4, "lr": 3e-3, "seed": 1, **overrides}))


def _dpo_eval():
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=4, vectorization_mode="vector_entry_point", **TASK)
    return env, heldout_samples(env.task, 4)


def test_dpo_fit_writes_the_clis_folder_refuses_reuse_and_resumes_exactly(tmp_path, capsys):
    pairs = arithmetic_pairs(ArithmeticTask(**TASK), 12, seed=0)
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    want = _dpo()
    want.fit(pairs, pairs[:4], *_dpo_eval(), run_dir=full, save_every=2)
    saved = assert_complete(full, "dpo", 4)
    assert saved["run"]["env"] == "tokengym/Arithmetic-v0" and saved["run"]["env_kwargs"] == TASK
    assert saved["run"]["eval_prompts"] == 4 and saved["run"]["save_every"] == 2
    assert any("eval/rewards/accuracies" in r for r in records(full))  # the held-out pairs
    with pytest.raises(ValueError, match=f"^{full} already exists and is not empty; pass resume=True"):
        _dpo().fit(pairs, run_dir=full)

    with pytest.raises(KeyboardInterrupt):
        _dpo().fit(pairs, pairs[:4], *_dpo_eval(), callback=crash_at(3), run_dir=split, save_every=2)
    with pytest.raises(ValueError, match="different config: lr was 0.003, now 0.001"):
        _dpo(lr=1e-3).fit(pairs, pairs[:4], *_dpo_eval(), run_dir=split, resume=True)
    got = _dpo(seed=99)  # other weights (and reference): all restored from the step-2 checkpoint
    got.fit(pairs, pairs[:4], *_dpo_eval(), run_dir=split, resume=True, save_every=2)
    assert_same_weights(want, got)
    assert records(split) == records(full)

    assert "on tokengym/Arithmetic-v0" in cli(capsys, "eval", "--run", split, "--prompts", "4", "--samples", "0")
    cli(capsys, "plot", split)
    assert os.listdir(os.path.join(split, "plots"))


# ---------------------------------------------------------------------------------------------- SFT
def _sft(seed=0, **overrides):
    cfg = SFTConfig(**{"steps": 4, "batch_size": 4, "warmup_steps": 1, "eval_every": 2, "eval_prompts": 4,
                       "log_every": 1, "seed": 2, **overrides})
    return SFTLearner(policy(seed), ReverseTask(length=3), cfg)


def test_sft_fit_writes_the_clis_folder_refuses_reuse_and_resumes_exactly(tmp_path, capsys):
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    want = _sft(run_dir=full)  # SFTConfig.run_dir: the same folder as fit(run_dir=...)
    want.fit(log=lambda *a: None, save_every=2)
    saved = assert_complete(full, "sft", 4)
    assert saved["config"]["run_dir"] is None and saved["run"]["eval_prompts"] == 4
    assert saved["run"]["env"] == "tokengym/Reverse-v0" and saved["run"]["env_kwargs"]["length"] in (3, [3, 3])

    with pytest.raises(KeyboardInterrupt):
        _sft().fit(log=lambda *a: None, callback=crash_at(3), run_dir=split, save_every=2)
    got = _sft(seed=99)
    got.fit(log=lambda *a: None, run_dir=split, resume=True, save_every=2)
    assert_same_weights(want, got)
    assert records(split) == records(full) and got.hist["steps_done"] == 4
    with pytest.raises(ValueError, match="already finished"):
        _sft().fit(run_dir=split, resume=True)

    out = cli(capsys, "sample", "--run", split, "--num", "2")
    assert "env: tokengym/Reverse-v0" in out, out
    prompts = [line.split("'")[1] for line in out.splitlines() if line.startswith("[")]
    assert prompts and all(len(p) == 3 and p.isalpha() for p in prompts), prompts  # the run's task, not sums
    assert "on tokengym/Reverse-v0" in cli(capsys, "eval", "--run", split, "--prompts", "4", "--samples", "0")
    cli(capsys, "plot", split)


def test_a_folder_that_is_not_empty_is_refused_before_training(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    learner = _sft()
    for resume in (False, True):  # not a run folder: nothing to resume either
        with pytest.raises(ValueError, match=f"^{mine} already exists and is not empty"):
            learner.fit(run_dir=str(mine), resume=resume)
    assert os.listdir(mine) == ["notes.txt"] and learner.global_step == 0

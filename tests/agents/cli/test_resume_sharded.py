"""Resuming a run trained with ``--sharding fsdp2`` (its ``config.json`` says so) outside torchrun: the one line says
what to pass, ``--sharding none`` resumes it in one process (checkpoints hold the full state), and a finished run is
reported as finished, with how to train it further, before any sharding check."""

import dataclasses
import json
import os

from tokengym.agents.cli import main
from tokengym.agents.cli.train import resolve

SMALL = {"steps": 1, "prompts": 2, "group_size": 2, "eval_prompts": 0, "progress": False, "threads": 1, "save_every": 1}


def _fsdp2_run(path, processes=2):
    """A run folder as a 2-rank ``--sharding fsdp2`` GRPO run leaves it before its first checkpoint (config.json)."""
    run, cfg, _ = resolve("grpo", {}, dict(SMALL), None)
    saved = {"algorithm": "grpo", "preset": None, "run": {**dataclasses.asdict(run), "sharding": "fsdp2"},
             "config": dataclasses.asdict(cfg), "processes": processes}
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)
    return str(path)


def test_an_fsdp2_run_resumed_in_one_process_says_what_to_pass(tmp_path, capsys):
    run = _fsdp2_run(tmp_path / "r")
    assert main(["train", "grpo", "--resume", run]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --sharding" not in err, err
    assert f"{run} was trained with --sharding fsdp2 over 2 processes: resume it under `torchrun --nproc_per_node=2 " in err
    assert "or pass --sharding none to resume it in one process" in err
    assert sorted(os.listdir(run)) == ["config.json"]  # nothing written
    assert main(["train", "grpo", "--resume", run, "--sharding", "none"]) == 0  # (no checkpoint yet: from step 0)
    assert "done: model in" in capsys.readouterr().out
    assert os.path.isdir(os.path.join(run, "model"))


def test_a_finished_fsdp2_run_is_finished_before_any_sharding_check(tmp_path, capsys):
    run = _fsdp2_run(tmp_path / "r", processes=None)  # (a run from before config.json counted its processes)
    assert main(["train", "grpo", "--resume", run]) == 2
    assert "torchrun --nproc_per_node=K -m tokengym.agents.cli train grpo --resume" in capsys.readouterr().err
    os.makedirs(os.path.join(run, "model"))
    assert main(["train", "grpo", "--resume", run]) == 0
    out, err = capsys.readouterr()
    assert f"{run} already finished; nothing to resume" in out and not err
    assert f"start a new run from it: tokengym train grpo --model {run}/model --steps N" in out
    assert main(["train", "ppo", "--resume", run]) == 2  # still an algorithm's run to resume: checked first
    assert "is a 'grpo' run" in capsys.readouterr().err

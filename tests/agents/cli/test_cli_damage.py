"""Damaged checkpoints, concurrent runs and killed model writes, through the ``tokengym`` command.

(Kills during a checkpoint write and a damaged newest checkpoint, compared with uninterrupted runs, are in
``test_cli_train.py``.) With no intact checkpoint left, ``--resume`` stops with one line instead of starting over;
a second process cannot work on a locked run; runs that do not resume (rm, prm) never leave a half-written
``model/``.
"""

import json
import os
import subprocess
import sys

import pytest
from tokengym.agents.cli import main

GRPO = ["--steps", "4", "--prompts", "2", "--group-size", "4", "--save-every", "2", "--eval-prompts", "8",
        "--threads", "1", "--progress", "false"]


def cli(args, **env):
    return subprocess.run([sys.executable, "-m", "tokengym.agents.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=600)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in rows]


def test_every_checkpoint_damaged_is_one_line_not_a_fresh_start(tmp_path, capsys):
    args = ["train", "grpo", *GRPO, "--runs-dir", str(tmp_path), "--name", "g"]
    r = cli(args, TOKENGYM_SIGKILL_AFTER_STEP="3")
    assert r.returncode == -9
    state = tmp_path / "g" / "checkpoints" / "step-00000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # cut short
    before = (tmp_path / "g" / "metrics.jsonl").read_text()
    assert main(["train", "grpo", "--resume", str(tmp_path / "g"), "--progress", "false"]) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and "trainer_state.pt" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "g" / "metrics.jsonl").read_text() == before  # nothing discarded


def test_a_locked_run_refuses_a_second_resume(tmp_path, capsys):
    args = ["train", "grpo", "--steps", "1", "--prompts", "1", "--group-size", "2", "--eval-prompts", "0",
            "--progress", "false", "--runs-dir", str(tmp_path), "--name", "r"]
    r = cli(args, TOKENGYM_SIGKILL_AFTER_STEP="1")
    assert r.returncode == -9
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from tokengym.agents.runtime.runs import RunLock; "
                               "RunLock(sys.argv[1], create=False).acquire(); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "r")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", "grpo", "--resume", str(tmp_path / "r"), "--progress", "false"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another tokengym process (pid {holder.pid})" in err
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", "grpo", "--resume", str(tmp_path / "r"), "--progress", "false"]) == 0  # free again


def test_killed_before_the_first_checkpoint_logs_the_first_evaluation_once(tmp_path):
    args = ["train", "grpo", "--steps", "2", "--prompts", "1", "--group-size", "2", "--eval-prompts", "8",
            "--save-every", "5", "--progress", "false", "--runs-dir", str(tmp_path), "--name", "r"]
    assert cli(args, TOKENGYM_SIGKILL_AFTER_STEP="1").returncode == -9
    assert cli(["train", "grpo", "--resume", str(tmp_path / "r"), "--progress", "false"]).returncode == 0
    steps = [r["step"] for r in metrics(str(tmp_path / "r"))]
    assert steps.count(0) == 1 and steps == sorted(steps), steps


@pytest.mark.parametrize("algo, args", [("rm", ["--num-pairs", "64", "--eval-prompts", "0"]),
                                        ("prm", ["--num-pairs", "64", "--eval-prompts", "0"])])
def test_kill_while_writing_the_model_leaves_no_half_made_model(tmp_path, capsys, algo, args):
    r = cli(["train", algo, *args, "--progress", "false", "--threads", "1", "--runs-dir", str(tmp_path), "--name", algo],
            TOKENGYM_SIGKILL_DURING_WRITE="model")
    assert r.returncode == -9, r.stderr[-2000:]
    run = tmp_path / algo
    assert not (run / "model").exists()
    assert any(n.startswith("model.tmp-") for n in os.listdir(run))  # the kill did hit the write
    flag = "--reward-model" if algo == "rm" else "--prm-model"
    code = main(["train", "grpo", "--steps", "1", "--eval-prompts", "0", flag, str(run / "model"), "--runs-dir",
                 str(tmp_path), "--name", "next", "--advantage", "process"])
    assert code == 2 and "is not a folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run folder: config.json and model/ as tokengym train writes them (1 step)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", "grpo", "--steps", "1", "--prompts", "2", "--group-size", "2", "--eval-prompts", "0",
                 "--threads", "1", "--progress", "false", "--runs-dir", str(root), "--name", "done"]) == 0
    return root / "done"


@pytest.mark.parametrize("damage, says", [
    (lambda run: (run / "config.json").write_text("{bad"), r"cannot read .*config\.json: Expecting property name"),
    (lambda run: (run / "config.json").write_text('{"algorithm": "grpo"}'), r"config\.json is damaged: it needs"),
    (lambda run: (run / "config.json").write_text("[1, 2]"), r"config\.json is damaged: it needs"),
    (lambda run: (run / "model" / "model.safetensors").write_bytes(
        (run / "model" / "model.safetensors").read_bytes()[:1000]), r"cannot load model .*model'"),
])
def test_eval_of_a_damaged_run_folder_is_one_line(finished_run, tmp_path, capsys, damage, says):
    import re
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    damage(run)
    assert main(["eval", "--run", str(run), "--prompts", "4", "--threads", "1"]) == 2  # no busy-machine warning
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(says, err), err


def _edit_config(run, change):
    import json

    cfg = json.loads((run / "config.json").read_text())
    change(cfg)
    (run / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, says", [
    (lambda c: c["config"].update(steps="five"), r"config\.json: steps expects int, got 'five' \(the file is damaged"),
    (lambda c: c["run"].update(eval_prompts="x"), r"config\.json: eval_prompts expects int, got 'x' \(the file is damaged"),
    (lambda c: c.update(algorithm="nope"), r"config\.json names no algorithm tokengym knows \('nope'; known: grpo"),
])
def test_resume_of_a_damaged_config_names_the_file(finished_run, tmp_path, capsys, change, says):
    """A config.json with a wrong type or an unknown algorithm: one line naming the file and saying it is damaged
    (they used to read as another tokengym version's config, or as a run of an algorithm named 'nope')."""
    import re
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "model")  # an unfinished run, so that it can be resumed
    _edit_config(run, change)
    assert main(["train", "grpo", "--resume", str(run), "--progress", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(says, err), err


def test_eval_of_a_training_run_passes_over_a_checkpoint_rotated_away_while_it_loads(tmp_path, capsys, monkeypatch):
    """``eval --run`` on a run still training: the newest checkpoint it found is removed (the trainer keeps only its
    newest few) before its weights are read; eval takes the next newest instead of a FileNotFoundError traceback."""
    import shutil

    from tokengym.agents.runtime import runs as R

    assert main(["train", "grpo", "--steps", "2", "--prompts", "1", "--group-size", "2", "--eval-prompts", "0",
                 "--save-every", "1", "--threads", "1", "--progress", "false", "--runs-dir", str(tmp_path),
                 "--name", "r"]) == 0
    run = tmp_path / "r"
    shutil.rmtree(run / "model")  # as if still training
    real, calls = R.latest_checkpoint, []

    def rotating(run_dir):
        path = real(run_dir)
        calls.append(path)
        if len(calls) == 2:  # found again to load it, then rotated away by the (simulated) trainer
            shutil.rmtree(path)
            (run / "checkpoints" / "latest").write_text("step-00000001")
        return path

    monkeypatch.setattr(R, "latest_checkpoint", rotating)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--prompts", "4", "--samples", "0"]) == 0
    assert calls[1].endswith("step-00000002") and calls[2].endswith("step-00000001")
    assert "step-00000001 on tokengym/Arithmetic-v0" in capsys.readouterr().out

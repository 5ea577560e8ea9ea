"""First-hour rough edges of the command line (issue 52): ``envs --import``, ``--threads`` for ``eval`` and
``sample``, a short config line from ``train`` (the full one behind ``--verbose``), SFT's progress and stop lines."""

import json
import sys
import textwrap

import pytest

from tokengym.agents.cli.command import main
from tokengym.envs.tasks import registry

SORTING = textwrap.dedent('''
    from tokengym.envs import Task, register_task


    @register_task
    class SortingTask(Task):
        """Sort two letters."""
        max_prompt_chars, default_max_new_tokens = 4, 4

        def sample(self, rng):
            w = "".join(rng.choice(list("ab"), 2))
            return {"prompt": w + "\\n", "solution": "".join(sorted(w))}

        def reward(self):
            return lambda prompts, completions, solution, **_: [float(c == s) for c, s in zip(completions, solution)]
''')


@pytest.fixture
def sorting_module(tmp_path, monkeypatch):
    """``sorting_fh.py`` in the current folder (it registers ``tokengym/Sorting-v0`` when imported); undone after."""
    (tmp_path / "sorting_fh.py").write_text(SORTING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield "sorting_fh"
    sys.modules.pop("sorting_fh", None)
    if "sorting" in registry.TASK_SPECS:
        registry.unregister_task("sorting")


def test_envs_import_lists_the_modules_envs(sorting_module, capsys):
    assert main(["envs"]) == 0
    assert "tokengym/Sorting-v0" not in capsys.readouterr().out
    assert main(["envs", "--import", sorting_module, "--import", "json"]) == 0
    out = capsys.readouterr().out
    assert "tokengym/Sorting-v0  Sort two letters." in out and "tokengym/Arithmetic-v0" in out


def test_envs_import_of_a_missing_module_is_one_line(capsys):
    assert main(["envs", "--import", "no_such_module_fh"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokengym: error: --import: cannot import module 'no_such_module_fh'") and err.count("\n") == 1


EVAL = ["eval", "--model", "tiny-arithmetic", "--prompts", "4", "--samples", "0"]
SAMPLE = ["sample", "--num", "2", "--policy", "reference"]


@pytest.mark.parametrize("argv", [EVAL, SAMPLE], ids=["eval", "sample"])
def test_eval_and_sample_take_threads_and_warn_on_a_busy_machine_without_it(argv, monkeypatch, capsys):
    import torch

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (4.0, 4.0, 4.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert main([*argv, "--threads", "1"]) == 0
    assert threads == [1] and "busy" not in capsys.readouterr().err
    assert main(argv) == 0  # torch's default on a busy machine: train's warning, one line
    err = capsys.readouterr().err
    assert threads == [1] and err.count("tokengym: warning: the machine is busy (load 4.0 on 2 cores)") == 1
    assert main([*argv, "--threads", "0"]) == 2
    assert capsys.readouterr().err == "tokengym: error: --threads must be at least 1, got 0\n"


QUICK = ["--prompts", "1", "--group-size", "2", "--eval-prompts", "0", "--progress", "false", "--threads", "1"]


def test_train_prints_a_short_config_line_and_the_full_one_with_verbose(tmp_path, capsys):
    assert main(["train", "grpo", "--steps", "1", "--lr", "2e-4", *QUICK, "--runs-dir", str(tmp_path), "--name", "a"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "GRPOConfig" in ln)
    assert line == f"  GRPOConfig: lr=0.0002, steps=1 (the rest default; full config in {tmp_path / 'a'}/config.json)"
    with open(tmp_path / "a" / "config.json") as f:  # where the full config is
        saved = json.load(f)["config"]
    assert saved["lr"] == 2e-4 and saved["steps"] == 1 and "clip_eps" in saved and "scale_rewards" in saved
    assert main(["train", "grpo", "--steps", "1", *QUICK, "--runs-dir", str(tmp_path), "--name", "b", "--verbose"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "GRPOConfig" in ln)
    assert line.startswith("  GRPOConfig: lr=0.0001, ") and all(f"{k}=" in line for k in saved)


def test_sft_shows_progress_with_eval_accuracy_and_where_stop_at_accuracy_stopped(tmp_path, capsys, monkeypatch):
    """Held-out accuracy 25% before training, 50% at step 4, 75% at step 8 (the evaluation is stubbed): the progress
    lines show the latest accuracy (from step 0 on) and the step's loss, and a line says where the run stopped."""
    import tokengym.agents.algorithms.sft as sft

    accuracy = iter([0.25, 0.5, 0.75])
    monkeypatch.setattr(sft, "evaluate", lambda *a, **k: {"accuracy": next(accuracy), "mean_reward": 0.0,
                                                          "mean_length": 3.0, "truncated": 0.0})
    assert main(["train", "sft", "--steps", "20", "--eval-every", "4", "--batch-size", "4", "--eval-prompts", "8",
                 "--stop-at-accuracy", "0.7", "--threads", "1", "--runs-dir", str(tmp_path), "--name", "s"]) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("s step ")]
    assert [ln.split(" loss=")[0] for ln in lines] == ["s step 2/20 eval_acc=0.25", "s step 4/20 eval_acc=0.5",
                                                        "s step 6/20 eval_acc=0.5", "s step 8/20 eval_acc=0.75"], err
    assert all(float(ln.split(" loss=")[1]) > 0 for ln in lines)
    assert "stopped at step 8 of 20: held-out greedy accuracy 75.0% reached stop_at_accuracy 70.0%" in out
    assert "held-out greedy accuracy: 25.0% -> 75.0%" in out


def test_a_command_does_not_import_scikit_learn_and_main_from_python_leaves_transformers_alone(tmp_path):
    """transformers imports scikit-learn at start-up wherever it is installed (1.2 s of a command's start); a command
    that loads a model skips it, and ``main([...])`` called from a script changes nothing in transformers."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed here: there is nothing to skip")
    probe = ("import sys; sys.argv = ['tokengym', 'eval', '--model', 'tiny-arithmetic', '--prompts', '2', "
             "'--samples', '0']; from tokengym.agents.cli.command import main; code = main(); "
             "print('SKLEARN', 'sklearn' in sys.modules, code)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "SKLEARN False 0" in out.stdout, out.stdout[-1000:] + out.stderr[-2000:]
    import transformers.utils

    before = transformers.utils.is_sklearn_available
    assert main(["eval", "--model", "tiny-arithmetic", "--prompts", "2", "--samples", "0"]) == 0
    assert transformers.utils.is_sklearn_available is before

"""``tokengym train``: runs/ layout, SIGKILL + --resume reproduces an uninterrupted run, bad input exits 2."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tokengym.agents import Policy
from tokengym.agents.runtime import runs as R
from tokengym.agents.cli import main

ALGOS = {
    "grpo": ["--steps", "5", "--prompts", "2", "--group-size", "4", "--lr", "1e-3", "--mu", "2", "--minibatches", "2"],
    "ppo": ["--steps", "5", "--prompts", "4", "--mu", "2", "--minibatches", "2", "--beta", "0.05"],
    "dpo": ["--num-pairs", "40", "--batch-size", "8", "--epochs", "2", "--lr", "1e-3"],  # 5 steps/epoch: resumes mid-epoch 1
    # a log-every window (2) that the checkpoint at step 2 closes, an eval (every 3 steps) after the resume
    "sft": ["--steps", "5", "--batch-size", "8", "--warmup-steps", "1", "--log-every", "1", "--eval-every", "3"],
}
COMMON = ["--save-every", "2", "--eval-prompts", "8", "--threads", "1", "--progress", "false", "--seed", "3"]


def cli(args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "tokengym.agents.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """``{algo: run_dir}`` of uninterrupted runs, to compare interrupted ones with."""
    root = tmp_path_factory.mktemp("full")
    for algo in ALGOS:
        r = cli(["train", algo, *ALGOS[algo], *COMMON, "--runs-dir", str(root), "--name", algo])
        assert r.returncode == 0, r.stderr[-2000:]
    return {algo: str(root / algo) for algo in ALGOS}


def same_model(a, b):
    x, y = (load_file(os.path.join(d, "model", "model.safetensors")) for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, full, algo):
    args = ["train", algo, *ALGOS[algo], *COMMON, "--runs-dir", str(tmp_path)]
    killed = cli([*args, "--name", "killed"], {"TOKENGYM_SIGKILL_AFTER_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    k_dir = os.path.join(str(tmp_path), "killed")
    assert open(os.path.join(k_dir, "checkpoints", "latest")).read().strip() == "step-00000002"
    assert max(r["step"] for r in metrics(k_dir)) == 3  # step 3 was logged after the checkpoint: it must be redone
    assert not os.path.exists(os.path.join(k_dir, "model"))
    resumed = cli(["train", algo, "--resume", k_dir, "--progress", "false"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {k_dir} at step 2 of" in resumed.stdout
    assert metrics(k_dir) == metrics(full[algo])
    assert same_model(k_dir, full[algo])
    again = cli(["train", algo, "--resume", k_dir])  # a finished run: nothing to do, nothing overwritten
    assert again.returncode == 0 and "already finished" in again.stdout


@pytest.mark.parametrize("algo", ["dpo"])  # GRPO and PPO write checkpoints through the same save_checkpoint
def test_kill_during_a_checkpoint_write_then_resume_equals_uninterrupted(tmp_path, full, algo):
    """The kill hits the first checkpoint mid-write: nothing half-written counts as a checkpoint, the resume
    removes the leftover and redoes the run from the start."""
    run = os.path.join(str(tmp_path), algo)
    killed = cli(["train", algo, *ALGOS[algo], *COMMON, "--runs-dir", str(tmp_path), "--name", algo],
                 {"TOKENGYM_SIGKILL_DURING_WRITE": "checkpoint"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [n for n in os.listdir(os.path.join(run, "checkpoints")) if ".tmp" in n]  # the kill hit the write
    assert R.latest_intact_checkpoint(run) == (None, [])
    resumed = cli(["train", algo, "--resume", run, "--progress", "false"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "starting it again from step 0" in resumed.stdout
    assert [n for n in os.listdir(os.path.join(run, "checkpoints")) if ".tmp" in n] == []
    assert metrics(run) == metrics(full[algo])
    assert same_model(run, full[algo])


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, full):
    run = os.path.join(str(tmp_path), "grpo")
    killed = cli(["train", "grpo", *ALGOS["grpo"], *COMMON, "--runs-dir", str(tmp_path), "--name", "grpo"],
                 {"TOKENGYM_SIGKILL_AFTER_STEP": "4"})
    assert killed.returncode == -9
    weights = os.path.join(run, "checkpoints", "step-00000004", "policy.safetensors")
    with open(weights, "r+b") as f:  # flip one byte in the middle of the newest checkpoint's weights
        f.seek(os.path.getsize(weights) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = cli(["train", "grpo", "--resume", run, "--progress", "false"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-00000004 is damaged (policy.safetensors: checksum mismatch)" in resumed.stderr
    assert f"resuming {run} at step 2 of" in resumed.stdout
    assert metrics(run) == metrics(full["grpo"])
    assert same_model(run, full["grpo"])


@pytest.fixture
def finished_run(tmp_path):
    code = main(["train", "grpo", "--steps", "1", "--prompts", "1", "--group-size", "2", "--eval-prompts", "0",
                 "--progress", "false", "--runs-dir", str(tmp_path), "--name", "r"])
    assert code == 0
    return os.path.join(str(tmp_path), "r")


@pytest.mark.parametrize("args, message", [
    (["--env", "tokengym/Nope-v0"], "unknown env id 'tokengym/Nope-v0'"),
    (["--model", "huge"], "cannot load model 'huge'"),
    (["--lrr", "1e-3"], "did you mean --lr?"),
    (["--lr", "fast"], "lr expects float, got 'fast'"),
    (["--advantage", "nope"], "advantage"),
    (["--resume", "/nonexistent/run"], "is not a run folder"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    code = main(["train", "grpo", "--runs-dir", str(tmp_path), "--name", "x", "--progress", "false", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err
    assert not os.path.exists(os.path.join(str(tmp_path), "x", "checkpoints"))


def test_config_file_key_typo_suggests(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('lr = 1e-3\nclip_epss = 0.1\n')
    assert main(["train", "grpo", "--config", str(cfg), "--runs-dir", str(tmp_path)]) == 2
    assert "did you mean 'clip_eps'?" in capsys.readouterr().err


def test_resume_refuses_a_different_config_and_existing_names(finished_run, capsys, tmp_path):
    import shutil

    before = open(os.path.join(finished_run, "config.json")).read()
    unfinished = str(tmp_path / "unfinished")  # the same run before its model/ was written
    shutil.copytree(finished_run, unfinished, ignore=shutil.ignore_patterns("model", "*.lock"))
    assert main(["train", "grpo", "--resume", unfinished, "--lr", "0.5"]) == 2
    assert "lr was 0.0001, now 0.5" in capsys.readouterr().err
    assert main(["train", "grpo", "--resume", finished_run, "--lr", "0.5"]) == 0  # finished comes first: nothing to do
    assert "already finished" in capsys.readouterr().out
    assert main(["train", "dpo", "--resume", finished_run]) == 2
    assert "is a 'grpo' run" in capsys.readouterr().err
    runs, name = os.path.split(finished_run)
    assert main(["train", "grpo", "--runs-dir", runs, "--name", name]) == 2
    assert "already exists" in capsys.readouterr().err
    assert open(os.path.join(finished_run, "config.json")).read() == before


def test_run_folder_layout_and_config_roundtrip(finished_run):
    cfg = json.load(open(os.path.join(finished_run, "config.json")))
    assert cfg["algorithm"] == "grpo" and cfg["config"]["steps"] == 1 and cfg["run"]["model"] == "tiny-arithmetic"
    assert os.path.isfile(os.path.join(finished_run, "model", "model.safetensors"))
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(finished_run))
    assert metrics(finished_run)[-1]["step"] == 1


def test_eval_table_and_plot(finished_run, capsys):
    assert main(["eval", "--run", finished_run, "--prompts", "8", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "greedy" in out and "sampled x1" in out and "accuracy" in out
    assert main(["plot", finished_run]) == 0
    written = capsys.readouterr().out.split()
    from tokengym.agents.cli.plot import PANELS

    # every panel the README promises, from a GRPO run's metrics
    assert sorted(os.path.basename(p) for p in written) == sorted(f"{k}.png" for k in PANELS)
    assert {"reward", "accuracy", "kl", "loss", "entropy", "clip_fraction", "length", "throughput", "time"} <= set(PANELS)
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["eval"]) == 2 and "pass --run" in capsys.readouterr().err


def test_rm_and_prm_runs_plug_into_grpo(tmp_path, capsys):
    base = ["--eval-prompts", "16", "--progress", "false", "--runs-dir", str(tmp_path)]
    assert main(["train", "rm", "--num-pairs", "96", "--name", "rm", *base]) == 0
    assert "held-out pairwise accuracy" in capsys.readouterr().out
    assert main(["train", "prm", "--num-pairs", "48", "--name", "prm", *base]) == 0
    assert "held-out step accuracy" in capsys.readouterr().out
    assert main(["train", "grpo", "--steps", "1", "--prompts", "2", "--group-size", "2", "--advantage", "process",
                 "--reward-model", str(tmp_path / "rm" / "model"), "--prm-model", str(tmp_path / "prm" / "model"),
                 "--name", "g", *base]) == 0
    rows = metrics(str(tmp_path / "g"))
    assert rows[1]["step"] == 1 and "reward/mean" in rows[1]
    assert main(["train", "grpo", "--reward-model", str(tmp_path / "nope"), "--name", "h", *base]) == 2
    assert "train one with `tokengym train rm`" in capsys.readouterr().err


def test_likelihood_rm_from_on_policy_pairs_plugs_into_ppo(tmp_path, capsys):
    """``train rm --rm-kind likelihood --pairs on-policy`` (the RLHF recipe of test_rlhf_pipeline) saves a causal
    LM that ``train ppo --reward-model`` loads as a LikelihoodRewardModel scored without a reference, normalised
    so that the starting model's samples score mean 0, std 1."""
    from tokengym.rewards import LikelihoodRewardModel

    base = ["--eval-prompts", "16", "--progress", "false", "--runs-dir", str(tmp_path)]
    assert main(["train", "rm", "--rm-kind", "likelihood", "--pairs", "on-policy", "--num-pairs", "48",
                 "--name", "lrm", *base]) == 0
    assert "held-out pairwise accuracy" in capsys.readouterr().out
    saved = tmp_path / "lrm" / "model"
    assert (saved / "likelihood_reward_model.json").is_file()
    rm = LikelihoodRewardModel.from_pretrained(str(saved))
    assert rm.reference is None and rm.beta == 0.5
    assert not torch.equal(rm.model.lm_head.weight, Policy.from_pretrained("tiny-arithmetic").model.lm_head.weight)
    assert main(["train", "ppo", "--steps", "1", "--prompts", "4", "--reward-model", str(saved), "--name", "p", *base]) == 0
    score = metrics(str(tmp_path / "p"))[1]["objective/score"]
    assert rm.scale != 1.0 and rm.shift < 0  # normalised on the starting model's samples (raw: sums of log-probs)
    assert math.isfinite(score) and abs(score) < 1.5  # the first rollout comes from that model: mean ~0, std 1
    assert main(["train", "rm", "--rm-kind", "head", "--name", "bad", *base]) == 2
    assert "rm_kind must be 'sequence' or 'likelihood'" in capsys.readouterr().err
    assert main(["train", "rm", "--pairs", "on-policy", "--env", "tokengym/Reverse-v0", "--name", "bad2", *base]) == 2
    assert "needs a task with a verifier" in capsys.readouterr().err


def test_a_preset_run_prints_its_resolved_config_and_saves_it(tmp_path, capsys):
    code = main(["train", "grpo", "--preset", "dapo", "--steps", "1", "--prompts", "2", "--group-size", "4",
                 "--eval-prompts", "0", "--runs-dir", str(tmp_path), "--name", "dapo", "--progress", "false"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(ln for ln in out.splitlines() if "GRPOConfig (preset dapo):" in ln)
    assert "dynamic_sampling=True" in line and "clip_eps_high=0.28" in line and "aggregation=token-mean" in line
    with open(tmp_path / "dapo" / "config.json") as f:
        saved = json.load(f)
    assert saved["preset"] == "dapo" and saved["config"]["overlong_buffer"] == 0.2


SHORT = {
    "grpo": ["--steps", "1", "--prompts", "1", "--group-size", "2"],
    "rloo": ["--steps", "1", "--prompts", "1", "--group-size", "2"],
    "reinforce-pp": ["--steps", "1", "--prompts", "1", "--group-size", "2"],
    "ppo": ["--steps", "1", "--prompts", "2"],
    "dpo": ["--num-pairs", "16", "--batch-size", "8", "--epochs", "1"],
    "spin": ["--steps", "1"],
    "sft": ["--steps", "1", "--batch-size", "4"],
    "rm": ["--num-pairs", "16"],
    "prm": ["--num-pairs", "16"],
}


@pytest.mark.parametrize("evaluate", [True, False], ids=["eval", "no-eval"])
@pytest.mark.parametrize("algo, extra", [*((a, []) for a in SHORT), ("grpo", ["--async-mode", "one-step"]),
                                         ("ppo", ["--async-mode", "one-step"])],
                         ids=[*SHORT, "grpo-async", "ppo-async"])
def test_every_algorithm_ends_with_its_summary_with_and_without_evaluation(tmp_path, capsys, algo, extra, evaluate):
    """Each algorithm, sync and async, with and without held-out evaluation: the usual summary ("done", the held-out
    score when there is an evaluation, none without), exit 0 (an async run without one used to end in a KeyError;
    sft refused --eval-prompts 0, which --help documents as no evaluation)."""
    args = ["train", algo, *SHORT[algo], *extra, "--eval-prompts", "4" if evaluate else "0", "--threads", "1",
            "--progress", "false", "--runs-dir", str(tmp_path), "--name", "r"]
    code = main(args)
    out = capsys.readouterr().out
    assert code == 0 and f"done: model in {tmp_path / 'r' / 'model'}" in out, out[-2000:]
    if algo not in ("rm", "prm"):  # (their held-out accuracy is on validation pairs, not --eval-prompts)
        assert ("held-out greedy accuracy" in out) == evaluate, out[-2000:]
    if extra:
        assert "rollout staleness (updates behind)" in out, out[-2000:]

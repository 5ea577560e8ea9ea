"""``tokengym envs`` and ``tokengym sample``: output and errors."""

import re

import pytest

from tokengym.agents.cli import main


def test_envs_lists_every_registered_id(capsys):
    from tokengym.envs import ENV_IDS

    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert all(env_id in out for env_id in ENV_IDS)


def test_sample_reference_scores_one_and_random_scores_low(capsys):
    assert main(["sample", "--num", "4", "--policy", "reference", "random"]) == 0
    out = capsys.readouterr().out
    means = [float(m) for m in re.findall(r"mean outcome reward: ([0-9.]+)", out)]
    assert means[0] == 1.0 and means[1] < 0.5
    assert "steps=[1.0" in out  # rule-based PRM step scores are printed


def test_sample_from_a_model_prints_its_completions(capsys):
    assert main(["sample", "--model", "tiny-arithmetic", "--greedy", "--num", "8"]) == 0
    out = capsys.readouterr().out
    assert "policy: model (tiny-arithmetic, greedy)" in out
    assert len(re.findall(r"^\[\d\] ", out, flags=re.M)) == 8
    assert float(re.search(r"mean outcome reward: ([0-9.]+)", out).group(1)) > 0.2  # the warm start solves some


def test_sample_on_the_tool_env_replays_the_agents_turns_of_the_reference(capsys):
    assert main(["sample", "--env", "tokengym/Calculator-v0", "--num", "4", "--policy", "reference"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"mean outcome reward: ([0-9.]+)", out).group(1)) == 1.0
    assert "<calc>63+51</calc>=114 | <calc>114+26</calc>=140 | A: 140" in out  # the env wrote each '=value' line


def test_sample_errors_are_one_line(capsys):
    assert main(["sample", "--env", "tokengym/Nope-v0"]) == 2
    assert "unknown env id" in capsys.readouterr().err
    assert main(["sample", "--policy", "model"]) == 2
    assert "needs --model" in capsys.readouterr().err


def test_ppo_and_grpo_default_to_64_episodes_per_step_and_an_explicit_prompts_wins():
    from tokengym.agents.cli import runner as T

    # what build_grpo / build_ppo build their env from: (num_envs, group_size)
    assert T.rollout_batch(T.RunConfig(), "grpo") == (64, 8)
    assert T.rollout_batch(T.RunConfig(), "ppo") == (64, 1)
    assert T.rollout_batch(T.RunConfig(prompts=4), "ppo") == (4, 1)
    assert T.rollout_batch(T.RunConfig(prompts=4, group_size=2), "grpo") == (8, 2)


def test_a_busy_machine_gets_a_threads_warning(monkeypatch):
    import warnings

    from tokengym.agents.cli.train import warn_if_busy
    from tokengym.rewards.common import TokengymWarning

    monkeypatch.setattr("os.getloadavg", lambda: (4.0, 4.0, 4.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.warns(TokengymWarning, match=r"busy \(load 4.0 on 2 cores\) and torch will use 2 threads: --threads 1"):
        warn_if_busy(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_busy(1)  # one thread: nothing to say
        monkeypatch.setattr("os.getloadavg", lambda: (0.5, 0.5, 0.5))
        warn_if_busy(2)  # an idle machine: nothing to say

"""In-training pass@k / maj@k / mean@k (``eval_k``): logged at every held-out evaluation of a run (step 0 included),
equal to the pure functions on that evaluation's samples, and drawn from a stream of their own, so that a run with
them trains, and logs, exactly what the same run without them does."""

import json
import os

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.cli import main
from tokengym.agents.engine.eval_metrics import maj_at_k, mean_at_k, pass_at_k
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import heldout_samples

pytestmark = pytest.mark.usefixtures("one_thread")

K, N, PROMPTS = 2, 3, 6
AT_K = {f"eval/pass@{K}", f"eval/maj@{K}", f"eval/mean@{K}"}


def envs():
    """The rollout env (2 prompts x 2) and the held-out env and prompts of tiny-arithmetic's task."""
    def vec(n, g):
        return gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=g)
    eval_env = vec(PROMPTS, 1)
    return vec(4, 2), eval_env, heldout_samples(eval_env.task, PROMPTS)


def agent(**at_k):
    return GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(steps=2, eval_every=1, seed=3, **at_k))


def records(run_dir):
    """metrics.jsonl without its wall-clock fields."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith(("time/", "perf/"))}
                for line in f]


def by_hand(result):
    """The three metrics of an ``evaluate_at_k`` result recomputed from its per-prompt samples."""
    rows = result["per_prompt"]
    assert len(rows) == PROMPTS and all(len(r["answers"]) == len(r["correct"]) == N for r in rows)
    return {f"eval/pass@{K}": sum(pass_at_k(N, sum(r["correct"]), K) for r in rows) / PROMPTS,
            f"eval/maj@{K}": sum(maj_at_k(r["answers"], r["correct"], K) for r in rows) / PROMPTS,
            f"eval/mean@{K}": sum(mean_at_k(r["correct"], K) for r in rows) / PROMPTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 2-step run without and with eval_k (its folder, its agent, its held-out env and prompts)."""
    out = {}
    for name, at_k in (("plain", {}), ("at_k", {"eval_k": K, "eval_n": N})):
        env, eval_env, samples = envs()
        a = agent(**at_k)
        run_dir = str(tmp_path_factory.mktemp(name) / "run")
        a.learn(env, eval_env, samples, run_dir=run_dir)
        out[name] = (records(run_dir), a, eval_env, samples)
    return out


def test_a_run_with_eval_k_trains_and_logs_what_the_run_without_it_does(runs):
    plain, at_k = runs["plain"][0], runs["at_k"][0]
    assert [r["step"] for r in at_k] == [0, 1, 2] and not any("@" in k for r in plain for k in r)  # default: none
    for p, a in zip(plain, at_k, strict=True):
        assert set(a) == set(p) | AT_K  # the three metrics at every evaluation, every other key unchanged
        assert {k: v for k, v in a.items() if k not in AT_K} == p  # same rollouts, updates and greedy accuracy
    for (_, p), (_, q) in zip(runs["plain"][1].policy.model.named_parameters(), runs["at_k"][1].policy.model.named_parameters()):
        assert torch.equal(p, q)


def test_the_logged_values_are_the_pure_functions_of_that_evaluations_samples(runs):
    logged, trained, eval_env, samples = runs["at_k"]
    start = agent(eval_k=K, eval_n=N)  # the run's weights at step 0, and after its last step
    for record, a in ((logged[0], start), (logged[-1], trained)):
        a.policy.seed(12345)  # wherever the training stream stands, the evaluation draws from its own seed
        state = a.policy.generator.get_state()
        result = a.evaluate_at_k(eval_env, samples)  # the same seed as the run's evaluation: the same samples
        assert torch.equal(a.policy.generator.get_state(), state)  # the training stream is left where it was
        expect = by_hand(result)
        assert {k: record[k] for k in AT_K} == pytest.approx(expect, abs=1e-12)
        assert all(0.0 <= v <= 1.0 for v in expect.values())
        assert expect[f"eval/pass@{K}"] >= expect[f"eval/mean@{K}"]
    flat = [c for r in result["per_prompt"] for c in r["correct"]]
    assert 0 < sum(flat) < len(flat)  # some right, some wrong: the metrics are not trivially 0 or 1


def test_the_flags_reach_the_run_and_bad_values_are_one_line(tmp_path, capsys):
    base = ["train", "grpo", "--model", "tiny-arithmetic", "--steps", "1", "--prompts", "2", "--group-size", "2",
            "--eval-prompts", "3", "--progress", "false", "--threads", "1", "--report-to", "none",
            "--runs-dir", str(tmp_path)]
    assert main([*base, "--name", "ok", "--eval-k", "2"]) == 0  # eval_n: eval_k by default
    capsys.readouterr()
    logged = records(tmp_path / "ok")
    evals = [r["step"] for r in logged if "eval/accuracy" in r]  # eval_every 10: before the run and at its end
    assert evals == [0, 1] and all((AT_K <= set(r)) == ("eval/accuracy" in r) for r in logged)
    for args, message in ((["--eval-k", "-1"], "GRPOConfig.eval_k has an invalid value: -1"),
                          (["--eval-k", "3", "--eval-n", "2"], "eval_n=2 needs 1 <= eval_k <= eval_n"),
                          (["--eval-n", "4"], "eval_n=4 needs 1 <= eval_k <= eval_n"),
                          (["--eval-k", "2", "--eval-prompts", "0"], "eval_prompts=0 turns held-out evaluation off")):
        assert main([*base, "--name", "bad", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert not os.path.exists(tmp_path / "bad")

"""A user's own env end to end: ``--env module:Class`` / ``module:EnvId-v0`` / ``--import`` / entry points on the
command line (bad ones one line, exit 2, no folder), the run recording them for ``sample --run`` and ``eval --run``,
and run folders written from Python by ``learn(run_dir=...)`` (refused when not empty, resumed exactly)."""

import json
import os
import sys
import textwrap

import gymnasium as gym
import pytest
import torch

from tokengym.agents import GRPOAgent, GRPOConfig, Policy
from tokengym.agents.cli.command import main
from tokengym.envs.tasks import registry

TASK_FILE = textwrap.dedent('''
    import gymnasium
    from tokengym.envs import Task, TokenVectorEnv


    class Shout(Task):
        """Say the word in capitals."""
        name, max_prompt_chars, default_max_new_tokens = "shout", 4, 4

        def sample(self, rng):
            w = "".join(rng.choice(list("ab"), 2))
            return {"prompt": w + "\\n", "solution": w.upper(), "answer": w.upper()}

        def reward(self):
            return lambda prompts, completions, answer, **_: [float(c == a) for c, a in zip(completions, answer)]


    NOT_A_TASK = 3
    gymnasium.register(id="ShoutById-v0", entry_point="tokengym.envs.token_env:TokenEnv",
                       vector_entry_point="tokengym.envs.vector_env:TokenVectorEnv", kwargs={"task": Shout()})
''')


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty folder holding the user's ``shouting.py``, as the current folder; its module and ids undone after."""
    (tmp_path / "shouting.py").write_text(TASK_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("shouting", None)
    for name in [n for n in registry.TASK_SPECS if n.startswith("shouting:")]:
        registry.unregister_task(name)
    gym.registry.pop("ShoutById-v0", None)


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("env, extra, message", [
    ("nomodule:Shout", [], "env 'nomodule:Shout': cannot import module 'nomodule'"),
    ("shouting:Whisper", [], "module 'shouting' has no Task class 'Whisper' and registers no env id 'Whisper'"),
    ("shouting:NOT_A_TASK", [], "shouting:NOT_A_TASK is not a tokengym Task class"),
    ("Shout-v7", [], "unknown env id 'Shout-v7'"),
    ("tokengym/Target-v0", ["--import", "no_such_module"], "--import: cannot import module 'no_such_module'"),
    ("leaving:Shout", [], "env 'leaving:Shout': importing module 'leaving' called sys.exit(0); a module of tasks must not exit"),
    ("tokengym/Target-v0", ["--import", "leaving"], "--import: importing module 'leaving' called sys.exit(0)"),
])
def test_a_bad_env_is_one_line_and_exit_2_before_any_folder(user_folder, capsys, env, extra, message):
    (user_folder / "leaving.py").write_text("import sys\nsys.exit(0)\n")  # a script that exits when imported
    sys.modules.pop("leaving", None)
    for cmd in (["train", "grpo", "--name", "x", "--steps", "1"], ["eval", "--model", "tiny"], ["sample"]):
        code, out, err = _run(capsys, *cmd, "--env", env, *extra)
        assert code == 2 and err.startswith("tokengym: error: ") and err.count("\n") == 1, (cmd, err)
        assert message in err, err
    assert not (user_folder / "runs").exists()


def test_module_class_trains_and_the_run_rebuilds_its_env(user_folder, capsys):
    code, out, err = _run(capsys, "train", "sft", "--env", "shouting:Shout", "--steps", "2", "--eval-prompts", "4",
                          "--batch-size", "4", "--progress", "false", "--name", "s")
    assert code == 0, err
    saved = json.loads((user_folder / "runs/s/config.json").read_text())["run"]
    assert saved["env"] == "shouting:Shout" and saved["imports"] is None
    code, out, err = _run(capsys, "sample", "--run", "runs/s", "--num", "2", "--greedy")
    assert code == 0, err
    assert "env: shouting:Shout" in out and "model (runs/s/model" in out
    assert all(line.split("'")[1] in ("aa", "ab", "ba", "bb") for line in out.splitlines() if line.startswith("["))
    code, out, err = _run(capsys, "sample", "--run", "runs/s", "--policy", "reference", "--num", "3")
    assert code == 0 and "mean outcome reward: 1.000" in out, out  # the Shout verifier on Shout's solutions


def test_a_task_class_in_a_package_module_gets_a_valid_id(user_folder, capsys):
    """``--env package.module:Class``: the dotted module path becomes a valid Gymnasium namespace."""
    (user_folder / "mypkg").mkdir()
    (user_folder / "mypkg" / "__init__.py").write_text("")
    (user_folder / "mypkg" / "tasks.py").write_text(TASK_FILE)
    try:
        assert registry.resolve_env("mypkg.tasks:Shout") == "mypkg-tasks/Shout-v0"
        code, out, err = _run(capsys, "sample", "--env", "mypkg.tasks:Shout", "--policy", "reference", "--num", "2")
        assert code == 0 and "mean outcome reward: 1.000" in out, err
    finally:
        for name in [n for n in registry.TASK_SPECS if n.startswith("mypkg.tasks:")]:
            registry.unregister_task(name)
        sys.modules.pop("mypkg.tasks", None)
        sys.modules.pop("mypkg", None)


def test_module_env_id_and_import_flag_name_a_registered_id(user_folder, capsys):
    code, out, err = _run(capsys, "sample", "--env", "shouting:ShoutById-v0", "--policy", "reference", "--num", "2")
    assert code == 0 and "mean outcome reward: 1.000" in out, err
    gym.registry.pop("ShoutById-v0")
    sys.modules.pop("shouting")
    code, out, err = _run(capsys, "train", "sft", "--env", "ShoutById-v0", "--import", "shouting", "--steps", "1",
                          "--eval-prompts", "2", "--batch-size", "2", "--progress", "false", "--name", "i")
    assert code == 0, err
    saved = json.loads((user_folder / "runs/i/config.json").read_text())["run"]
    assert saved["env"] == "ShoutById-v0" and saved["imports"] == ["shouting"]


def test_sample_run_uses_the_runs_env_not_arithmetic(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "train", "sft", "--env", "tokengym/Reverse-v0", "--env-kwargs", '{"length": 3}',
                          "--steps", "1", "--eval-prompts", "2", "--batch-size", "2", "--progress", "false", "--name", "r")
    assert code == 0, err
    code, out, err = _run(capsys, "sample", "--run", "runs/r", "--policy", "reference", "--num", "2")
    assert code == 0 and "env: tokengym/Reverse-v0" in out, out
    prompts = [line.split("'")[1] for line in out.splitlines() if line.startswith("[")]
    assert prompts and all(len(p) == 3 and p.isalpha() for p in prompts), prompts  # length-3 words, not sums


class FakeEntryPoint:
    def __init__(self, name, value, load):
        self.name, self.value, self._load = name, value, load

    def load(self):
        return self._load()


def test_entry_points_load_once_lazily_and_a_broken_one_is_a_warning(monkeypatch, capsys):
    import importlib.metadata

    calls = []

    def register():
        calls.append(1)
        if "tokengym/FromEp-v0" not in gym.registry:
            gym.register(id="tokengym/FromEp-v0", entry_point="tokengym.envs.token_env:TokenEnv",
                         vector_entry_point="tokengym.envs.vector_env:TokenVectorEnv", kwargs={"task": "target"})

    def broken():
        raise RuntimeError("its dependency is missing")

    eps = [FakeEntryPoint("bad", "bad_pkg:tasks", broken), FakeEntryPoint("good", "good_pkg:register", lambda: register)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps if group == "tokengym.envs" else [])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        assert registry.resolve_env("tokengym/Target-v0") == "tokengym/Target-v0" and not calls  # built-in: not loaded
        code, out, err = _run(capsys, "sample", "--env", "tokengym/FromEp-v0", "--num", "1", "--policy", "reference")
        assert code == 0 and calls == [1], err
        assert "tokengym: warning: entry point 'bad' (bad_pkg:tasks)" in err and "its dependency is missing" in err
        registry.resolve_env("tokengym/FromEp-v0")
        with pytest.raises(ValueError, match="unknown env id 'tokengym/Nope-v0'"):
            registry.resolve_env("tokengym/Nope-v0")
        assert calls == [1]  # once
    finally:
        gym.registry.pop("tokengym/FromEp-v0", None)


# ---------------------------------------------------------------------------------------------- learn(run_dir=...)
def _agent():
    return GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=4, seed=3))


def _env():
    return gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4)


def _records(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time") and k != "perf/tokens_per_s"}
            for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_learn_run_dir_writes_the_clis_folder_refuses_reuse_and_resumes_exactly(tmp_path, capsys, one_thread):
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    want = _agent()
    want.learn(_env(), run_dir=full, save_every=2)
    assert {"config.json", "metrics.jsonl", "checkpoints", "model"} <= set(os.listdir(full))
    saved = json.loads(open(os.path.join(full, "config.json")).read())
    assert saved["algorithm"] == "grpo" and saved["config"]["steps"] == 4 and saved["run"]["env"] == "tokengym/Target-v0"
    assert saved["run"]["prompts"] == 2 and saved["run"]["group_size"] == 4
    with pytest.raises(ValueError, match="already exists and is not empty; pass resume=True"):
        _agent().learn(_env(), run_dir=full)
    with pytest.raises(ValueError, match="already finished"):
        _agent().learn(_env(), run_dir=full, resume=True)

    def crash(record):
        if record["step"] == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _agent().learn(_env(), callback=crash, run_dir=split, save_every=2)
    other = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=4, seed=4))
    with pytest.raises(ValueError, match="different config: seed was 3, now 4"):
        other.learn(_env(), run_dir=split, resume=True)
    for env, says in ((gym.make_vec("tokengym/Reverse-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4),
                       "env was 'tokengym/Target-v0', now 'tokengym/Reverse-v0'"),
                      (gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=2),
                       "group_size was 4, now 2")):
        with pytest.raises(ValueError, match=f"^cannot resume .* on another env than its 'tokengym/Target-v0': {says}"):
            _agent().learn(env, run_dir=split, resume=True)
    got = GRPOAgent(Policy.from_pretrained("tiny", seed=1), GRPOConfig(steps=4, seed=3))  # other weights: restored
    got.learn(_env(), run_dir=split, resume=True)
    for (name, p), q in zip(want.policy.model.named_parameters(), got.policy.model.parameters()):
        assert torch.equal(p, q), name
    assert _records(split) == _records(full)
    for cmd in (["eval", "--run", split, "--prompts", "4", "--samples", "0"], ["plot", split]):
        code, out, err = _run(capsys, *cmd)
        assert code == 0, err
    assert "on tokengym/Target-v0" in _run(capsys, "eval", "--run", split, "--prompts", "2", "--samples", "0")[1]


def test_an_env_made_from_a_task_instance_is_recorded_so_that_it_can_be_made_again():
    import numpy as np

    from tokengym.agents.runtime.session import env_record
    from tokengym.envs import Task, TokenVectorEnv
    from tokengym.envs.tasks import ReverseTask
    from tokengym.rewards.common import TokengymWarning

    env = TokenVectorEnv(2, ReverseTask(length=3, alphabet="xyz"), max_new_tokens=9)
    rec = json.loads(json.dumps(env_record(env)))  # through config.json
    again = gym.make_vec(rec["env"], num_envs=2, vectorization_mode="vector_entry_point", **rec["env_kwargs"])
    assert rec["env"] == "tokengym/Reverse-v0" and again.max_new_tokens == 9
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    assert again.task.batch(rng(), 8) == env.task.batch(rng(), 8)

    class Hidden(Task):  # its argument is not kept under its own name: it cannot be read back
        def __init__(self, n=2):
            self._n = n

        def sample(self, rng):
            return {"prompt": "a" * self._n + "\n"}

        def reward(self):
            return lambda prompts, completions, **_: [0.0] * len(completions)

    with pytest.warns(TokengymWarning, match="the arguments of its task"):
        assert env_record(TokenVectorEnv(1, Hidden(n=3)))["env_kwargs"] is None


BROKEN = textwrap.dedent('''
    import math
    from shouting import Shout


    def _const(value):
        return lambda prompts, completions, **_: value(len(completions))


    class SampleRaises(Shout):
        def sample(self, rng): raise RuntimeError("boom in sample")
    class SampleNone(Shout):
        def sample(self, rng): return None
    class PromptTooLong(Shout):
        def sample(self, rng): return {"prompt": "x" * 40 + "\\n", "solution": "X"}
    class RewardNaN(Shout):
        def reward(self): return _const(lambda n: [math.nan] * n)
    class RewardShort(Shout):
        def reward(self): return _const(lambda n: [0.0])
    class RewardNone(Shout):
        def reward(self): return _const(lambda n: None)
    class RewardStrings(Shout):
        def reward(self): return _const(lambda n: ["a"] * n)
    class RewardRaises(Shout):
        def reward(self):
            def r(prompts, completions, **_): raise KeyError("answer")
            return r
''')


@pytest.mark.parametrize("task, message", [
    ("SampleRaises", "RuntimeError: boom in sample"),
    ("SampleNone", "each sample needs a 'prompt' string"),
    ("PromptTooLong", "exceeds max_prompt_len"),
    ("RewardNaN", "returned a non-finite value (nan)"),
    ("RewardShort", "returned shape (1,) for"),
    ("RewardNone", "must return a list of floats or a 1-D tensor, got NoneType"),
    ("RewardStrings", "must return a list of floats or a 1-D tensor, got list"),
    ("RewardRaises", "KeyError: 'answer'"),
])
def test_an_own_task_that_breaks_is_one_line_and_exit_2_before_any_folder(user_folder, capsys, task, message):
    """A probe episode (random actions) draws and scores samples before the run folder is made, so a task's
    sample() or reward() that raises or returns the wrong thing is one line, not a traceback after the folder."""
    (user_folder / "broken.py").write_text(BROKEN)
    for cmd in (["train", "grpo", "--steps", "1"], ["train", "sft", "--steps", "1"]):
        code, out, err = _run(capsys, *cmd, "--name", "x", "--env", f"broken:{task}", "--threads", "1")
        assert code == 2 and err.startswith(f"tokengym: error: env broken:{task}: ") and err.count("\n") == 1, (cmd, err)
        assert message in err, err
    assert not (user_folder / "runs").exists()
    sys.modules.pop("broken", None)
    for name in [n for n in registry.TASK_SPECS if n.startswith("broken:")]:
        registry.unregister_task(name)


def test_learn_resume_takes_the_settings_the_cli_lets_a_resume_change(tmp_path, one_thread):
    """``learn(run_dir=..., resume=True)`` with another sync_timeout, rollout_timeout or worker_threads gets past the
    resume's comparison, as ``--resume`` with those flags does (and this run, without workers, then refuses them as
    settings it would ignore); another learning rate is refused; the same settings resume."""
    from tokengym.agents.cli.runner import RESUMABLE

    run_dir = str(tmp_path / "r")
    with pytest.raises(KeyboardInterrupt):
        _agent().learn(_env(), run_dir=run_dir, save_every=1,
                       callback=lambda r: (_ for _ in ()).throw(KeyboardInterrupt) if r["step"] == 2 else None)
    changed = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=4, seed=3, sync_timeout=60.0,
                                                                   rollout_timeout=600.0, worker_threads=2))
    assert {"sync_timeout", "rollout_timeout", "worker_threads"} <= RESUMABLE
    with pytest.raises(ValueError, match="cannot resume .* with a different config: lr was 0.0001, now 0.001"):
        GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=4, seed=3, lr=1e-3)).learn(
            _env(), run_dir=run_dir, resume=True)
    with pytest.raises(ValueError, match=r"^sync_timeout=60.0 \(--sync-timeout\) is only read by rollout workers"):
        changed.learn(_env(), run_dir=run_dir, resume=True)
    GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=4, seed=3)).learn(_env(), run_dir=run_dir, resume=True)
    assert [r["step"] for r in _records(run_dir) if "train/loss" in r] == [1, 2, 3, 4]

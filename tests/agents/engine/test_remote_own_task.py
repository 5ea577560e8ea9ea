"""A task of the user's own (``--env module:Class``, ``--import``) with ``tokengym worker`` servers: the learner sends
what the worker must import, and a worker that cannot import it is named in one line before the run folder exists."""

import json
import os
import re
import signal
import subprocess
import sys

import gymnasium as gym
import pytest

from tokengym.agents.cli import main
from tokengym.envs.tasks.registry import TASK_SPECS, env_imports, env_source, unregister_task

SECRET = "own-task-secret"
TASK = '''from tokengym.envs import Task


class SortLetters(Task):
    """Sort four letters alphabetically."""

    name = "sort_letters"
    max_prompt_chars = 6
    default_max_new_tokens = 6

    def sample(self, rng):
        letters = "".join(rng.choice(list("abcdef"), 4))
        return {"prompt": letters + "\\n", "solution": "".join(sorted(letters))}

    def reward(self):
        return lambda prompts, completions, solution, **_: [float(c.strip() == s) for c, s in zip(completions, solution)]
'''
REGISTERS = '''import tokengym.envs
from own_remote_task import SortLetters

tokengym.envs.register_task("own_remote_sort", SortLetters, env_id="ownremote/Sort-v0")
'''

VERSIONED = {  # the learner's copy of a task takes `letters`; the worker's older copy does not
    "learner": TASK + """

class Versioned(SortLetters):
    def __init__(self, letters=4):
        self.letters = letters
""",
    "worker": TASK + """

class Versioned(SortLetters):
    pass
"""}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A worker in a folder holding ``own_remote_task.py`` and ``own_remote_reg.py`` (and not
    ``own_remote_absent.py``): ``(address, that folder)``."""
    folder = tmp_path_factory.mktemp("worker_side")
    (folder / "own_remote_task.py").write_text(TASK)
    (folder / "own_remote_reg.py").write_text(REGISTERS)
    (folder / "own_remote_versioned.py").write_text(VERSIONED["worker"])
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", "worker", "--listen", "127.0.0.1:0",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=folder, start_new_session=True, env=dict(os.environ, TOKENGYM_SECRET=SECRET))
    found = re.search(r"listening on (\S+) ", proc.stdout.readline())
    try:
        assert found, "the worker did not start"
        yield found.group(1), folder
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def learner_side(tmp_path, monkeypatch, worker):
    """The learner's folder (its cwd): the same modules, plus one the worker lacks; the tasks and modules they
    register are gone again afterwards."""
    for name in ("own_remote_task.py", "own_remote_reg.py"):
        (tmp_path / name).write_text((worker[1] / name).read_text())
    (tmp_path / "own_remote_absent.py").write_text(TASK)
    (tmp_path / "own_remote_versioned.py").write_text(VERSIONED["learner"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENGYM_SECRET", SECRET)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in TASK_SPECS if n.startswith("own_remote")]:
        unregister_task(name)
    for module in [m for m in sys.modules if m.startswith("own_remote")]:
        del sys.modules[module]


def _train(address, runs, name, *extra):
    return main(["train", "grpo", "--steps", "2", "--prompts", "2", "--group-size", "2", "--eval-prompts", "0", "--progress", "false", "--threads", "1",
                 "--async-mode", "one-step", "--rollout-workers", address, "--runs-dir", str(runs), "--name", name,
                 *extra])


def test_env_source_names_what_another_process_imports(learner_side):
    from tokengym.envs import resolve_env

    assert env_source("tokengym/Arithmetic-v0") == "tokengym/Arithmetic-v0"
    env_id = resolve_env("own_remote_task:SortLetters")
    assert env_id == "own_remote_task/SortLetters-v0" and env_source(env_id) == "own_remote_task:SortLetters"
    assert resolve_env("ownremote/Sort-v0", ["own_remote_reg"]) == "ownremote/Sort-v0"
    assert env_source("ownremote/Sort-v0") == "own_remote_task:ownremote/Sort-v0"
    assert env_imports("ownremote/Sort-v0") == ["own_remote_reg"] and env_imports(env_id) == []
    gym.register("ownremote/Plain-v0", entry_point="tokengym.envs.token_env:TokenEnv",
                 vector_entry_point="own_remote_reg:Nothing")
    try:
        assert env_source("ownremote/Plain-v0") == "own_remote_reg:ownremote/Plain-v0"
    finally:
        gym.registry.pop("ownremote/Plain-v0")


def test_own_task_trains_with_a_remote_worker_and_a_missing_module_is_one_line(learner_side, worker, capsys):
    runs = learner_side / "runs"
    assert _train(worker[0], runs, "own", "--env", "own_remote_task:SortLetters") == 0, capsys.readouterr().err
    with open(runs / "own" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if '"step"' in line][-1] == 2
    capsys.readouterr()
    assert _train(worker[0], runs, "absent", "--env", "own_remote_absent:SortLetters") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.match(rf"tokengym: error: rollout worker {re.escape(worker[0])} cannot make this run's env on its "
                    r"machine: env 'own_remote_absent:SortLetters': cannot import module 'own_remote_absent'", err), err
    assert os.listdir(runs) == ["own"]


def test_an_env_the_worker_cannot_build_is_one_line_naming_the_worker_before_the_run(learner_side, worker, capsys):
    """The worker imports the module, but its copy of the task refuses the run's env kwargs: its hello builds the env
    (one group, the model's tokenizer) and the learner stops in one line naming the worker and the reason."""
    runs = learner_side / "runs"
    assert _train(worker[0], runs, "old", "--env", "own_remote_versioned:Versioned", "--env-kwargs",
                  '{"letters": 4}') == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.match(rf"tokengym: error: rollout worker {re.escape(worker[0])} cannot make this run's env on its "
                    r"machine: cannot build env 'own_remote_versioned:Versioned' with \{'letters': 4\}: TypeError: "
                    r"Versioned\(\) takes no arguments$", err), err
    assert not runs.exists()


def test_a_worker_imports_the_modules_the_learner_names(worker):
    """``--import`` modules travel with the env: the worker imports them before it looks the id up."""
    from tokengym.agents.engine.remote import call

    for imports, error in (([], "unknown env id 'ownremote/Sort-v0'"), (["own_remote_reg"], None)):
        status, reply = call(worker[0], "/v1/hello", {"env": {"env": "ownremote/Sort-v0", "imports": imports}},
                             SECRET.encode(), 60)
        assert status == 200
        why = json.loads(reply)["env_error"]
        assert why == error if error is None else why.startswith(error), why

"""``--env module:function`` trains an OpenAI-client agent; settings that cannot work are one line and exit 2, before
any run folder is written."""

import json
import sys
import textwrap

import gymnasium as gym
import pytest

from tokengym.agents.cli.command import main
from tokengym.envs.tasks import registry

AGENTS = textwrap.dedent('''
    from tokengym.envs import agent_env

    NOT_AN_AGENT = 3


    @agent_env(data="arithmetic", max_new_tokens=24)
    def answer(client, sample):
        r = client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": sample["prompt"]}])
        return float(r.choices[0].message.content.strip().endswith(f"A: {sample['answer']}"))


    @agent_env(data="arithmetic")
    def bad_tools(client, sample):
        client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f g"}}])


    def no_data(client, sample):
        return 0.0
''')


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    (tmp_path / "myagents.py").write_text(AGENTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("myagents", None)
    for name in [n for n in registry.TASK_SPECS if n.startswith("myagents:")]:
        gym.registry.pop(registry.TASK_SPECS[name].env_id, None)
        registry.unregister_task(name)


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("env, message", [
    ("myagents:NOT_AN_AGENT", "myagents:NOT_AN_AGENT is not a tokengym Task class (it is int 3); name a subclass of "
                              "tokengym.envs.Task, an agent function agent(client, sample)"),
    ("myagents:bad_tools", "agent env 'agent/bad_tools': its first call was refused: tools[0]: function name 'f g' must "
                           "be 1-64 letters, digits, _ or -"),
    ("myagents:no_data", "agent myagents:no_data has no data: mark it @agent_env(data=...) or pass --env-kwargs"),
])
def test_an_agent_that_cannot_work_is_one_line_and_exit_2_before_any_folder(user_folder, capsys, env, message):
    code, out, err = _run(capsys, "train", "grpo", "--name", "x", "--steps", "1", "--model", "tiny-arithmetic",
                          "--threads", "1", "--env", env)
    assert code == 2 and err.startswith("tokengym: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (user_folder / "runs").exists()


def test_an_agent_function_trains_from_the_cli_and_its_run_evaluates_again(user_folder, capsys):
    code, out, err = _run(capsys, "train", "grpo", "--env", "myagents:answer", "--model", "tiny-arithmetic",
                          "--steps", "2", "--eval-prompts", "8", "--progress", "false", "--name", "a")
    assert code == 0, err
    saved = json.loads((user_folder / "runs/a/config.json").read_text())["run"]
    assert saved["env"] == "myagents:answer"
    rows = [json.loads(line) for line in (user_folder / "runs/a/metrics.jsonl").read_text().splitlines()]
    assert all(r.get("agent/errors", 0.0) == 0.0 for r in rows) and any("agent/errors" in r for r in rows)
    code, out, err = _run(capsys, "eval", "--run", "runs/a", "--prompts", "8", "--samples", "0")
    assert code == 0 and "greedy" in out, err


def test_an_agent_env_crosses_to_async_rollout_workers(user_folder, capsys):
    """One-step-off async training: each rollout worker process gets its own copy of the agent env (its own endpoint
    and agents), rebuilt from the agent function and its options."""
    code, out, err = _run(capsys, "train", "grpo", "--env", "myagents:answer", "--model", "tiny-arithmetic",
                          "--steps", "3", "--eval-prompts", "8", "--progress", "false", "--name", "w",
                          "--async-mode", "one-step", "--threads", "1")
    assert code == 0, err
    rows = [json.loads(line) for line in (user_folder / "runs/w/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/errors" in r]
    assert len(steps) == 3 and all(r["agent/errors"] == 0.0 and r["async/staleness"] <= 1 for r in steps)

"""Pins left open by the test suite and found by a mutation pass: each test fails with one realistic bug (named in
its docstring) applied to the envs or the task registry and passes on the real code."""

import sys
import warnings

import gymnasium as gym
import pytest
import torch

from tokengym.envs import Reply, Task, TokenVectorEnv, check_task
from tokengym.envs.tasks import ArithmeticTask, CalculatorTask, unregister_task
from tokengym.envs.tasks.registry import TASK_SPECS, resolve_env
from tokengym.rewards.common import F32_MAX


# ---------------------------------------------------------------------------------------------- 8. rewards-finite
class NonFiniteAdapter(TokenVectorEnv):
    """An adapter that adds a library env's own per-token reward on each ended episode's last action: correct in
    every respect (on an action column, deterministic) but its value, which is not finite."""

    value = float("nan")

    def _score_events(self, done_now, delim_now, reward, info):
        super()._score_events(done_now, delim_now, reward, info)
        rows = done_now.nonzero().flatten()
        self.rewards[rows, self.last_action[rows]] += self.value




class Overflowing(Task):
    """A multi-turn task whose every reward is finite in float32 (as the env checks each one), but whose last turn
    reward and outcome, both on the episode's last token, add up to inf there."""

    name, max_prompt_chars, default_max_new_tokens, max_turns = "overflowing", 4, 16, 3
    turn_stop_strings = ("?",)

    def sample(self, rng):
        w = "".join(rng.choice(list("ab"), 2))
        return {"prompt": w + "\n", "answer": w, "solution_turns": ["x?", "ok", w]}

    def respond(self, sample, history):
        return "ok" if history[-1].endswith("?") else Reply(done=True, reward=self.big)

    def reward(self):
        big = self.big
        return lambda prompts, completions, **_: [big] * len(completions)


def adapter(value):
    env = NonFiniteAdapter(4, ArithmeticTask())
    env.value = value
    return env


def overflowing(big):
    task = Overflowing()
    task.big = big
    return task


@pytest.mark.parametrize("broken, fine, name", [
    (lambda: adapter(float("nan")), lambda: adapter(0.0), "arithmetic"),
    (lambda: adapter(float("inf")), lambda: adapter(0.0), "arithmetic"),
    (lambda: overflowing(F32_MAX), lambda: overflowing(1.0), "overflowing"),
], ids=["adapter-nan", "adapter-inf", "task-sum-overflows"])
def test_a_non_finite_reward_in_the_buffers_fails_the_rewards_finite_rule(broken, fine, name):
    """An env or task broken only in ``rewards-finite``: an adapter's NaN or inf per-token reward on an action column,
    or a task whose float32-finite turn reward and outcome add up to inf on one token (now refused by the env's step
    itself) fails ``check_task`` with that rule's message. Catches the rule's check of the episode buffers
    disabled: NaN then fails as ``deterministic`` (NaN != NaN), inf passes or fails only the API check."""
    check_task(fine())  # the premise: the same env or task with finite rewards passes every rule
    with pytest.raises(AssertionError, match=rf"^rewards-finite: task '{name}': (rewards holds NaN or inf|the rewards of "
                                             r"episode slot 0 add up to inf in float32 .*) \(reference policy\)$"):
        check_task(broken())


# ---------------------------------------------------------------------------------------------- 9. subclasses by identity
class HarderArithmetic(ArithmeticTask):
    """A user's task built on a bundled one: three-digit operands (its own prompts, its own class)."""

    def __init__(self, n_operands=(2, 3), digits=3, operators="+", seed=None, chat=False, system_prompt=None):
        super().__init__(n_operands, digits, operators, seed, chat, system_prompt)


def test_a_run_records_a_subclass_of_a_bundled_task_under_its_own_name():
    """``config.json``'s env of a run on a subclass of a bundled task (the user's, and the bundled Calculator, which
    extends Arithmetic) names that class, so ``--resume`` and ``tokengym eval --run`` rebuild it, not the parent.
    Catches the registry lookup in ``session._task_record`` matching with ``issubclass`` instead of identity."""
    from tokengym.agents.runtime.session import env_record

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a class in a test module: whatever it says about the arguments)
        mine = env_record(TokenVectorEnv(4, HarderArithmetic()))
    assert mine["env"] == f"{HarderArithmetic.__module__}:HarderArithmetic"
    assert env_record(TokenVectorEnv(4, CalculatorTask()))["env"] == "tokengym/Calculator-v0"
    assert env_record(TokenVectorEnv(4, ArithmeticTask()))["env"] == "tokengym/Arithmetic-v0"


USER_TASKS = '''
from tokengym.envs.tasks import ArithmeticTask


class Subtraction(ArithmeticTask):
    """Arithmetic with minus signs."""

    def __init__(self, **kw):
        super().__init__(operators="-", **kw)
'''


def test_module_class_of_a_subclass_of_a_bundled_task_resolves_to_its_own_id(tmp_path, monkeypatch):
    """``--env my_tasks:Subtraction`` (a subclass of the bundled Arithmetic) registers and makes that class under its
    own id, not the bundled parent's. Catches ``registry._register_class`` finding a known class with ``issubclass``
    instead of identity (the subclass then runs, and is recorded, as plain Arithmetic)."""
    (tmp_path / "my_user_tasks.py").write_text(USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env_id = resolve_env("my_user_tasks:Subtraction")
        assert env_id == "my_user_tasks/Subtraction-v0"
        assert TASK_SPECS["my_user_tasks:Subtraction"].cls.__name__ == "Subtraction"
        env = gym.make_vec(env_id, num_envs=2, vectorization_mode="vector_entry_point")
        assert type(env.task).__name__ == "Subtraction" and env.task.operators == "-"
        assert resolve_env("my_user_tasks:Subtraction") == env_id  # a second lookup finds it by identity
        assert resolve_env("tokengym.envs.tasks:CalculatorTask") == "tokengym/Calculator-v0"
    finally:
        if "my_user_tasks:Subtraction" in TASK_SPECS:
            unregister_task("my_user_tasks:Subtraction")
        sys.modules.pop("my_user_tasks", None)


# ---------------------------------------------------------------------------------------------- 10. stop sequences in a turn
def write(env, text):
    """Step a one-slot ``env`` with ``text``'s characters as its actions (the char tokenizer: one token each)."""
    for ch in text:
        env.step(torch.tensor([env.tokenizer.convert_tokens_to_ids(ch)]))


def test_a_stop_sequence_ends_an_episode_at_exactly_its_tokens():
    """A k-token stop string written as the episode's first k tokens ends it at the k-th: ``"ab"`` after exactly 2
    tokens, ``"xab"`` after 3. Catches the turn-length check of stop sequences off by one (``>= k`` for ``>= k - 1``:
    the turn must then hold k + 1 tokens, so a stop string at the very start is missed)."""
    for text in ("ab", "xab"):
        env = TokenVectorEnv(1, ArithmeticTask(), stop_strings=["ab"])
        env.reset(seed=0)
        write(env, text[:-1])
        assert not env.terminated[0], f"{text!r}: ended before the stop string was complete"
        write(env, text[-1])
        assert bool(env.terminated[0]), f"{text!r}: the stop string 'ab' did not end the episode"
        assert int(env.gen_len[0]) == len(text)


def test_a_stop_sequence_ends_a_turn_that_holds_exactly_its_tokens_after_a_reply():
    """After an env reply the agent's turn starts afresh: the Calculator's turn stop string ``"</calc>"`` (7 tokens)
    written as a whole turn ends it at its 7th token, while a stop string that begins inside the reply (``"\\nA"``
    across the reply ``"=3\\n"`` and the turn's ``"A"``) does not count. Catches the turn-length check of stop
    sequences off by one either way (``>= k`` misses the whole-turn marker, ``>= k - 2`` stops on the reply's)."""
    call = "<calc>1+2</calc>"
    start = len(call) + len("=3\n")  # the turn after the reply starts here

    env = TokenVectorEnv(1, CalculatorTask())
    env.reset(seed=0)
    write(env, call)
    assert env.history[0] == [call, "=3\n"] and not env.terminated[0]
    assert int(env.turn_start[0]) == int(env.gen_len[0]) == start
    write(env, "</calc")
    assert not env.terminated[0]
    write(env, ">")  # the turn holds exactly the 7 tokens of "</calc>": it ends, with no call in it, so the episode ends
    assert bool(env.terminated[0]), "a turn of exactly the 7 tokens of '</calc>' did not end"
    assert int(env.gen_len[0]) == start + 7 and env.history[0] == [call, "=3\n", "</calc>"]

    env = TokenVectorEnv(1, CalculatorTask(), stop_strings=["\nA"])
    env.reset(seed=0)
    write(env, call)
    write(env, "A")  # "\nA" in the buffer, but its "\n" is the reply's (context): no stop
    assert not env.terminated[0], "a stop string begun inside the env's reply ended the agent's turn"
    assert int(env.gen_len[0]) == start + 1

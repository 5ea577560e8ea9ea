"""``check_task``: every bundled task passes, and a task or env breaking one rule fails with that rule's name."""

import itertools
import importlib.util

import pytest

from tokengym.envs import Reply, Task, TokenVectorEnv, check_task
from tokengym.envs.task_check import RULES
from tokengym.envs.tasks import TASK_SPECS, CalculatorTask

ARGS = {"dataset": {"data": [{"prompt": "1+1\n", "answer": "2"}, {"prompt": "2+2\n", "answer": "4"}]},
        "reasoning_gym": {"name": "leg_counting", "size": 8}}


@pytest.mark.parametrize("name", list(TASK_SPECS))
def test_every_bundled_task_passes(name):
    if name == "reasoning_gym" and importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning-gym is not installed")
    check_task(TASK_SPECS[name].cls(**ARGS.get(name, {})))


class Echo(Task):
    """Say a word; the env answers each turn that ends with '?' with 'ok'."""

    name, max_prompt_chars, default_max_new_tokens, max_turns = "echo", 4, 16, 3
    turn_stop_strings = ("?",)

    def sample(self, rng):
        w = "".join(rng.choice(list("ab"), 2))
        return {"prompt": w + "\n", "answer": w, "solution_turns": ["x?", "ok", w]}

    def respond(self, sample, history):
        return "ok" if history[-1].endswith("?") else None

    def reward(self):
        return lambda prompts, completions, answer, **_: [float(c.endswith(a)) for c, a in zip(completions, answer)]


def test_a_well_behaved_multi_turn_task_passes_and_a_reply_quoting_special_tokens_stays_text():
    class Quoting(Echo):
        def respond(self, sample, history):  # the eos token's text, as text: the env must not make it the token
            return f"ok {self.eos}" if history[-1].endswith("?") else None

    env = TokenVectorEnv(4, Echo())
    check_task(env)
    task = Quoting()
    task.eos = env.tokenizer.eos_token
    check_task(task)


class NanReward(Echo):
    def reward(self):
        return lambda prompts, completions, **_: [float("nan")] * len(completions)


class SpecialIds(Echo):
    def respond(self, sample, history):  # token ids chosen by the task: here the tokenizer's EOS
        return Reply(ids=[self.eos_id]) if history[-1].endswith("?") else None


class Counter(Echo):
    _count = itertools.count()

    def sample(self, rng):  # ignores the env's rng: a re-seeded env does not replay its prompts
        w = "ab"[next(self._count) // 4 % 2] * 2
        return {"prompt": w + "\n", "answer": w, "solution_turns": ["x?", "ok", w]}


class ActionMaskedReplies(TokenVectorEnv):
    def _answer_turns(self, *args):  # an adapter that marks the env's reply as the agent's
        out = super()._answer_turns(*args)
        for s in self.replied:
            end = int(self.gen_len[s]) + self.max_prompt_len
            self.action_mask[s, end - int(self.reply_len[s]):end] = True
        return out


class RewardOnReply(TokenVectorEnv):
    def _answer_turns(self, *args):  # a turn reward put on the reply's last token instead of the agent's
        out = super()._answer_turns(*args)
        for s in self.replied:
            self.rewards[s, int(self.gen_len[s]) - 1] += 0.5
        return out


def _special_ids_env():
    env = TokenVectorEnv(4, SpecialIds())
    env.task.eos_id = env.tokenizer.eos_token_id
    return env


@pytest.mark.parametrize("rule, make", [
    ("replies-are-context", lambda: ActionMaskedReplies(4, Echo())),
    ("rewards-on-actions", lambda: RewardOnReply(4, Echo())),
    ("rewards-finite", lambda: TokenVectorEnv(4, NanReward())),
    ("no-special-tokens", _special_ids_env),
    ("deterministic", lambda: TokenVectorEnv(4, Counter())),
])
def test_each_broken_rule_is_named(rule, make):
    with pytest.raises(AssertionError, match=f"^{rule}: task 'echo': ") as info:
        check_task(make())
    assert str(info.value).count("\n") == 0
    assert rule in RULES


def test_the_api_check_runs_too():
    class NoSpaces(TokenVectorEnv):
        def reset(self, **kw):
            obs, info = super().reset(**kw)
            return obs, None  # not a dict

    with pytest.raises(AssertionError, match="info must be a dict"):
        check_task(NoSpaces(4, CalculatorTask()))

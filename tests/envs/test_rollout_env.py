"""The env contract of the rollout loops (``tokengym.envs.rollout_env``): every loop runs on an env that exposes the
declared names and nothing else, ``hold`` keeps rows still, and the stop rule is the env's own."""

import pytest
import torch

from tokengym.agents import Policy
from tokengym.agents.engine.generation import PolicyGenerator
from tokengym.agents.engine.replay import collect_generated
from tokengym.agents.engine.rollout import collect, collect_episodes, evaluate, heldout_samples
from tokengym.envs import TokenVectorEnv
from tokengym.envs.rollout_env import ROLLOUT_ENV_NAMES, RolloutEnv, StopRule
from tokengym.envs.tasks import ArithmeticTask, CalculatorTask

pytestmark = pytest.mark.usefixtures("one_thread")


class OnlyDeclared:
    """An env that forwards the :class:`RolloutEnv` names to a real one and refuses every other name."""

    def __init__(self, env):
        object.__setattr__(self, "_env", env)

    def __getattr__(self, name):
        if name not in ROLLOUT_ENV_NAMES:
            raise AttributeError(f"the rollout loop read {name!r}, which RolloutEnv does not declare")
        return getattr(self._env, name)


def _same(a, b):
    for name in ("tokens", "attention_mask", "action_mask", "logprobs", "rewards", "outcome", "terminated", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.completions == b.completions


@pytest.fixture(scope="module")
def calc():
    return Policy.from_pretrained("tiny-calculator", seed=3)


def test_token_vector_env_is_a_rollout_env():
    env = TokenVectorEnv(2, "arithmetic")
    assert isinstance(env, RolloutEnv) and all(hasattr(env, n) for n in ROLLOUT_ENV_NAMES)


@pytest.mark.parametrize("task", ["arithmetic", "calculator"])
def test_every_loop_runs_on_the_declared_names_alone(calc, task):
    """The token-level loop, the generation-level replay, continuous batching and evaluation read nothing else; the
    rollouts equal those of the plain env."""
    make = lambda **kw: TokenVectorEnv(8, task, group_size=kw.pop("group_size", 2), **kw)  # noqa: E731
    for run in (lambda env: collect(env, calc, seed=5), lambda env: collect_generated(env, PolicyGenerator(calc), seed=5)):
        calc.seed(1)
        ours = run(OnlyDeclared(make()))
        calc.seed(1)
        _same(ours, run(make()))
    samples = heldout_samples(ArithmeticTask() if task == "arithmetic" else CalculatorTask(), 12)
    for mode in ("disabled", "next_step"):
        env = TokenVectorEnv(4, task, autoreset_mode=mode)
        assert evaluate(calc, OnlyDeclared(env), samples) == evaluate(calc, TokenVectorEnv(4, task, autoreset_mode=mode), samples)
    ro = collect_episodes(OnlyDeclared(TokenVectorEnv(4, task, autoreset_mode="next_step")), calc, samples, greedy=True)
    assert ro.num_episodes == len(samples)


def test_held_rows_do_not_move_and_count_as_live():
    env = TokenVectorEnv(3, "arithmetic")
    env.reset(seed=0)
    digit = env.tokenizer.convert_tokens_to_ids("7")
    before = env.tokens.clone()
    hold = torch.tensor([False, True, True])
    env.step(torch.full((3,), digit), hold=hold)
    assert env.gen_len.tolist() == [1, 0, 0] and torch.equal(env.tokens[1:], before[1:])
    eos = torch.full((3,), env.tokenizer.eos_token_id)
    env.step(eos, hold=hold)  # row 0 ends; rows 1 and 2 are still live though they did not act
    assert env.done.tolist() == [True, False, False] and not env.all_done
    with pytest.raises(ValueError, match="hold covers every live slot"):
        env.step(eos, hold=torch.tensor([False, True, True]))
    env.step(eos)
    assert env.all_done
    with pytest.raises(ValueError, match="hold must be a bool tensor"):
        env.reset(seed=0)
        env.step(eos, hold=torch.tensor([0, 1, 1]))


def test_the_stop_rule_is_the_env_own():
    env = TokenVectorEnv(2, CalculatorTask())
    rule = env.stop_rule()
    assert isinstance(rule, StopRule) and env.tokenizer.eos_token_id in rule.token_ids
    assert rule.strings == ("</calc>",)  # the turn marker: several char tokens, matched on ids
    assert rule.sequences == (tuple(env.tokenizer("</calc>", add_special_tokens=False)["input_ids"]),)
    single = TokenVectorEnv(2, "arithmetic", stop_strings=["\n", "A: 1"]).stop_rule()
    nl = env.tokenizer.convert_tokens_to_ids("\n")
    assert nl in single.token_ids and single.strings == ("A: 1",)  # a one-token stop string is a stop token

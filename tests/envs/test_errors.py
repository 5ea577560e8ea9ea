"""Bad input: each gets a clear error that names the problem."""

import math

import gymnasium as gym

import pytest
import torch

from tokengym.envs import TokenEnv, TokenVectorEnv, char_tokenizer, load_tokenizer
from tokengym.envs.tasks.toy import TargetTask

EOS = char_tokenizer().eos_token_id


@pytest.fixture
def env():
    e = TokenVectorEnv(2, TargetTask("ok"))
    e.reset(seed=0)
    return e


def test_action_out_of_range(env):
    with pytest.raises(ValueError, match=r"action 101 for env 1 is outside the action space \[0, 101\)"):
        env.step(torch.tensor([5, 101]))
    with pytest.raises(ValueError, match="outside the action space"):
        env.step(torch.tensor([-1, 5]))
    assert env.gen_len.tolist() == [0, 0], "a rejected step must not change the state"


def test_action_wrong_shape_dtype_device(env):
    with pytest.raises(ValueError, match=r"shape \(2,\), got \(3,\)"):
        env.step(torch.tensor([5, 5, 5]))
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.float32"):
        env.step(torch.tensor([5.0, 5.0]))
    with pytest.raises(ValueError, match="actions are on meta but the env is on cpu"):
        env.step(torch.empty(2, dtype=torch.long, device="meta"))


def test_step_after_all_done_and_before_reset(env):
    env.step(torch.tensor([EOS, EOS]))
    with pytest.raises(RuntimeError, match=r"after every episode ended.*call reset\(\)"):
        env.step(torch.tensor([5, 5]))
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        TokenVectorEnv(1, TargetTask("ok")).step(torch.tensor([5]))
    single = TokenEnv(TargetTask("ok"))
    single.reset(seed=0)
    single.step(EOS)
    with pytest.raises(RuntimeError, match="call reset"):
        single.step(5)


def test_single_env_bad_action():
    single = TokenEnv(TargetTask("ok"))
    single.reset(seed=0)
    with pytest.raises(ValueError, match="one integer token id"):
        single.step(1.5)
    with pytest.raises(ValueError, match="outside the action space"):
        single.step(1000)


def test_prompt_longer_than_budget():
    env = TokenVectorEnv(1, TargetTask("ok"), max_prompt_len=4)
    with pytest.raises(ValueError, match=r"prompt of 10 tokens exceeds max_prompt_len=4"):
        env.reset(options={"samples": ["too long\n"]})


def test_tokenizer_without_eos_or_pad():
    tok = char_tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match="has no pad token"):
        load_tokenizer(tok)
    tok = char_tokenizer()
    tok.eos_token = None
    with pytest.raises(ValueError, match="has no EOS token"):
        TokenVectorEnv(1, TargetTask("ok"), tokenizer=tok)
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_tokenizer("no/such/folder")


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda p, c, **_: [1.0], r"returned shape \(1,\) for 2 completions"),
        (lambda p, c, **_: [math.nan] * len(c), "non-finite value"),
        (lambda p, c, **_: ["x"] * len(c), "must return a list of floats"),
    ],
)
def test_reward_returning_wrong_length_or_nan(bad, match):
    env = TokenVectorEnv(2, TargetTask("ok"), reward=bad)
    env.reset(seed=0)
    with pytest.raises((ValueError, TypeError), match=match):
        env.step(torch.tensor([EOS, EOS]))


def test_construction_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        TokenVectorEnv(5, TargetTask("ok"), group_size=2)
    with pytest.raises(ValueError, match="needs group_size=1"):
        TokenVectorEnv(4, TargetTask("ok"), group_size=2, autoreset_mode="next_step")
    with pytest.raises(ValueError, match="not supported"):
        TokenVectorEnv(1, TargetTask("ok"), autoreset_mode="same_step")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        TokenVectorEnv(1, "nope")
    with pytest.raises(ValueError, match="no step_delimiter"):
        TokenVectorEnv(1, TargetTask("ok"), process_reward=lambda p, s, **_: [[0.0] * len(x) for x in s])
    with pytest.raises(TypeError, match="use gymnasium.make_vec"):
        TokenEnv(TargetTask("ok"), num_envs=4)
    with pytest.raises(ValueError, match="unknown reset options"):
        TokenVectorEnv(1, TargetTask("ok")).reset(options={"prompt": "x"})


@pytest.mark.parametrize("env_id, kwarg", [
    ("tokengym/GuessNumber-v0", "high"), ("tokengym/GuessNumber-v0", "max_turns"), ("tokengym/Reverse-v0", "length"),
    ("tokengym/Arithmetic-v0", "n_operands"), ("tokengym/Arithmetic-v0", "digits"), ("tokengym/Target-v0", "n_prompts"),
    ("tokengym/Target-v0", "max_new_tokens"),
])
@pytest.mark.parametrize("value", [2**63, 10**30, -1, 2.5])
def test_out_of_range_env_kwargs_fail_when_the_env_is_made(env_id, kwarg, value):
    """Before any run folder exists (tokengym train makes the env first), not at the first reset (GuessNumber-v0's
    high above int64 used to pass and then crash numpy's draw)."""
    with pytest.raises(ValueError, match=rf"^{kwarg} ") as e:
        gym.make(env_id, **{kwarg: value})
    assert "\n" not in str(e.value)


def test_rewards_whose_float32_sum_overflows_stop_the_step_in_one_line():
    """A final turn reward and an outcome, each finite in float32, whose sum on the same token is inf: the step
    refuses it (it used to hand back inf and store it in the rewards buffer)."""
    import torch

    from tokengym.envs import Reply, Task, TokenVectorEnv

    class Huge(Task):
        name, max_prompt_chars, default_max_new_tokens = "huge", 4, 8
        turn_stop_strings = ("?",)

        def sample(self, rng):
            return {"prompt": "a\n"}

        def respond(self, sample, history):
            return Reply(done=True, reward=3.4e38)

        def reward(self):
            return lambda prompts, completions, **_: [3.4e38] * len(completions)

    env = TokenVectorEnv(1, Huge())
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"^the rewards of episode slot 0 add up to inf in float32 this step"):
        env.step(torch.tensor([env.tokenizer.eos_token_id]))

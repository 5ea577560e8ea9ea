"""Bad input through the Python API fails when the object is built, with a message that names the problem;
silent trouble (a reward with no signal, characters the tokenizer lacks) is a :class:`TokengymWarning`."""

import math

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import DPOConfig, GRPOAgent, GRPOConfig, Policy, PPOConfig, collect
from tokengym.agents.runtime.logger import SignalWatch
from tokengym.agents.engine.resources import batch_memory_bytes, check_device, check_memory
from tokengym.envs.tasks import DatasetTask
from tokengym.rewards import PRMConfig, RewardModelConfig
from tokengym.rewards.common import TokengymWarning


def vec(env_id="tokengym/Arithmetic-v0", n=2, **kw):
    return gym.make_vec(env_id, num_envs=n, vectorization_mode="vector_entry_point", **kw)


@pytest.mark.parametrize("make, message", [
    (lambda: GRPOConfig(clip_eps=1.5), "clip_eps must be in [0, 1], got 1.5"),
    (lambda: GRPOConfig(steps=1.5), "GRPOConfig.steps must be an int, got 1.5"),
    (lambda: GRPOConfig(lr=math.inf), "GRPOConfig.lr must be a finite number, got inf"),
    (lambda: GRPOConfig(bf16=1), "GRPOConfig.bf16 must be true or false, got 1"),
    (lambda: PPOConfig(clip_eps=1.5), "clip_eps must be in [0, 1]"),
    (lambda: PPOConfig(lam=math.nan), "PPOConfig.lam must be a finite number"),
    (lambda: DPOConfig(batch_size=2.0), "DPOConfig.batch_size must be an int"),
    (lambda: RewardModelConfig(epochs=1.5), "RewardModelConfig.epochs must be an int"),
    (lambda: PRMConfig(lr=math.nan), "PRMConfig.lr must be a finite number"),
])
def test_configs_refuse_bad_values_when_built(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be None (the task's default) or an int from 1 to 1048576, got 0"),
    (dict(max_new_tokens=2.7), "max_new_tokens must be None (the task's default) or an int from 1 to 1048576, got 2.7"),
    (dict(max_prompt_len=True), "max_prompt_len must be None"),
])
def test_env_budgets_are_positive_ints_not_silently_replaced(kw, message):
    with pytest.raises(ValueError) as e:
        vec(**kw)
    assert message in str(e.value)


def test_rewards_that_cannot_be_called_fail_when_the_env_is_built():
    with pytest.raises(TypeError, match="reward must be a callable .* got int: 5"):
        vec(reward=5)
    with pytest.raises(TypeError, match="process_reward must be a callable"):
        vec(process_reward="yes")


def test_a_process_reward_returning_a_flat_list_is_named():
    def flat(prompts, steps, **_):
        return [1.0 for _ in steps]  # one score per completion instead of one list per completion

    env = vec("tokengym/Arithmetic-v0", n=2, process_reward=flat)
    env.reset(seed=0)
    one, newline = (env.tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in ("1", "\n"))
    env.step(torch.full((2,), one))
    with pytest.raises(TypeError, match=r"process reward 'flat' returned float 1.0 for completion 0; .*list\[list\[float\]\]"):
        env.step(torch.full((2,), newline))  # the first step ends: the PRM is called


def test_collect_refuses_rows_past_the_models_positions():
    policy = Policy.from_pretrained("tiny")  # max_position_embeddings 512
    env = vec("tokengym/Dataset-v0", data=[{"prompt": "x" * 600, "answer": "1"}])
    with pytest.raises(ValueError, match=r"max_prompt_len=602 tokens plus max_new_tokens=64 need 666 positions, but the model has 512"):
        collect(env, policy)


def test_a_missing_data_file_is_named():
    with pytest.raises(FileNotFoundError, match="no such JSONL file: '/nope.jsonl'"):
        DatasetTask("/nope.jsonl")


def test_characters_the_tokenizer_lacks_warn_once():
    env = vec("tokengym/Dataset-v0", data=[{"prompt": "über\n", "answer": "ü"}, {"prompt": "ok\n", "answer": "1"}])
    with pytest.warns(TokengymWarning, match="the tokenizer has no token for 'ü'"):
        env.reset(seed=0)


def test_devices_and_memory_are_checked_before_allocating():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available"):
            check_device("cuda")
    with pytest.raises(ValueError, match="not a torch device"):
        check_device("gpu0")
    model = Policy.from_pretrained("tiny").model
    assert batch_memory_bytes(model, 64, 45, 64) < 2**30  # the default run: far below a GiB
    with pytest.raises(ValueError, match="GiB free; use fewer prompts"):
        check_memory(model, 10**9, 45, 10**9, "cpu", "a batch")


def test_a_solved_task_says_solved_not_no_signal():
    """Every group scoring 1 is equal rewards too, but the advice for a dead signal (SFT first...) would mislead."""
    import warnings

    watch = SignalWatch(patience=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            watch.update({"reward/frac_zero_std_groups": 1.0, "reward/mean": 1.0, "reward/accuracy": 1.0})
    assert len(seen) == 1 and str(seen[0].message).startswith("solved: every episode was correct for 3 steps")
    assert "SFT first" not in str(seen[0].message)


def test_progress_lines_keep_significant_digits_and_label_the_evaluation(capsys):
    from tokengym.agents.cli.runner import Progress

    p = Progress(total=10, initial=0, enabled=True, desc="run")
    p.update({"step": 0, "eval/accuracy": 0.625})
    p.update({"step": 10, "reward/mean": 0.40625, "train/loss": -3.725290298461914e-09})
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == "run step 10/10 eval_acc=0.625 reward=0.406 loss=-3.73e-09", line
    zero = Progress(total=1, initial=0, enabled=True, desc="z")
    zero.update({"step": 1, "train/loss": -0.0})  # a loss of exactly -0.0 shows as 0, not -0
    assert capsys.readouterr().err.strip() == "z step 1/1 loss=0"


def test_no_learning_signal_warns_once_after_five_flat_steps():
    watch = SignalWatch(patience=5)
    with pytest.warns(TokengymWarning, match="no learning signal: every group's rewards were equal for 5 steps"):
        for _ in range(5):
            watch.update({"reward/frac_zero_std_groups": 1.0, "reward/mean": 0.0})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.update({"reward/frac_zero_std_groups": 1.0, "reward/mean": 0.0})  # once only
    other = SignalWatch(patience=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step with signal resets the count
        for frac in (1.0, 0.5, 1.0, 0.5):
            other.update({"reward/frac_zero_std_groups": frac})


def test_grpo_from_a_model_that_never_succeeds_says_so():
    """The README's failure mode: an untrained preset on Reverse scores 0 everywhere, so nothing is learned."""
    env = vec("tokengym/Reverse-v0", n=16, group_size=8, length=4)
    agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=5, seed=0))
    with pytest.warns(TokengymWarning, match=r"no learning signal.*SFT first"):
        history = agent.learn(env)
    assert all(r["reward/mean"] == 0 for r in history)


@pytest.fixture(scope="module")
def tiny_policy():
    return Policy.from_pretrained("tiny-arithmetic")


@pytest.mark.parametrize("call, error, message", [
    (lambda p: collect("tokengym/Arithmetic-v0", p), TypeError, "collect() needs a tokengym vector env"),
    (lambda p: collect(vec(), None), TypeError, "a rollout needs a Sampler"),
    (lambda p: collect(vec(), p, greedy="yes"), TypeError, "collect(greedy=...) must be True or False, got 'yes'"),
    (lambda p: collect(vec(), p, samples="1+2\n"), ValueError, "options['samples'] must be a list of prompts"),
    (lambda p: collect(vec(), p, samples=[{"question": "1+2\n"}] * 2), ValueError, "each sample needs a 'prompt'"),
    (lambda p: collect(vec(tokenizer=_big_tokenizer()), p), ValueError,
     "the env's tokenizer has 1101 token ids but the model's vocabulary has 101"),
])
def test_collect_refuses_arguments_of_the_wrong_kind_in_one_line(tiny_policy, call, error, message):
    with pytest.raises(error) as e:
        call(tiny_policy)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def _big_tokenizer():
    """The char tokenizer with 1000 more tokens than the tiny model's 101 logits."""
    tok = tokengym.envs.char_tokenizer()
    tok.add_tokens([f"<x{i}>" for i in range(1000)])
    return tok


@pytest.mark.parametrize("make, error, message", [
    (lambda p: GRPOAgent(p, {"lr": 1e-4}), TypeError, "GRPOAgent(config=...) takes a GRPOConfig, got dict: pass GRPOConfig(**settings)"),
    (lambda p: GRPOAgent("tiny-arithmetic"), TypeError,
     "GRPOAgent(policy=...) takes a tokengym Policy, got str: load it with Policy.from_pretrained('tiny-arithmetic')"),
    (lambda p: GRPOAgent(p, PPOConfig()), TypeError, "GRPOAgent(config=...) takes a GRPOConfig, got PPOConfig"),
    (lambda p: __import__("tokengym.agents", fromlist=["PPOAgent"]).PPOAgent(p, {"lr": 1e-4}), TypeError,
     "PPOAgent(config=...) takes a PPOConfig, got dict"),
    (lambda p: DPOConfig(lr="1e-4"), ValueError, "DPOConfig.lr must be"),
    (lambda p: GRPOConfig(lr="1e-4"), ValueError, "GRPOConfig.lr must be"),
    (lambda p: PRMConfig(lr="1e-4"), ValueError, "PRMConfig.lr must be"),
    (lambda p: GRPOAgent(p, GRPOConfig(minibatches=16)).check_env(vec(n=8, group_size=4)), ValueError,
     "minibatches=16 is more than the 8 episodes of a rollout batch"),
])
def test_learners_refuse_arguments_of_the_wrong_kind_in_one_line(tiny_policy, make, error, message):
    with pytest.raises(error) as e:
        make(tiny_policy)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("async_mode", "sometimes", r"GRPOConfig.async_mode='sometimes'; choose one of"),  # it ran as bounded
    ("rollout_workers", 0, r"GRPOConfig.rollout_workers has an invalid value: 0"),  # learn() hung
    ("max_staleness", -1, r"GRPOConfig.max_staleness has an invalid value: -1"),
])
def test_settings_changed_after_the_config_was_built_are_checked_by_learn(field, value, message):
    cfg = GRPOConfig(steps=1)
    setattr(cfg, field, value)
    agent = GRPOAgent(Policy.from_pretrained("tiny"), cfg)
    env = gym.make_vec("tokengym/Target-v0", num_envs=4, vectorization_mode="vector_entry_point", group_size=2)
    with pytest.raises(ValueError, match=message):
        agent.learn(env)
    assert agent.global_step == 0


def test_learn_on_a_single_env_is_one_line_naming_the_vector_env_it_needs():
    """``learn(gym.make(...))`` (a single env) used to end in an AttributeError deep in the agent."""
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(steps=1))
    with pytest.raises(ValueError, match=r"^GRPOAgent\.learn\(\) needs a vector env of token episodes, such as "
                                         r"gym\.make_vec\(.*got OrderEnforcing \(a single env: gym\.make\)"):
        agent.learn(gym.make("tokengym/Arithmetic-v0"))


def test_numpy_scalars_in_a_config_are_the_python_numbers_they_hold():
    """Sweeps hand over ``np.float32`` / ``np.int64`` / ``np.bool_``: taken as Python numbers (checked, and saved
    as JSON), not refused as 'must be a finite number'."""
    import json
    from dataclasses import asdict

    import numpy as np

    from tokengym.agents.algorithms.sft import SFTConfig

    cases = [(GRPOConfig(steps=np.int64(3), lr=np.float32(0.5), bf16=np.bool_(True)), {"steps": 3, "lr": 0.5, "bf16": True}),
             (SFTConfig(steps=np.int64(3), lr=np.float32(0.5)), {"steps": 3, "lr": 0.5}),
             (DPOConfig(beta=np.float32(0.5), batch_size=np.int64(3)), {"beta": 0.5, "batch_size": 3})]
    for cfg, want in cases:
        values = json.loads(json.dumps(asdict(cfg)))
        assert {k: (values[k], type(getattr(cfg, k))) for k in want} == {k: (v, type(v)) for k, v in want.items()}
    with pytest.raises(ValueError, match="GRPOConfig.lr must be a finite number, got nan"):
        GRPOConfig(lr=np.float32("nan"))

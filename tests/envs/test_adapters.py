"""Adapters of the community's env libraries (tokengym.envs.adapters): a real env of each library through the env
checks, a scripted episode whose rewards are known, and two GRPO steps; and a tokengym task driven as TRL's and
GEM's envs drive theirs. Each test skips when its library is not installed."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from tokengym.envs import TokenEnv, TokenVectorEnv, check_task
from tokengym.envs.adapters.episodes import GlobalRandom


def conforms(task):
    """The checks every adapter passes: Gymnasium's single env API, and ``tokengym.envs.check_task`` (replies are
    context, rewards on action columns and finite, no special tokens from env text, seeded replay, the vector API)."""
    check_env(TokenEnv(task, max_new_tokens=48))
    check_task(TokenVectorEnv(4, task, group_size=2, max_new_tokens=48))


def play(task, turns, seed=0):
    """One episode whose agent turns are ``turns`` (each ended by EOS); returns the env after it."""
    env = TokenVectorEnv(1, task, max_new_tokens=400)
    env.reset(seed=seed)
    tok = env.tokenizer
    for turn in turns:
        for t in tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]:
            env.step(torch.tensor([t]))
        if env.all_done:
            break
    return env


def play_group(task, rows, seed=0):
    """One group of episodes of the same prompt, row ``i`` playing the agent turns ``rows[i](sample)``; the env after it."""
    env = TokenVectorEnv(len(rows), task, group_size=len(rows), max_new_tokens=400)
    env.reset(seed=seed)
    tok = env.tokenizer
    queues = [[t for turn in script(env.samples[i]) for t in tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
              for i, script in enumerate(rows)]
    while not env.all_done:
        env.step(torch.tensor([q.pop(0) if q else tok.eos_token_id for q in queues]))
    return env


def assert_outcome_is_the_return(env, returns, solved):
    """A rollout of ``env``'s finished episodes reports each library return as its outcome (what ``reward/mean``,
    ``reward/accuracy`` and ``evaluate`` read), while GRPO's advantages are the pure function's of those returns."""
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy
    from tokengym.agents import functional as F
    from tokengym.agents.algorithms.grpo import grpo_advantages
    from tokengym.agents.engine.models import build_preset
    from tokengym.agents.engine.rollout_data import snapshot_rollout

    assert env.outcome.tolist() == [0.0] * env.num_envs  # at the env, the rewards are turn rewards only
    assert env.turn_rewards.sum(1).tolist() == pytest.approx(returns)
    ro = snapshot_rollout(env, torch.zeros(env.num_envs, env.max_new_tokens))
    assert ro.outcome.tolist() == pytest.approx(returns) and torch.equal(ro.returns, ro.outcome)
    agent = GRPOAgent(Policy(*build_preset("tiny"), seed=0), GRPOConfig(steps=1))
    for i, won in enumerate(solved):
        one = agent.rollout_metrics(dataclasses.replace(ro.select([i]), group_size=1), {}, 1.0)
        assert float(one["reward/mean"]) == pytest.approx(returns[i]) and float(one["reward/accuracy"]) == float(won)
    for scale in ("group", "none"):  # each reward counted once: the advantages of the returns, bit for bit
        want = F.group_advantages(env.turn_rewards.sum(1), ro.group_size, scale=scale)[:, None] * ro.action_mask
        assert torch.equal(grpo_advantages(ro, "outcome", scale), want)


def assert_replies_are_context(env):
    """Every reply but a last one sits in the episode as context (action mask 0); rewards sit on agent tokens."""
    P, n = env.max_prompt_len, int(env.gen_len[0])
    acts = env.action_mask[0, P:P + n].bool()
    replies = env.history[0][1::2][:len(env.history[0][::2]) - 1]  # a reply after the last turn is not appended
    assert int((~acts).sum()) == sum(len(env.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies) > 0
    assert bool((env.turn_rewards[0, :n][~acts] == 0).all()) and bool(env.turn_rewards[0, :n][acts].any())


def grpo_two_steps(task):
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy
    from tokengym.agents.engine.models import build_preset

    policy = Policy(*build_preset("tiny", max_position_embeddings=2048), seed=0)
    env = TokenVectorEnv(4, task, group_size=2, max_new_tokens=32, tokenizer=policy.tokenizer)
    history = GRPOAgent(policy, GRPOConfig(steps=2, seed=0)).learn(env)
    assert len(history) == 2 and all(np.isfinite(h["train/loss"]) for h in history)
    assert sum(h["env/turns_per_episode"] for h in history) > 0  # the library env answered some turns


# -- GEM -----------------------------------------------------------------------------------------------------------


def gem_target(env_id, seed):
    gem = pytest.importorskip("gem")
    with GlobalRandom():
        env = gem.make(env_id)
        env.reset(seed=seed)
    return env.game_number


def test_gem_guess_the_number():
    pytest.importorskip("gem")
    from gem.utils.constants import LanguageGameReward

    from tokengym.envs.adapters import GEMTask

    task = GEMTask("game:GuessTheNumber-v0-easy")
    conforms(task)
    env = TokenVectorEnv(1, task, max_new_tokens=400)
    env.reset(seed=3)
    target = gem_target("game:GuessTheNumber-v0-easy", env.samples[0]["key"])
    wrong = 1 if target != 1 else 2
    env = play(task, [f"\\boxed{{{wrong}}}", f"\\boxed{{{target}}}"], seed=3)
    assert bool(env.terminated[0]) and len(env.history[0]) == 4
    assert "target number is" in env.history[0][1] and "Congratulations" in env.history[0][3]
    want = LanguageGameReward.internal_step_reward + LanguageGameReward.success_reward
    assert float(env.turn_rewards[0].sum()) == pytest.approx(want) and float(env.outcome[0]) == 0.0
    assert_replies_are_context(env)
    won = lambda sample: [f"\\boxed{{{gem_target('game:GuessTheNumber-v0-easy', sample['key'])}}}"]  # noqa: E731
    env = play_group(task, [won, lambda sample: ["no guess"]], seed=3)
    assert_outcome_is_the_return(env, [LanguageGameReward.success_reward, LanguageGameReward.format_error_reward],
                                 solved=[True, False])
    grpo_two_steps(task)


def test_gem_episodes_keep_their_own_random_streams_and_replay():
    pytest.importorskip("gem")
    from tokengym.envs.adapters import GEMTask

    task = GEMTask("game:GuessTheNumber-v0-hard")
    state = random.getstate()
    sample = task.sample(np.random.default_rng(1))
    assert random.getstate() == state  # the library's reset(seed) did not move the caller's stream
    first = task.respond(sample, ["\\boxed{20}"])
    assert list(task._parked) == [(sample["key"], "\\boxed{20}", first.text)]  # the live game waits for the next turn
    task.close()  # no parked episode: the next answer replays from the seed
    again = task.respond(sample, ["\\boxed{20}"])
    assert again == first and "20" in first.text
    with pytest.raises(RuntimeError, match="not deterministic"):
        task.respond(sample, ["\\boxed{20}", "\nsomething the env never said\n", "\\boxed{30}"])


# -- TextArena -------------------------------------------------------------------------------------------------------


def test_textarena_guess_the_number():
    pytest.importorskip("textarena")
    import textarena as ta

    from tokengym.envs.adapters import TextArenaTask

    task = TextArenaTask("GuessTheNumber-v0-raw")  # its replies quote "[5]": a "]" turn marker would be refused
    conforms(task)
    env = TokenVectorEnv(1, task, max_new_tokens=400)
    env.reset(seed=0)
    game = ta.make("GuessTheNumber-v0-raw")
    with GlobalRandom():
        game.reset(num_players=1, seed=env.samples[0]["key"])
    target = game.game_number
    wrong = 1 if target != 1 else 2
    env = play(task, [f"[{wrong}]", f"[{target}]"], seed=0)
    assert bool(env.terminated[0]) and env.history[0][1].strip() in ("The target number is higher.", "The target number is lower.")
    assert float(env.turn_rewards[0].sum()) == 1.0  # TextArena's reward for a found number
    assert_replies_are_context(env)
    grpo_two_steps(task)


def test_adapters_name_the_missing_extra_or_the_wrong_env():
    from tokengym.envs.adapters.episodes import require

    with pytest.raises(ImportError, match=r"^GEMTask needs the 'no_such_lib' package: pip install 'tokengym\[gem\]'$"):
        require("no_such_lib", "gem", "GEMTask")
    pytest.importorskip("textarena")
    from tokengym.envs.adapters import TextArenaTask

    with pytest.raises(ValueError, match="unknown TextArena env id 'NoSuchGame-v0'"):
        TextArenaTask("NoSuchGame-v0")


# -- verifiers -------------------------------------------------------------------------------------------------------


def verifiers_envs():
    vf = pytest.importorskip("verifiers")
    if not hasattr(vf, "MultiTurnEnv"):
        pytest.skip("verifiers 0.4 has no classic environment API")
    from datasets import Dataset

    rows = Dataset.from_list([{"question": f"{a}+{b}", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6)]])
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, **_):
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    single = vf.SingleTurnEnv(dataset=rows, parser=parser, rubric=vf.Rubric(funcs=[correct], parser=parser),
                              system_prompt="Add.")

    class Guess(vf.MultiTurnEnv):
        """The answer is guessed; env_response says higher/lower, and the last word is a final env response."""

        async def env_response(self, messages, state, **_):
            said = messages[-1]["content"].strip()
            if said == state["answer"]:
                state["final_env_response"] = [vf.UserMessage(content="correct")]
                return state["final_env_response"]
            return [vf.UserMessage(content="higher" if int("0" + said if said.isdigit() else "0") < int(state["answer"]) else "lower")]

    def found(state, **_):
        return 1.0 if state.get("final_env_response") else 0.0

    multi = Guess(dataset=rows, rubric=vf.Rubric(funcs=[found]), max_turns=4)
    return single, multi


def test_verifiers_single_turn_env_scores_with_its_parser_and_rubric():
    single, _ = verifiers_envs()
    from tokengym.envs.adapters import VerifiersTask

    task = VerifiersTask(single, chat=False)
    conforms(task)
    env = TokenVectorEnv(1, task, max_new_tokens=400)
    env.reset(seed=0)
    question = env.samples[0]["prompt"].splitlines()[-1]
    assert env.samples[0]["prompt"].startswith("Add.")  # the environment's own system prompt
    env = play(task, [f"<answer>{eval(question)}</answer>"], seed=0)
    assert bool(env.terminated[0]) and float(env.turn_rewards[0].sum()) == 1.0
    env = play(task, ["<answer>0</answer>"], seed=0)
    assert bool(env.terminated[0]) and float(env.turn_rewards[0].sum()) == 0.0
    right = lambda sample: [f"<answer>{eval(sample['prompt'].splitlines()[-1])}</answer>"]  # noqa: E731
    env = play_group(task, [lambda sample: ["<answer>0</answer>"], right], seed=0)
    assert_outcome_is_the_return(env, [0.0, 1.0], solved=[False, True])  # the rubric failed, then passed
    grpo_two_steps(task)


def test_verifiers_multi_turn_env_answers_with_env_response():
    _, multi = verifiers_envs()
    from tokengym.envs.adapters import VerifiersTask

    task = VerifiersTask(multi, chat=False)
    conforms(task)
    env = TokenVectorEnv(1, task, max_new_tokens=400)
    env.reset(seed=0)
    answer = str(eval(env.samples[0]["prompt"].strip()))
    env = play(task, ["1", "99", answer], seed=0)
    assert env.history[0][1].strip() == "higher" and env.history[0][3].strip() == "lower"
    assert env.history[0][5].strip() == "correct" and bool(env.terminated[0])
    assert float(env.turn_rewards[0].sum()) == 1.0
    assert_replies_are_context(env)
    grpo_two_steps(task)


# -- OpenEnv ---------------------------------------------------------------------------------------------------------


def openenv_guess():
    pytest.importorskip("openenv.core")
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        guess: str

    class GuessObservation(Observation):
        message: str = ""

    class GuessEnvironment(Environment):
        """An OpenEnv server-side environment: guess a number from 1 to 8 in 3 tries; 1.0 when found."""

        SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance

        def __init__(self):
            super().__init__()
            self._state, self.target, self.tries = State(), 0, 0

        def reset(self, seed=None, episode_id=None, **_):
            self.target, self.tries = random.Random(seed).randint(1, 8), 0
            self._state = State(episode_id=episode_id, step_count=0)
            return GuessObservation(message="Guess a number from 1 to 8.")

        def step(self, action, timeout_s=None, **_):
            self.tries += 1
            self._state.step_count += 1
            said = action.guess.strip()
            if said == str(self.target):
                return GuessObservation(message="correct", done=True, reward=1.0)
            hint = "higher" if said.isdigit() and int(said) < self.target else "lower"
            return GuessObservation(message=hint, done=self.tries >= 3, reward=0.0)

        @property
        def state(self):
            return self._state

    return GuessEnvironment, GuessAction, GuessObservation


def test_openenv_in_process_environment():
    GuessEnvironment, GuessAction, _ = openenv_guess()
    from tokengym.envs.adapters import OpenEnvTask

    task = OpenEnvTask(GuessEnvironment, GuessAction, name="openenv/guess")
    conforms(task)
    env = TokenVectorEnv(1, task, max_new_tokens=400)
    env.reset(seed=0)
    target = random.Random(env.samples[0]["key"]).randint(1, 8)
    env = play(task, [str(9), str(target)], seed=0)
    assert env.history[0][1].strip() == "lower" and env.history[0][3].strip() == "correct"
    assert bool(env.terminated[0]) and float(env.turn_rewards[0].sum()) == 1.0
    assert_replies_are_context(env)
    found = lambda sample: ["9", str(random.Random(sample["key"]).randint(1, 8))]  # noqa: E731
    env = play_group(task, [found, lambda sample: ["9", "9", "9"]], seed=0)
    assert_outcome_is_the_return(env, [1.0, 0.0], solved=[True, False])
    # a space ends a turn too, so that the untrained model's turns end within the budget
    grpo_two_steps(OpenEnvTask(GuessEnvironment, GuessAction, name="openenv/guess", turn_stop_strings=(" ",)))


def test_openenv_over_its_own_server_and_client():
    """The same environment behind OpenEnv's HTTP/WebSocket server on loopback, reached by its GenericEnvClient."""
    GuessEnvironment, GuessAction, GuessObservation = openenv_guess()
    uvicorn = pytest.importorskip("uvicorn")
    import socket
    import threading
    import time

    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.generic_client import GenericEnvClient

    from tokengym.envs.adapters import OpenEnvTask

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=16)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        task = OpenEnvTask(lambda: GenericEnvClient(base_url=url).sync(), lambda text: {"guess": text},
                           observation=lambda obs: obs.get("message", ""), name="openenv/guess-remote", cache_size=8)
        env = TokenVectorEnv(1, task, max_new_tokens=400)
        env.reset(seed=0)
        target = random.Random(env.samples[0]["key"]).randint(1, 8)
        env = play(task, [str(9), str(target)], seed=0)
        assert env.history[0][1].strip() == "lower" and env.history[0][3].strip() == "correct"
        assert float(env.turn_rewards[0].sum()) == 1.0
        task.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# -- the other way round -----------------------------------------------------------------------------------------------


def test_a_tokengym_task_as_trls_environment():
    from tokengym.envs.adapters import TRLEnvironment, trl_rows
    from tokengym.envs.tasks import CalculatorTask

    task = CalculatorTask(call_cost=0.25)
    row = trl_rows(task, 1, seed=0)[0]
    env = TRLEnvironment(task)
    assert env.reset(**row) is None  # the prompt is the dataset's
    expr = row["prompt"].strip()
    assert env.act(f"<calc>{expr}</calc>") == f"={row['answer']}\n"
    assert env.act(f"A: {row['answer']}") == "The episode is over."  # no call: the final answer ends the episode
    assert env.get_reward() == pytest.approx(1.0 - 0.25)
    fresh = TRLEnvironment("calculator", seed=1)
    assert isinstance(fresh.reset(), str)  # no row: the task's own prompt
    trl = pytest.importorskip("trl")
    assert trl is not None  # TRL reads reset/get_reward/public methods as tools: the shape checked above


def test_a_tokengym_task_as_a_gem_env():
    gem = pytest.importorskip("gem")
    from tokengym.envs.adapters import gem_env, register_gem_env

    env = gem_env("calculator")
    assert isinstance(env, gem.Env)
    prompt, _ = env.reset(seed=0)
    answer = eval(prompt.strip())
    obs, reward, term, trunc, _ = env.step(f"<calc>{prompt.strip()}</calc>")
    assert obs == f"={answer}\n" and reward == 0.0 and not term
    obs, reward, term, trunc, _ = env.step(f"A: {answer}")
    assert term and reward == 1.0
    env_id = register_gem_env("arithmetic", env_id="tokengym:Arithmetic-test")
    single = gem.make(env_id)
    prompt, _ = single.reset(seed=0)
    assert single.step("A: -99999")[1:3] == (0.0, True)  # a single-turn task ends at its first step

"""Env turns per second through tokengym's adapters against each library's own rollout loop, same scripted policy.

A scripted player guesses 1, 2, 3, ... in a guess-the-number game of each library (GEM's and TextArena's own games; a
small OpenEnv ``Environment`` and a verifiers ``MultiTurnEnv``, since neither package ships a text environment), so
both sides see the same turns. The library side is its own loop: ``reset``/``step`` (GEM, TextArena, OpenEnv
in-process) or ``Environment.run_rollout`` with a scripted client (verifiers). The tokengym side is a
``TokenVectorEnv`` of the adapter task fed the same turns one token at a time (each turn ended by EOS), so it also
pays for tokenizing, the token buffers and the reply bookkeeping. Each contender runs in its own process::

    python bench/envs_ecosystem.py --json [--episodes 64] [--num-envs 16]

Prints ``{library: {"library_turns_per_s", "tokengym_turns_per_s", "ratio"}}`` (ratio = tokengym / library).

``--learn`` measures GRPO learning instead: on one environment written against each library's own env API (a GEM
``Env``, a TextArena ``Env``, an OpenEnv ``Environment``, a verifiers ``SingleTurnEnv``), each posing a sum of three
two-digit numbers in the format the shipped ``tiny-arithmetic`` model reads, GRPO from that model, and its greedy
held-out reward before and after (held-out seeds, or the verifiers env's eval dataset), one process per seed::

    python bench/envs_ecosystem.py --learn --json [--steps 150] [--seeds 0,1]

Prints ``{library: {"env_id", "model", "steps", "seeds", "before", "after", "runs"}}`` (before/after: one held-out
mean reward per seed; ``runs``: each run's reward, accuracy and training seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _isolate import run_child  # noqa: E402

LIBRARIES = ("gem", "textarena", "openenv", "verifiers")
MOVE = {"gem": "\\boxed{{{}}}", "textarena": "[{}]", "openenv": "{}", "verifiers": "{}"}


def openenv_guess() -> Any:
    """A guess-the-number OpenEnv environment: 1 to 50, 7 tries, reward 1.0 when found."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        guess: str

    class GuessObservation(Observation):
        message: str = ""

    class GuessEnvironment(Environment):
        def reset(self, seed=None, episode_id=None, **_):
            self.target, self.tries, self._state = random.Random(seed).randint(1, 50), 0, State()
            return GuessObservation(message="Guess a number from 1 to 50.")

        def step(self, action, timeout_s=None, **_):
            self.tries += 1
            said = action.guess.strip()
            if said == str(self.target):
                return GuessObservation(message="correct", done=True, reward=1.0)
            hint = "higher" if said.isdigit() and int(said) < self.target else "lower"
            return GuessObservation(message=hint, done=self.tries >= 7, reward=0.0)

        @property
        def state(self):
            return self._state

    return GuessEnvironment, GuessAction


def verifiers_guess() -> Any:
    """A guess-the-number verifiers ``MultiTurnEnv`` (1 to 50, 7 turns), scored 1.0 when found by its rubric."""
    import verifiers as vf
    from datasets import Dataset

    rows = Dataset.from_list([{"question": "Guess a number from 1 to 50.", "answer": str(random.Random(i).randint(1, 50))}
                              for i in range(64)])

    class Guess(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **_):
            said = messages[-1]["content"].strip()
            if said == state["answer"]:
                state["final_env_response"] = [vf.UserMessage(content="correct")]
                return state["final_env_response"]
            return [vf.UserMessage(content="higher" if said.isdigit() and int(said) < int(state["answer"]) else "lower")]

    def found(state, **_):
        return 1.0 if state.get("final_env_response") else 0.0

    return Guess(dataset=rows, rubric=vf.Rubric(funcs=[found]), max_turns=7)


def task_of(lib: str) -> Any:
    from tokengym.envs import adapters

    if lib == "gem":
        return adapters.GEMTask("game:GuessTheNumber-v0-hard")
    if lib == "textarena":
        return adapters.TextArenaTask("GuessTheNumber-v0-raw")
    if lib == "openenv":
        env, action = openenv_guess()
        return adapters.OpenEnvTask(env, action, name="openenv/guess")
    return adapters.VerifiersTask(verifiers_guess(), chat=False)


def library_loop(lib: str, episodes: int) -> tuple[int, float]:
    """(turns, seconds) of ``episodes`` scripted episodes in the library's own loop."""
    move, turns = MOVE[lib], 0
    if lib == "verifiers":
        return verifiers_loop(episodes)
    if lib == "gem":
        import gem

        env = gem.make("game:GuessTheNumber-v0-hard")
    elif lib == "textarena":
        import textarena as ta

        env = ta.make("GuessTheNumber-v0-raw")
    else:
        cls, action_cls = openenv_guess()
        env = cls()
    t0 = time.perf_counter()
    for ep in range(episodes):
        done, k = False, 0
        if lib == "textarena":
            env.reset(num_players=1, seed=ep)
            env.get_observation()
        else:
            env.reset(seed=ep)
        while not done:
            k += 1
            text = move.format(k)
            if lib == "gem":
                _, _, term, trunc, _ = env.step(text)
                done = term or trunc
            elif lib == "textarena":
                done, _ = env.step(text)
                env.get_observation()
                if done:
                    env.close()
            else:
                done = env.step(action_cls(guess=text)).done
            turns += 1
    return turns, time.perf_counter() - t0


def verifiers_loop(episodes: int) -> tuple[int, float]:
    """verifiers' own ``run_rollout`` with a client that plays the script."""
    import verifiers as vf

    env = verifiers_guess()
    counter = {"turns": 0}

    class Script(vf.Client):
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kw):
            counter["turns"] += 1
            return str(sum(1 for m in prompt if (m["role"] if isinstance(m, dict) else m.role) == "assistant") + 1)

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            msg = vf.types.ResponseMessage(content=response, finish_reason="stop", is_truncated=False)
            return vf.types.Response(id="s", created=0, model="s", message=msg)

        async def close(self):
            return None

    rows = [dict(r) for r in env.get_dataset()]

    async def run() -> None:
        for ep in range(episodes):
            await env.run_rollout({**rows[ep % len(rows)], "example_id": ep}, Script(None), "s", {})

    t0 = time.perf_counter()
    asyncio.run(run())
    return counter["turns"], time.perf_counter() - t0


def tokengym_loop(lib: str, episodes: int, num_envs: int) -> tuple[int, float]:
    """(turns, seconds) of ``episodes`` scripted episodes through a ``TokenVectorEnv`` of the adapter task."""
    import torch

    from tokengym.envs import TokenVectorEnv

    task = task_of(lib)
    env = TokenVectorEnv(num_envs, task, max_new_tokens=512)
    tok = env.tokenizer
    scripts = {k: tok(MOVE[lib].format(k), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for k in range(1, 51)}
    turns, t0 = 0, time.perf_counter()
    for _ in range(episodes // num_envs):
        env.reset(seed=turns)
        turn, pos = [1] * num_envs, [0] * num_envs
        while not env.all_done:
            acts = []
            for i in range(num_envs):
                if turn[i] > 50:  # past the script: end the turn
                    acts.append(tok.eos_token_id)
                    continue
                acts.append(scripts[turn[i]][pos[i]])
                pos[i] += 1
                if pos[i] == len(scripts[turn[i]]):
                    turn[i], pos[i] = turn[i] + 1, 0
            env.step(torch.tensor(acts))
        turns += int(env.turn_counts["turns"].sum())
    return turns, time.perf_counter() - t0


# -- GRPO learning on one environment of each library ------------------------------------------------------------------

LEARN_MODEL = "tiny-arithmetic"
"""The shipped character-level warm start: it reads ``"12+7+30\\n"`` and writes ``"12+7=19\\n19+30=49\\nA: 49"``."""


def sum3(seed: int) -> tuple[str, int]:
    """A problem of three operands in [0, 99] drawn from ``seed`` (tiny-arithmetic half-solves these: ~45%)."""
    rng = random.Random(seed)
    terms = [rng.randint(0, 99) for _ in range(3)]
    return "+".join(map(str, terms)), sum(terms)


def answered(text: str, answer: int) -> float:
    """1.0 when the text's final line is ``A: <answer>``."""
    last = text.strip().splitlines()[-1:] or [""]
    return 1.0 if last[0].strip() == f"A: {answer}" else 0.0


def gem_sum3() -> str:
    """A GEM env (``gem.core.Env``, registered with ``gem.register``) posing one :func:`sum3` problem per episode."""
    import gem
    from gem.core import Env
    from gem.envs.registration import ENV_REGISTRY
    from gem.utils.constants import TERMINAL_STATE

    class Sum3(Env):
        def reset(self, seed=None):
            super().reset(seed)
            self.question, self.answer = sum3(seed)
            return self.question, {}

        def step(self, action):
            return TERMINAL_STATE, answered(action, self.answer), True, False, {}

    if "tokengym:Sum3-v0" not in ENV_REGISTRY:
        gem.register("tokengym:Sum3-v0", Sum3)
    return "tokengym:Sum3-v0"


def textarena_sum3() -> str:
    """A single-player TextArena game (``ta.Env`` over ``ta.SinglePlayerState``) of one :func:`sum3` problem."""
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY, register

    class Sum3(ta.Env):
        def reset(self, num_players, seed=None):
            self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=1)
            question, self.answer = sum3(seed)
            self.state.reset(game_state={"question": question}, player_prompt_function=lambda player_id, game_state: game_state["question"])

        def step(self, action):
            self.state.add_observation(from_id=0, to_id=-1, message=action, observation_type=ta.ObservationType.PLAYER_ACTION)
            self.state.set_outcome(reward=answered(action, self.answer), reason="answered")
            return self.state.step()

    if "Sum3-v0-raw" not in ENV_REGISTRY:
        register("Sum3-v0-raw", Sum3)
    return "Sum3-v0-raw"


def openenv_sum3() -> Any:
    """An OpenEnv ``Environment`` (in-process) posing one :func:`sum3` problem per episode; its Action class."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class AnswerAction(Action):
        text: str

    class QuestionObservation(Observation):
        question: str = ""

    class Sum3Environment(Environment):
        def reset(self, seed=None, episode_id=None, **_):
            self.question, self.answer = sum3(seed)
            self._state = State()
            return QuestionObservation(question=self.question)

        def step(self, action, timeout_s=None, **_):
            return QuestionObservation(done=True, reward=answered(action.text, self.answer))

        @property
        def state(self):
            return self._state

    return Sum3Environment, AnswerAction


def verifiers_sum3(rows: int = 2000, eval_rows: int = 512) -> Any:
    """A verifiers ``SingleTurnEnv`` over :func:`sum3` problems (train rows from seeds 0.., eval rows from seeds
    10**6..), scored by a rubric on the completion's last line."""
    import verifiers as vf
    from datasets import Dataset

    def data(seeds: range) -> Any:
        return Dataset.from_list([{"question": q, "answer": str(a)} for q, a in map(sum3, seeds)])

    parser = vf.Parser()

    def correct(completion, answer, **_):
        return answered(parser.parse_answer(completion) or "", int(answer))

    return vf.SingleTurnEnv(dataset=data(range(rows)), eval_dataset=data(range(10**6, 10**6 + eval_rows)),
                            parser=parser, rubric=vf.Rubric(funcs=[correct], parser=parser))


def learn_tasks(lib: str) -> tuple[Any, Any, str]:
    """(training task, held-out task, env id) of ``lib``'s arithmetic env, as tokengym sees them."""
    from tokengym.envs import adapters

    if lib == "gem":
        env_id = gem_sum3()
        task = adapters.GEMTask(env_id)
        return task, task, env_id
    if lib == "textarena":
        env_id = textarena_sum3()
        task = adapters.TextArenaTask(env_id)
        return task, task, env_id
    if lib == "openenv":
        env, action = openenv_sum3()
        task = adapters.OpenEnvTask(env, action, name="openenv/sum3")
        return task, task, "Sum3Environment (in-process)"
    env = verifiers_sum3()
    return adapters.VerifiersTask(env, chat=False), adapters.VerifiersTask(env, eval=True, chat=False), "SingleTurnEnv(sum3)"


def learn_one(lib: str, steps: int, seed: int, prompts: int, group: int, heldout: int, lr: float) -> dict[str, Any]:
    """GRPO on ``lib``'s env from :data:`LEARN_MODEL`: greedy held-out reward and accuracy before and after."""
    import torch

    from tokengym.agents import GRPOAgent, GRPOConfig, Policy
    from tokengym.agents.engine.rollout import evaluate, heldout_samples
    from tokengym.envs import TokenVectorEnv

    torch.set_num_threads(1)
    task, eval_task, env_id = learn_tasks(lib)
    policy = Policy.from_pretrained(LEARN_MODEL, seed=seed)
    samples = heldout_samples(eval_task, heldout)
    eval_env = TokenVectorEnv(64, eval_task, max_new_tokens=32, tokenizer=policy.tokenizer, autoreset_mode="next_step")
    before = evaluate(policy, eval_env, samples)
    env = TokenVectorEnv(prompts * group, task, group_size=group, max_new_tokens=32, tokenizer=policy.tokenizer)
    t0 = time.perf_counter()
    GRPOAgent(policy, GRPOConfig(steps=steps, lr=lr, seed=seed, eval_every=0)).learn(env)
    seconds = time.perf_counter() - t0
    after = evaluate(policy, eval_env, samples)
    pick = ("mean_reward", "accuracy")
    return {"env_id": env_id, "model": LEARN_MODEL, "steps": steps, "seed": seed, "train_seconds": round(seconds, 1),
            "before": {k: round(before[k], 4) for k in pick}, "after": {k: round(after[k], 4) for k in pick}}


def one(lib: str, side: str, episodes: int, num_envs: int) -> dict[str, float]:
    task_of(lib) if side == "tokengym" else None  # imports and the prompt measurement stay outside the timing
    turns, secs = tokengym_loop(lib, episodes, num_envs) if side == "tokengym" else library_loop(lib, episodes)
    return {"turns": turns, "seconds": secs, "turns_per_s": turns / secs}


def learn_all(libraries: list[str], seeds: list[int], learn: list[str], quiet: bool) -> dict[str, Any]:
    """``{library: {env_id, model, steps, seeds, before, after, runs}}``: one process per (library, seed), in turn."""
    steps, prompts, group, heldout, lr = learn
    out: dict[str, Any] = {}
    for lib in libraries:
        runs = []
        for seed in seeds:
            try:
                runs.append(run_child(__file__, ["--learn", "--one", lib, str(seed), "--steps", steps, "--prompts", prompts,
                                                 "--group-size", group, "--heldout", heldout, "--lr", lr]))
            except RuntimeError as e:
                runs.append({"seed": seed, "error": str(e).splitlines()[0]})
        ok = [r for r in runs if "error" not in r]
        out[lib] = {"env_id": ok[0]["env_id"] if ok else None, "model": LEARN_MODEL, "steps": int(steps), "seeds": seeds,
                    "before": [r["before"]["mean_reward"] for r in ok], "after": [r["after"]["mean_reward"] for r in ok],
                    "runs": runs}
        if not quiet:
            print(f"{lib:10s} {out[lib]['env_id']}: held-out reward before {out[lib]['before']} after {out[lib]['after']}",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line (the default prints a table too)")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--learn", action="store_true", help="GRPO on one arithmetic env of each library: held-out before/after")
    ap.add_argument("--steps", type=int, default=150, help="--learn: GRPO steps")
    ap.add_argument("--seeds", default="0,1", help="--learn: training seeds, one run each")
    ap.add_argument("--prompts", type=int, default=8, help="--learn: prompts per step (each a group)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=256, help="--learn: held-out prompts, greedy")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--one", nargs=2, metavar=("LIBRARY", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    learn = [str(a) for a in (args.steps, args.prompts, args.group_size, args.heldout, args.lr)]
    if args.one:
        lib, side = args.one
        out = (learn_one(lib, args.steps, int(side), args.prompts, args.group_size, args.heldout, args.lr) if args.learn
               else one(lib, side, args.episodes, args.num_envs))
        print(json.dumps(out))
        return
    if args.learn:
        print(json.dumps(learn_all(args.libraries.split(","), [int(s) for s in args.seeds.split(",")], learn, args.json)))
        return
    out: dict[str, Any] = {}
    for lib in args.libraries.split(","):
        common = ["--episodes", str(args.episodes), "--num-envs", str(args.num_envs)]
        try:
            mine = run_child(__file__, ["--one", lib, "library", *common])
            ours = run_child(__file__, ["--one", lib, "tokengym", *common])
        except RuntimeError as e:
            out[lib] = {"error": str(e).splitlines()[0]}
            continue
        out[lib] = {"library_turns_per_s": round(mine["turns_per_s"], 1), "tokengym_turns_per_s": round(ours["turns_per_s"], 1),
                    "ratio": round(ours["turns_per_s"] / mine["turns_per_s"], 3)}
        if not args.json:
            print(f"{lib:10s} library {mine['turns_per_s']:10.1f} turns/s   tokengym {ours['turns_per_s']:10.1f} turns/s   "
                  f"ratio {out[lib]['ratio']:.3f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

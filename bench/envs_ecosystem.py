"""Env turns per second through tokengym's adapters against each library's own rollout loop, same scripted policy.

A scripted player guesses 1, 2, 3, ... in a guess-the-number game of each library (GEM's and TextArena's own games; a
small OpenEnv ``Environment`` and a verifiers ``MultiTurnEnv``, since neither package ships a text environment), so
both sides see the same turns. The library side is its own loop: ``reset``/``step`` (GEM, TextArena, OpenEnv
in-process) or ``Environment.run_rollout`` with a scripted client (verifiers). The tokengym side is a
``TokenVectorEnv`` of the adapter task fed the same turns one token at a time (each turn ended by EOS), so it also
pays for tokenizing, the token buffers and the reply bookkeeping. Each contender runs in its own process::

    python bench/envs_ecosystem.py --json [--episodes 64] [--num-envs 16]

Prints ``{library: {"library_turns_per_s", "tokengym_turns_per_s", "ratio"}}`` (ratio = tokengym / library).
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


def one(lib: str, side: str, episodes: int, num_envs: int) -> dict[str, float]:
    task_of(lib) if side == "tokengym" else None  # imports and the prompt measurement stay outside the timing
    turns, secs = tokengym_loop(lib, episodes, num_envs) if side == "tokengym" else library_loop(lib, episodes)
    return {"turns": turns, "seconds": secs, "turns_per_s": turns / secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line (the default prints a table too)")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--one", nargs=2, metavar=("LIBRARY", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.episodes, args.num_envs)))
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

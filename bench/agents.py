"""Agent envs' throughput: the same task as a native env and as an OpenAI-client agent (in process, and over HTTP).

    python bench/agents.py --json [--batch 64] [--repeats 2] [--warmup 1] [--threads 1] [--model smollm2-135m-instruct]

The task: ``GuessNumber-v0`` in chat form (``chat=True``) for SmolLM2-135M-Instruct, a multi-turn game: each turn is
a guess, answered "Higher." or "Lower." as a user message (up to 8 turns). The agent (:func:`guess_agent`) plays the
same game through the ``openai`` client, so both sides meet the same samples and render the same tokens (the native
env's reward counts a hit on any line, the agent's on the turn's last number: the work per episode is the same).
Contenders, each in its own fresh process (``bench/_isolate.py``), one after the other: **native**
(``TokenVectorEnv(batch, "guess_number", chat=True)``), **agent** (``AgentTask``, ``transport="inproc"``: the
client's requests reach the env without a socket) and **http** (``transport="http"``: the same over loopback HTTP).
Each runs ``--warmup`` rollouts of ``--batch`` episodes (sampled, seeded alike), then ``--repeats`` timed ones;
reports episodes/s and decode tokens/s (the model's tokens) of the best timed rollout, the replies per episode, and
``agent_vs_native`` / ``http_vs_native``: the agent sides' episodes/s over native's (goals: at least 0.8 and 0.6).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _isolate import run_child  # noqa: E402


def guess_agent(client, sample):
    """GuessNumber as an agent: guesses until right or 8 turns, told "Higher."/"Lower." as user messages."""
    import re

    messages = [dict(m) for m in sample["prompt"]]
    for turn in range(8):
        reply = client.chat.completions.create(model="tokengym", messages=messages).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        found = re.findall(r"-?\d+", reply.content or "")
        if not found:
            messages.append({"role": "user", "content": "Please reply with just a number."})
        elif int(found[-1]) == sample["answer"]:
            return max(0.1, 1.0 - 0.1 * turn)
        else:
            messages.append({"role": "user", "content": "Higher." if int(found[-1]) < sample["answer"] else "Lower."})
    return 0.0


def one(side: str, args: argparse.Namespace) -> dict:
    import torch

    from tokengym.agents import Policy, collect
    from tokengym.envs import AgentTask, TokenVectorEnv
    from tokengym.envs.tasks import GuessNumberTask

    torch.set_num_threads(args.threads)
    policy = Policy.from_pretrained(args.model)
    task = GuessNumberTask(chat=True)
    native = TokenVectorEnv(args.batch, task, tokenizer=policy.tokenizer)
    if side == "native":
        env = native
    else:
        agent = AgentTask(guess_agent, task, max_new_tokens=native.max_new_tokens, max_turns=task.max_turns,
                          transport="inproc" if side == "agent" else "http")
        env = TokenVectorEnv(args.batch, agent, tokenizer=policy.tokenizer, max_prompt_len=native.max_prompt_len)
    runs = []
    for i in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        ro = collect(env, policy, seed=i)
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            runs.append({"seconds": dt, "episodes_per_s": args.batch / dt,
                         "decode_tokens_per_s": float(ro.action_mask.sum()) / dt,
                         "replies_per_episode": ro.turn_stats["replies"] / args.batch})
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", choices=["native", "agent", "http"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args)))
        return
    flags = ["--batch", str(args.batch), "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--threads",
             str(args.threads), "--model", args.model]
    result = {side: run_child(__file__, ["--one", side, *flags]) for side in ("native", "agent", "http")}
    result["agent_vs_native"] = result["agent"]["episodes_per_s"] / result["native"]["episodes_per_s"]
    result["http_vs_native"] = result["http"]["episodes_per_s"] / result["native"]["episodes_per_s"]
    result["load_avg"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    else:
        for side in ("native", "agent", "http"):
            r = result[side]
            print(f"{side:7s} {r['episodes_per_s']:7.2f} episodes/s {r['decode_tokens_per_s']:8.1f} decode tokens/s "
                  f"({r['replies_per_episode']:.2f} replies per episode)")
        print(f"agent_vs_native {result['agent_vs_native']:.2f}  http_vs_native {result['http_vs_native']:.2f}")


if __name__ == "__main__":
    main()

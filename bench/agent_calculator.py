"""The Calculator task as an OpenAI-client agent, trained with GRPO, against the native ``Calculator-v0`` run.

    python bench/agent_calculator.py [--seeds 0 1 2] [--steps 100] [--json]

The agent (``calculator_agent`` below, also what the README shows) calls a ``calculate`` tool through the ``openai``
client; the agent env renders it in tiny-calculator's own format (``<calc>38+87</calc>``, answered ``=125``), so both
runs start from the same warm start on the same token format. Each run is ``tokengym train grpo`` from
``tiny-calculator`` in its own process, then ``tokengym eval`` of its model on the native env's 256 held-out prompts;
prints each seed's held-out greedy accuracy, the mean and spread of each side, and the difference of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from tokengym.envs import agent_env
from tokengym.envs.adapters import PlainFormat, TagTools
from tokengym.envs.tasks.tools import calculate
from tokengym.rewards import arithmetic_correct

CALCULATE = {"type": "function", "function": {
    "name": "calculate", "description": "the value of an integer expression of + - *",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TINY_CALCULATOR_FORMAT = PlainFormat(TagTools("<calc>", "</calc>", "calculate", "expression"), prefix={"tool": "="})


@agent_env(data="calculator", format=TINY_CALCULATOR_FORMAT, max_new_tokens=102, max_turns=6)
def calculator_agent(client, sample):
    """Solve one problem, calling ``calculate`` as often as the model asks; 1 if the final answer is right."""
    messages = [{"role": "user", "content": sample["prompt"].strip()}]
    for _ in range(6):
        reply = client.chat.completions.create(model="tokengym", messages=messages, tools=[CALCULATE]).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return arithmetic_correct([], [reply.content or ""], answer=[sample["answer"]])[0]
        for call in reply.tool_calls:
            value = calculate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
    return 0.0


def run(env: str, seed: int, steps: int, runs: str) -> float:
    name = f"{re.sub(r'[^a-z0-9]+', '-', env.lower())}-{seed}"
    here = os.path.dirname(os.path.abspath(__file__))
    envs = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    train = [sys.executable, "-m", "tokengym.agents.cli", "train", "grpo", "--env", env, "--model", "tiny-calculator",
             "--steps", str(steps), "--seed", str(seed), "--runs-dir", runs, "--name", name, "--progress", "false",
             "--threads", "1"]
    subprocess.run(train, check=True, env=envs, capture_output=True, text=True)
    out = subprocess.run([sys.executable, "-m", "tokengym.agents.cli", "eval", "--model", os.path.join(runs, name, "model"),
                          "--env", "tokengym/Calculator-v0", "--prompts", "256", "--samples", "0"],
                         check=True, env=envs, capture_output=True, text=True).stdout
    return float(re.search(r"greedy\s+([\d.]+)%", out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as runs:
        for side, env in (("native", "tokengym/Calculator-v0"), ("agent", "agent_calculator:calculator_agent")):
            result[side] = [run(env, s, args.steps, runs) for s in args.seeds]
            print(f"{side:7s} held-out greedy accuracy: " + ", ".join(f"{a:.1f}%" for a in result[side])
                  + f"  (mean {statistics.mean(result[side]):.1f}%, spread {max(result[side]) - min(result[side]):.1f})",
                  flush=True)
    result["agent_minus_native"] = statistics.mean(result["agent"]) - statistics.mean(result["native"])
    print(f"agent - native, mean held-out accuracy: {result['agent_minus_native']:+.1f} points")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

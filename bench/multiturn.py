"""Multi-turn rollouts: tokengym's engine (``collect`` on a multi-turn env) against a per-turn HF ``generate`` loop.

    python bench/multiturn.py --json [--presets tiny small] [--batch 64] [--repeats 2] [--warmup 2] [--threads 1]

Prints one JSON line (``--json``) or a short table. Each contender runs in its own fresh process
(``bench/_isolate.py``), one after the other for each preset, in the same run; ``--warmup`` rollouts, then
``--repeats`` timed ones.

The task (:class:`BenchCalc`, defined here): a calculator-like tool for a random-weight model, which would almost
never write ``<calc>``. Prompts are ``"38+87\\n"``; an agent turn ends at any of 13 frequent characters (``A`` to
``M``: about one sampled token in eight), and the tool answers it with a deterministic ``=VALUE`` and a newline
(3-8 characters, a function of the turn's text); a turn that ends without one (EOS) ends the episode. Both
contenders run the same episodes: ``--batch`` (64) episodes per rollout, a budget of ``--max-new-tokens`` (96)
tokens per episode for the agent's and the env's tokens together, at most ``--max-turns`` (8) agent turns, the
env's rules for the ends (a reply that does not fit the budget truncates the episode, as does the last turn),
pure sampling at temperature 1, the same preset model (random init) and the same prompts (the same seeds):

* **tokengym**: ``collect(env, policy)``: one lockstep batch; when an agent turn ends the env appends the
  reply's tokens to that row and ``Policy.extend`` prefills only those tokens into the row's static KV cache
  (``StaticDecoder.extend``), while the other rows keep decoding.
* **hf**: the loop most libraries run: per round, ``model.generate`` for every unfinished episode (left-padded,
  ``do_sample=True, temperature=1, top_k=0, top_p=1``, ``stop_strings=`` the turn's stop characters with
  ``tokenizer=``, EOS, and a per-row ``StoppingCriteria`` for each episode's remaining budget, so no row
  samples past it), each row stopping at its own stop; then decode each turn to text, let the task answer in
  text, append the reply to the episode's text, re-tokenize the whole history and re-prefill it in the next
  round's ``generate``.

Sampled episodes differ between the engines, so the comparison is throughput: episode tokens (agent and env
tokens of the finished episodes) per second. ``<preset>_speedup`` is tokengym's tokens/s over hf's (best run of
each; ``_median`` from the medians); the turns, replies and tokens per episode of each side show that the work is
comparable. ``<preset>_tokengym_decode_steps`` is the lockstep batch's steps (its longest episode's agent
tokens), ``<preset>_hf_decode_steps`` the summed lengths of the ``generate`` calls (every round waits for its
slowest row) and ``<preset>_hf_reprefill_tokens`` the history tokens ``generate`` re-encoded after the first round.
``<preset>_logprob_maxdiff``: the largest absolute difference, over the agent's tokens (``ro.action_mask``),
between the log-probs tokengym's rollout recorded and those of one full forward
(``trimmed_logprobs(policy, ro)``) on its last timed rollout.

``--threads`` defaults to 1 (see ``bench/rollout.py``: on a shared 2-core machine two OpenMP threads made both
contenders erratic). ``load_avg`` (1-minute, start and end) is reported; rerun when it is high.

What was found (2026-12-03, 1 thread, batch 64, ~3 minutes in all, two runs): tokengym 3.2-3.5x (tiny) and
4.1-4.4x (small) the hf loop's tokens/s, with 5.5-5.9 turns and 60-63 tokens per episode on both sides. The hf
loop's time goes to lockstep waiting (each ``generate`` round lasts as long as its slowest row's turn: ~220 decode steps per batch
against tokengym's ~72, 8 rounds, one per turn) and, on small, to re-encoding the histories (~14k tokens; about
13 of its 28 s in the prefill forwards). tokengym small (6.1-6.6 s): ~62% decode steps, ~28% ``extend`` (reply
prefills on ~62 of ~70 steps), ~2% the env (replies, stop checks). Its decode steps run every row, finished
episodes included, and only ~53% of the decoded row-steps are live agent tokens (37-39 agent tokens per episode
over ~72 steps). ``stop_strings`` costs ``generate`` nothing measurable here (5.3 ms per step with stop strings and
with the stops as ``eos_token_id``, tiny, batch 64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from tokengym.agents.engine.models import build_preset
from tokengym.envs import Task

STOP_CHARS = "ABCDEFGHIJKLM"
"""Turn stops: 13 of the 101 tokens. Capitals, because HF's ``StopStringCriteria`` also stops on a token whose
text contains a stop string followed by more characters, so ``a`` would stop at a sampled ``<pad>``."""


class BenchCalc(Task):
    """A calculator-like tool that a random-weight model calls often (see the module docstring).

    Turns end at any of :data:`STOP_CHARS`; the reply is ``=VALUE`` and a newline, ``VALUE`` a deterministic
    function of the turn's text with 1-6 digits (so replies are 3-8 characters and never contain a stop character).
    """

    name = "bench_calc"
    turn_stop_strings = tuple(STOP_CHARS)
    max_prompt_chars = 6
    default_max_new_tokens = 96
    max_turns = 8

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        a, b = (int(x) for x in rng.integers(10, 100, 2))
        return {"prompt": f"{a}+{b}\n", "answer": a + b}

    def respond(self, sample: dict[str, Any], history: list[str]) -> str | None:
        turn = history[-1]
        if not turn.endswith(self.turn_stop_strings):
            return None  # the turn ended with EOS: the episode is over
        value = sum((i + 1) * ord(c) for i, c in enumerate(turn)) % 10 ** (1 + len(turn) % 6)
        return f"={value}\n"

    def reward(self):
        return zero_reward


def zero_reward(prompts, completions, **_):
    return [0.0] * len(completions)


def make_task(max_turns: int) -> BenchCalc:
    task = BenchCalc()
    task.max_turns = max_turns
    return task


# ---------------------------------------------------------------------------------------------- tokengym
def tokengym_run(preset: str, n: int, budget: int, max_turns: int, warmup: int, repeats: int) -> dict:
    from tokengym.agents.engine.policy import Policy
    from tokengym.agents.engine.rollout import collect, trimmed_logprobs
    from tokengym.envs import TokenVectorEnv

    model, tok = build_preset(preset, seed=0)
    model.eval()
    policy = Policy(model, tok, seed=0)
    env = TokenVectorEnv(n, make_task(max_turns), tokenizer=tok, max_new_tokens=budget)
    runs = []
    for r in range(warmup + repeats):
        policy.seed(r)
        t0 = time.perf_counter()
        ro = collect(env, policy, seed=r)
        dt = time.perf_counter() - t0
        if not bool((ro.terminated | ro.truncated).all()):
            raise RuntimeError("tokengym: some episodes did not finish")
        if r >= warmup:
            st = ro.turn_stats
            runs.append({"seconds": dt, "tokens": int(ro.episode_lengths.sum()), "agent_tokens": int(ro.lengths.sum()),
                         "turns": st["turns"], "replies": st["replies"], "decode_steps": int(ro.lengths.max()),
                         "truncated": int(ro.truncated.sum()), "fast_path": policy.fast_path_active})
    with torch.no_grad():
        full = trimmed_logprobs(policy, ro)
    diff = float(((full - ro.logprobs).abs() * ro.action_mask).max())
    return {"runs": runs, "logprob_maxdiff": diff}


# ---------------------------------------------------------------------------------------------- hf loop
def hf_run(preset: str, n: int, budget: int, max_turns: int, warmup: int, repeats: int) -> dict:
    model, tok = build_preset(preset, seed=0)
    model.eval()
    tok.padding_side = "left"
    task = make_task(max_turns)
    runs = []
    for r in range(warmup + repeats):
        torch.manual_seed(r)
        t0 = time.perf_counter()
        stats = hf_episodes(model, tok, task, n, budget, seed=r)
        stats["seconds"] = time.perf_counter() - t0
        if r >= warmup:
            runs.append(stats)
    return {"runs": runs}


def hf_episodes(model, tok, task: BenchCalc, n: int, budget: int, seed: int) -> dict:
    """One batch of ``n`` episodes with a per-turn ``generate`` loop (see the module docstring); its counts."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RowBudget(StoppingCriteria):
        """Row ``i`` is done once it has generated ``left[i]`` tokens (its episode's remaining budget)."""

        def __init__(self, width: int, left: torch.Tensor):
            self.width, self.left = width, left

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
            return (input_ids.shape[1] - self.width) >= self.left

    eos, pad = tok.eos_token_id, tok.pad_token_id
    stop_ids = {eos} | {tok.convert_tokens_to_ids(c) for c in task.turn_stop_strings}
    samples = task.batch(np.random.default_rng(seed), n)  # the prompts env.reset(seed=seed) draws
    texts = [s["prompt"] for s in samples]  # each episode's whole text so far
    history: list[list[str]] = [[] for _ in range(n)]
    used = [0] * n  # episode tokens after the prompt (agent and env)
    live = list(range(n))
    c = {"tokens": 0, "agent_tokens": 0, "turns": 0, "replies": 0, "truncated": 0, "decode_steps": 0,
         "generate_calls": 0, "reprefill_tokens": 0}
    while live:
        enc = tok([texts[i] for i in live], return_tensors="pt", padding=True, add_special_tokens=True)
        width = enc["input_ids"].shape[1]
        if c["generate_calls"]:
            c["reprefill_tokens"] += int(enc["attention_mask"].sum())
        left = torch.tensor([budget - used[i] for i in live])
        with torch.inference_mode():
            out = model.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=int(left.max()),
                stop_strings=list(task.turn_stop_strings), tokenizer=tok, eos_token_id=eos, pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([RowBudget(width, left)]), use_cache=True,
            )
        gen = out[:, width:].tolist()
        c["generate_calls"] += 1
        c["decode_steps"] += len(gen[0])
        still = []
        for j, i in enumerate(live):
            row, cap = gen[j], int(left[j])
            k = next((k for k, t in enumerate(row[:cap]) if t in stop_ids), None)
            ids = row[: k + 1] if k is not None else row[:cap]
            if k is None and len(ids) != cap:
                raise RuntimeError(f"hf: row {i} stopped after {len(ids)} of {cap} tokens without a stop")
            used[i] += len(ids)
            c["tokens"] += len(ids)
            c["agent_tokens"] += len(ids)
            if k is None:  # the budget ran out mid-turn: truncated
                c["truncated"] += 1
                continue
            said = tok.decode(ids, skip_special_tokens=True)
            history[i].append(said)
            c["turns"] += 1
            reply = task.respond(samples[i], history[i])
            if reply is None:  # terminated
                continue
            reply_ids = tok(reply, add_special_tokens=False)["input_ids"]
            if len(history[i]) // 2 + 1 >= task.max_turns or len(reply_ids) >= budget - used[i]:  # the env's rules
                c["truncated"] += 1
                continue
            history[i].append(reply)
            texts[i] += said + reply
            used[i] += len(reply_ids)
            c["tokens"] += len(reply_ids)
            c["replies"] += 1
            still.append(i)
        live = still
    return c


CONTENDERS = {"tokengym": tokengym_run, "hf": hf_run}


def summarise(preset: str, name: str, res: dict, n: int) -> dict:
    runs = res["runs"]
    rates = [r["tokens"] / r["seconds"] for r in runs]
    best = max(range(len(runs)), key=lambda k: rates[k])

    def tot(key: str) -> float:  # per episode, averaged over the runs
        return sum(r[key] for r in runs) / len(runs) / n

    p = f"{preset}_{name}"
    out = {f"{p}_tok_s": round(rates[best], 1), f"{p}_tok_s_median": round(statistics.median(rates), 1),
           f"{p}_s": round(runs[best]["seconds"], 3), f"{p}_s_runs": [round(r["seconds"], 3) for r in runs],
           f"{p}_tokens_per_episode": round(tot("tokens"), 2),
           f"{p}_agent_tokens_per_episode": round(tot("agent_tokens"), 2),
           f"{p}_turns_per_episode": round(tot("turns"), 2), f"{p}_replies_per_episode": round(tot("replies"), 2),
           f"{p}_truncated_fraction": round(tot("truncated"), 3),
           f"{p}_decode_steps": round(statistics.mean(r["decode_steps"] for r in runs), 1)}
    if name == "hf":
        out[f"{p}_generate_calls"] = round(statistics.mean(r["generate_calls"] for r in runs), 1)
        out[f"{p}_reprefill_tokens"] = round(statistics.mean(r["reprefill_tokens"] for r in runs), 1)
    else:
        out[f"{preset}_logprob_maxdiff"] = res["logprob_maxdiff"]
        out[f"{p}_fast_path"] = all(r["fast_path"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=64, help="episodes per rollout")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="episode token budget (agent and env tokens)")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rollouts first")
    ap.add_argument("--repeats", type=int, default=2, help="timed rollouts per contender (best and median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the module docstring)")
    ap.add_argument("--one", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)  # a contender, in a child process
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = (args.batch, args.max_new_tokens, args.max_turns, args.warmup, args.repeats)
    if args.one:
        print(json.dumps(CONTENDERS[args.one](args.presets[0], *work)))
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _isolate import run_child

    import transformers

    result: dict[str, Any] = {"transformers_version": transformers.__version__, "threads": args.threads,
                              "batch": args.batch, "max_new_tokens": args.max_new_tokens, "max_turns": args.max_turns,
                              "turn_stops": STOP_CHARS, "warmup": args.warmup, "repeats": args.repeats,
                              "load_avg": [round(os.getloadavg()[0], 2)]}
    t_all = time.perf_counter()
    for preset in args.presets:
        for name in CONTENDERS:
            argv = ["--one", name, "--presets", preset, "--batch", str(args.batch),
                    "--max-new-tokens", str(args.max_new_tokens), "--max-turns", str(args.max_turns),
                    "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            result.update(summarise(preset, name, run_child(os.path.abspath(__file__), argv), args.batch))
        result[f"{preset}_speedup"] = round(result[f"{preset}_tokengym_tok_s"] / result[f"{preset}_hf_tok_s"], 3)
        result[f"{preset}_speedup_median"] = round(
            result[f"{preset}_tokengym_tok_s_median"] / result[f"{preset}_hf_tok_s_median"], 3)
    result["load_avg"].append(round(os.getloadavg()[0], 2))
    result["bench_seconds"] = round(time.perf_counter() - t_all, 1)
    if args.json:
        print(json.dumps(result))
        return
    print(f"threads={args.threads}  batch={args.batch}  budget={args.max_new_tokens}  max_turns={args.max_turns}  "
          f"load {result['load_avg']}")
    for preset in args.presets:
        for name in CONTENDERS:
            p = f"{preset}_{name}"
            print(f"{preset:6s} {name:9s} {result[f'{p}_tok_s']:9.1f} tok/s (median {result[f'{p}_tok_s_median']:9.1f})  "
                  f"{result[f'{p}_s']:7.3f} s  turns/ep {result[f'{p}_turns_per_episode']:.2f}  "
                  f"tokens/ep {result[f'{p}_tokens_per_episode']:.1f}  decode steps {result[f'{p}_decode_steps']}")
        print(f"{preset}_speedup = {result[f'{preset}_speedup']} (median {result[f'{preset}_speedup_median']}), "
              f"logprob maxdiff {result[f'{preset}_logprob_maxdiff']:.2e}")


if __name__ == "__main__":
    main()

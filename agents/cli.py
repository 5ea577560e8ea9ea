"""The ``tokengym`` command.

    tokengym envs                      list the registered environment ids
    tokengym sample [--env ID] [...]   drive an env with a scripted policy and print completions, rewards, step scores

``sample`` policies: ``reference`` replays each prompt's reference solution token by token (a scripted
policy that should score ~1.0), ``random`` emits uniformly random tokens (scores ~0).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

__all__ = ["main"]


def _cmd_envs(args: argparse.Namespace) -> int:
    from tokengym.envs import ENV_IDS

    width = max(len(k) for k in ENV_IDS)
    for env_id, (_, desc) in ENV_IDS.items():
        print(f"{env_id:<{width}}  {desc}")
    return 0


def scripted_rollout(env, policy: str, generator: torch.Generator) -> None:
    """Run one lockstep batch of ``env`` (already reset) to the end with a scripted policy."""
    tok = env.tokenizer
    if policy == "reference":
        plans = [tok(s.get("solution", ""), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in env.samples]
    for t in range(env.max_new_tokens):
        if policy == "reference":
            acts = torch.tensor([p[t] if t < len(p) else tok.eos_token_id for p in plans], device=env.device)
        else:
            acts = torch.randint(0, env.vocab_size, (env.num_envs,), generator=generator).to(env.device)
        env.step(acts)
        if bool(env.done.all()):
            break


def _cmd_sample(args: argparse.Namespace) -> int:
    import gymnasium as gym

    import tokengym.envs  # noqa: F401  (registers the ids)

    if args.env not in gym.registry:
        print(f"tokengym: unknown env id {args.env!r}; run `tokengym envs` for the list", file=sys.stderr)
        return 2
    make = lambda **kw: gym.make_vec(args.env, num_envs=args.num, vectorization_mode="vector_entry_point", **kw)
    try:
        env = make(process_reward=True) if args.prm else make()
    except ValueError as e:  # the task has no process reward: sample without one
        if "no process reward" not in str(e):
            raise
        args.prm, env = False, make()
    gen = torch.Generator().manual_seed(args.seed)
    for policy in args.policy:
        env.reset(seed=args.seed)
        scripted_rollout(env, policy, gen)
        print(f"== policy: {policy}   env: {args.env}")
        for i in range(env.num_envs):
            prompt = env.samples[i]["prompt"].strip().replace("\n", " | ")
            completion = (env.completions[i] or "").replace("\n", " | ")
            flag = "terminated" if bool(env.terminated[i]) else "truncated"
            steps = f"  steps={env.step_scores[i]}" if args.prm else ""
            print(f"[{i}] {prompt!r} -> {completion!r}  reward={float(env.outcome[i]):.2f} ({flag}){steps}")
        print(f"mean outcome reward: {env.outcome.mean().item():.3f}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokengym", description="RL post-training of language models as Gymnasium envs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("envs", help="list registered environment ids")
    p.set_defaults(fn=_cmd_envs)
    p = sub.add_parser("sample", help="roll out a scripted policy and print completions with their rewards")
    p.add_argument("--env", default="tokengym/Arithmetic-v0", help="registered env id")
    p.add_argument("--num", type=int, default=4, help="number of episodes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", nargs="+", choices=["reference", "random"], default=["random", "reference"])
    p.add_argument("--no-prm", dest="prm", action="store_false", help="turn the process reward off")
    p.set_defaults(fn=_cmd_sample)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

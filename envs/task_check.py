"""``check_task``: the conformance check of a task (bundled, your own, or an adapter's) on the token-level env.

Beyond the Gymnasium vector API (:func:`~tokengym.envs.vector_check.check_vector_env`, in
:mod:`tokengym.envs.vector_check`), a task must keep the rules the agents rely on, each checked on scripted episodes
(the reference solution where the task has one, random tokens):

* ``replies-are-context``: the agent's tokens, and only they, have ``action_mask`` 1; env replies are context;
* ``rewards-on-actions``: every per-token reward sits on a column the agent wrote;
* ``rewards-finite``: no reward is NaN or inf;
* ``no-special-tokens``: env text never becomes a special token (a reply holding ``"<|im_end|>"`` or ``"</s>"`` as
  text stays text), apart from the chat template's own role markers around a reply;
* ``deterministic``: ``reset(seed=s)`` and the same actions give the same episodes.

A broken rule raises ``AssertionError`` whose message starts with the rule's name.
"""

from __future__ import annotations

from typing import Any

import torch

from tokengym.envs.vector_check import within_masks

__all__ = ["check_task", "scripted_rollout", "RULES"]

RULES = ("replies-are-context", "rewards-on-actions", "rewards-finite", "no-special-tokens", "deterministic")


def scripted_rollout(env: Any, policy: str, generator: torch.Generator) -> list[tuple[int, int]]:
    """Run one lockstep batch of ``env`` (already reset) to the end with a scripted policy: ``"reference"`` replays
    each sample's solution (a multi-turn one's agent turns), ``"random"`` emits uniformly random tokens. Returns the
    ``(row, generated column)`` of every action the env took."""
    tok = env.tokenizer
    if policy == "reference":  # a multi-turn solution: only the agent's turns (the env writes its replies)
        plans = [[t for turn in (s["solution_turns"][::2] if s.get("solution_turns") else [s.get("solution", "")])
                  for t in tok(turn, add_special_tokens=False)["input_ids"]] + [tok.eos_token_id] for s in env.samples]
        pos = torch.zeros(env.num_envs, dtype=torch.long)
    taken: list[tuple[int, int]] = []
    for _ in range(env.max_new_tokens):
        if policy == "reference":
            acts = torch.tensor([p[k] if k < len(p) else tok.eos_token_id for p, k in zip(plans, pos.tolist())], device=env.device)
        else:
            acts = torch.randint(0, env.vocab_size, (env.num_envs,), generator=generator).to(env.device)
            if getattr(env, "masker", None) is not None:  # random among the allowed tokens
                acts = within_masks(env, acts)
        live = (~(env.done | getattr(env, "waiting", env.done))).cpu()  # rows whose action the env takes
        taken += [(r, c) for r, c in zip(live.nonzero().flatten().tolist(), env.gen_len.cpu()[live].tolist())]
        if policy == "reference":
            pos += live.long()
        env.step(acts)
        if bool(env.done.all()):
            break
    return taken


def _make(task_or_env: Any, num_envs: int, tokenizer: Any) -> Any:
    from tokengym.envs.vector_env import TokenVectorEnv

    if isinstance(task_or_env, TokenVectorEnv):
        return task_or_env
    return TokenVectorEnv(num_envs, task_or_env, tokenizer=tokenizer)


def _episodes(env: Any, policy: str, seed: int) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    env.reset(seed=seed)
    try:
        taken = scripted_rollout(env, policy, torch.Generator().manual_seed(seed))
    except ValueError as e:  # the env's own checks refuse a NaN reward (outcome, process or turn) as it comes
        if "finite" in str(e):
            raise _fail("rewards-finite", env, f"{str(e).splitlines()[0]} ({policy} policy)") from None
        raise
    names = ("tokens", "attention_mask", "action_mask", "rewards", "process_rewards", "turn_rewards", "outcome")
    return {k: getattr(env, k).detach().cpu().clone() for k in names}, taken


def _fail(rule: str, env: Any, detail: str) -> AssertionError:
    return AssertionError(f"{rule}: task {getattr(env.task, 'name', type(env.task).__name__)!r}: {detail}")


def _check_episodes(env: Any, ep: dict[str, torch.Tensor], taken: list[tuple[int, int]], policy: str) -> None:
    P = env.max_prompt_len
    acted = torch.zeros_like(ep["action_mask"][:, P:])
    for r, c in taken:
        acted[r, c] = True
    marked = ep["action_mask"][:, P:]
    if not torch.equal(marked, acted):
        r, c = (marked != acted).nonzero()[0].tolist()
        what = "an env token (a reply) is marked as an action" if marked[r, c] else "an agent token is not marked as an action"
        raise _fail("replies-are-context", env, f"{what}: row {r}, generated column {c} ({policy} policy)")
    for name in ("rewards", "process_rewards", "turn_rewards", "outcome"):
        if not bool(torch.isfinite(ep[name]).all()):
            raise _fail("rewards-finite", env, f"{name} holds NaN or inf ({policy} policy)")
    for name in ("rewards", "process_rewards", "turn_rewards"):
        off = (ep[name] != 0) & ~acted
        if bool(off.any()):
            r, c = off.nonzero()[0].tolist()
            raise _fail("rewards-on-actions", env, f"{name} {float(ep[name][r, c]):g} on row {r}, generated column {c}, "
                        f"which the agent did not write ({policy} policy)")
    special = set(int(i) for i in getattr(env.tokenizer, "all_special_ids", []) or [])
    allowed = set(i for ids in env._wrap_ids for i in ids)  # the chat template's role markers around a reply
    context = ep["attention_mask"][:, P:] & ~acted
    for r, c in context.nonzero().tolist():
        i = int(ep["tokens"][r, P + c])
        if i in special and i not in allowed:
            raise _fail("no-special-tokens", env, f"env text became the special token {env.tokenizer.convert_ids_to_tokens(i)!r} "
                        f"(id {i}) on row {r}, generated column {c}; reply text must be tokenized with split_special_tokens "
                        f"({policy} policy)")


def check_task(task_or_env: Any, *, tokenizer: Any = None, num_envs: int = 4, seed: int = 0, api: bool = True) -> None:
    """Check that a task (a :class:`~tokengym.envs.Task`, or a :class:`~tokengym.envs.TokenVectorEnv` of one) keeps
    the rules of :data:`RULES` on scripted episodes, and (``api``) the vector API (:func:`check_vector_env`).

    Raises ``AssertionError`` naming the broken rule, e.g. ``rewards-finite: task 'mine': rewards holds NaN or inf``.

    Example:
        >>> from tokengym.envs.tasks import CalculatorTask
        >>> check_task(CalculatorTask())
    """
    from tokengym.envs.vector_check import check_vector_env

    env = _make(task_or_env, num_envs, tokenizer)
    for policy in ("reference", "random"):
        first, taken = _episodes(env, policy, seed)
        _check_episodes(env, first, taken, policy)
        again, taken_again = _episodes(env, policy, seed)
        diff = next((k for k in first if not torch.equal(first[k], again[k])), None)
        if diff is not None or taken != taken_again:
            raise _fail("deterministic", env, f"reset(seed={seed}) and the same actions gave different "
                        f"{diff or 'actions taken'} ({policy} policy): draw prompts from the rng the env passes to sample()")
    if api:
        check_vector_env(env, seed=seed)

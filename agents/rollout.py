"""The rollout engine: drive a ``TokenVectorEnv`` in lockstep with a policy and collect a ``Rollout``.

``collect`` resets the env (``DISABLED`` autoreset: one batch of episodes), prefills the prompts once,
then samples and decodes one token per step until every slot is done. Everything stays on the env's
device; the only host syncs are the env's one-per-step stop check and the reward calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tokengym.agents.resources import check_fits

__all__ = ["Rollout", "collect", "evaluate", "heldout_samples", "turn_metrics", "used_columns", "used_slice", "trimmed_logprobs"]


@dataclass
class Rollout:
    """One batch of finished episodes; tensors ``[N, ...]`` on the env's device.

    Token layout is the env's: ``tokens[:, :P]`` left-padded prompts, ``tokens[:, P:]`` the episode (the agent's
    tokens and, in multi-turn envs, the env's replies between its turns). Per-token tensors ``[N, M]`` are aligned
    with ``tokens[:, P:]``; ``action_mask`` (the env's) is 1 on the agent's tokens only: losses, KL, entropy and
    advantages cover those, and env tokens are context. ``turn_rewards`` are the env's per-turn rewards (on the token
    that ended each turn, also included in ``rewards``); ``turn_counts`` holds each episode's multi-turn events. ``values``/``last_values`` are filled only when a critic was given (``last_values`` is the
    bootstrap value V(s_M) for truncated rows and 0 for terminated ones).
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    rewards: torch.Tensor
    process_rewards: torch.Tensor
    step_end: torch.Tensor
    outcome: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    group_id: torch.Tensor
    group_size: int
    values: torch.Tensor | None = None
    last_values: torch.Tensor | None = None
    completions: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    step_scores: list[list[float]] = field(default_factory=list)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    turn_rewards: torch.Tensor | None = None
    turn_counts: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_episodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """The agent's tokens per episode, ``[N]``."""
        return self.action_mask.sum(1)

    @property
    def episode_lengths(self) -> torch.Tensor:
        """Tokens after the prompt per episode (agent and env), ``[N]``."""
        return self.attention_mask[:, self.prompt_len:].sum(1)

    @property
    def turn_stats(self) -> dict[str, int]:
        """The batch's multi-turn events, summed over episodes (``{}`` for single-turn envs)."""
        return {k: int(v.sum()) for k, v in self.turn_counts.items()}

    @property
    def returns(self) -> torch.Tensor:
        """Each episode's outcome plus its turn rewards, ``[N]`` (what group-relative advantages compare)."""
        return self.outcome if self.turn_rewards is None else self.outcome + self.turn_rewards.sum(1)

    def step_rewards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(step_rewards[N, S], step_ends[N, S])`` for ``functional.process_advantages`` (-1 = no step)."""
        counts = self.step_end.sum(1)
        s = max(int(counts.max()), 1) if counts.numel() else 1
        ends = torch.full((self.num_episodes, s), -1, dtype=torch.long, device=self.tokens.device)
        vals = torch.zeros((self.num_episodes, s), dtype=torch.float32, device=self.tokens.device)
        rows, cols = self.step_end.nonzero(as_tuple=True)
        rank = torch.cumsum(self.step_end.long(), 1)[rows, cols] - 1
        ends[rows, rank] = cols
        vals[rows, rank] = self.process_rewards[rows, cols]
        return vals, ends

    def select(self, idx: torch.Tensor | Sequence[int]) -> "Rollout":
        """The sub-batch of episodes ``idx`` (tensors indexed, lists picked)."""
        idx_t = torch.as_tensor(idx, device=self.tokens.device)
        pick = idx_t.tolist()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v[idx_t]
            elif isinstance(v, list):
                v = [v[i] for i in pick] if v else v
            elif isinstance(v, dict):
                v = {k: t[idx_t] for k, t in v.items()}
            out[f.name] = v
        return Rollout(**out)


def concat_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """One rollout of the episodes of ``parts`` (rollouts of the same env), in order."""
    out = {}
    for f in dataclasses.fields(parts[0]):
        vs = [getattr(p, f.name) for p in parts]
        if isinstance(vs[0], torch.Tensor):
            out[f.name] = torch.cat(vs)
        elif isinstance(vs[0], list):
            out[f.name] = [x for v in vs for x in v]
        elif isinstance(vs[0], dict):
            out[f.name] = {k: torch.cat([v[k] for v in vs]) for k in vs[0]}
        else:
            out[f.name] = vs[0]
    return Rollout(**out)


def turn_metrics(ro: Rollout) -> dict[str, float]:
    """Multi-turn counters of a rollout for the logs (``env/replies_per_episode`` is a tool env's call rate)."""
    if not ro.turn_counts:
        return {}
    n = max(ro.num_episodes, 1)
    st = ro.turn_stats
    return {"env/turns_per_episode": st["turns"] / n, "env/replies_per_episode": st["replies"] / n,
            "env/tool_errors": float(st["tool_errors"]), "env/tool_timeouts": float(st["tool_timeouts"]),
            "env/reply_overflows": float(st["reply_overflows"]), "env/max_turns_truncations": float(st["max_turns"])}


def used_columns(action_mask: torch.Tensor) -> int:
    """Generated columns up to the end of the longest row of ``action_mask[N, M]`` (at least 1). Later
    columns are padding in every row and no real token attends to them, so a full pass over the batch
    (reference, pi_old, a minibatch update) can skip them. That pays when the token budget is generous
    for the task; on default Arithmetic-v0 the longest of 64 completions is close to the 31-token budget
    and ``tokengym train grpo`` took the same 19-23 s with and without it."""
    return max(int(action_mask.sum(1).max()), 1) if action_mask.numel() else 1


def used_slice(ro: "Rollout", rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(tokens, mask, prompt_len, m)`` of the rollout's ``rows`` (default: all) without the columns that are
    padding in every one of them: generated columns past :func:`used_columns` ``m``, and the leading prompt
    columns left of the longest prompt (the env pads to ``max_prompt_len``, which a chat template or a BPE
    tokenizer can make far longer than the prompts). Positions come from the mask, so a full pass over the slice
    (reference, pi_old, an update) gives the same log-probs of the first ``m`` generated tokens."""
    P = ro.prompt_len
    tokens, mask = (ro.tokens, ro.attention_mask) if rows is None else (ro.tokens[rows], ro.attention_mask[rows])
    longest, m = torch.stack([mask[:, :P].sum(1).max(), mask[:, P:].sum(1).max()]).tolist() if len(mask) else (P, 1)
    lead, m = P - max(int(longest), 1), max(int(m), 1)
    return tokens[:, lead : P + m], mask[:, lead : P + m], P - lead, m


def trimmed_logprobs(fn, ro: "Rollout") -> torch.Tensor:
    """``fn(tokens, mask, prompt_len)`` (a policy or reference) over :func:`used_slice` only, zero-padded back to
    ``[N, M]``."""
    tokens, mask, p, m = used_slice(ro)
    return torch.nn.functional.pad(fn(tokens, mask, p), (0, ro.action_mask.shape[1] - m))


def collect(env, policy, critic=None, *, greedy: bool = False, seed: int | None = None, samples: list | None = None) -> Rollout:
    """Run one lockstep batch of episodes of ``env`` with ``policy``; return the finished ``Rollout``.

    Args:
        env: a :class:`~tokengym.envs.TokenVectorEnv` in ``DISABLED`` autoreset mode.
        policy: a :class:`~tokengym.agents.Policy` (or anything with ``prefill``/``decode``/``sample``).
        critic: optional :class:`~tokengym.agents.Critic`; its values are computed in one pass at the end.
        greedy: argmax decoding (evaluation).
        seed: passed to ``env.reset``.
        samples: explicit prompts for ``env.reset(options={"samples": ...})`` (one per group).
    """
    if env.autoreset_mode.name != "DISABLED":
        raise ValueError("collect() runs lockstep batches: create the env with autoreset_mode='disabled'")
    check_fits(policy, env)
    P, M = env.max_prompt_len, env.max_new_tokens
    with torch.inference_mode():
        logps = _run_episodes(env, policy, greedy, seed, samples)
    logps = logps.clone()
    # Everything below is built outside inference mode, so the batch can be used in autograd.
    action_mask = env.action_mask[:, P:].clone()
    ro = Rollout(
        tokens=env.tokens.clone(),
        attention_mask=env.attention_mask.clone(),
        action_mask=action_mask,
        prompt_len=P,
        logprobs=logps * action_mask,
        rewards=env.rewards.clone(),
        process_rewards=env.process_rewards.clone(),
        step_end=env.step_end.clone(),
        outcome=env.outcome.clone(),
        terminated=env.terminated.clone(),
        truncated=env.truncated.clone(),
        group_id=env.group_id.clone(),
        group_size=env.group_size,
        completions=list(env.completions),
        samples=list(env.samples),
        step_scores=[list(s) for s in env.step_scores],
        reward_components=_components(env),
        turn_rewards=env.turn_rewards.clone() if getattr(env, "multi_turn", False) else None,
        turn_counts={k: v.clone() for k, v in env.turn_counts.items()} if getattr(env, "multi_turn", False) else {},
    )
    if critic is not None:
        with torch.no_grad():
            v = critic(ro.tokens, ro.attention_mask, P)  # [N, M + 1]: V(s_0) .. V(s_M)
        ro.values = v[:, :M] * action_mask
        after = v.gather(1, ro.episode_lengths[:, None])[:, 0]  # V after the last token (M unless a reply overflowed)
        ro.last_values = torch.where(ro.truncated, after, torch.zeros_like(after))
    return ro


def _run_episodes(env, policy, greedy: bool, seed: int | None, samples: list | None) -> torch.Tensor:
    """Reset ``env`` and step it to the end with ``policy``; return the sampled tokens' log-probs ``[N, M]``."""
    obs, _ = env.reset(seed=seed, options={"samples": samples} if samples is not None else None)
    P, M, N = env.max_prompt_len, env.max_new_tokens, env.num_envs
    logps = torch.zeros((N, M + 1), dtype=torch.float32, device=env.device)  # column M: finished rows' samples
    lead = P - max(int(obs["mask"][:, :P].sum(1).max()), 1)  # prompt columns that are padding in every row
    multi_turn = getattr(env, "multi_turn", False)
    try:
        logits = policy.prefill(obs["tokens"][:, lead:P], obs["mask"][:, lead:P], max_new_tokens=M)
        for _ in range(M + 1000):  # every live row writes a column per step (or waits for a slow reply: bounded by its timeout)
            actions, lp = policy.sample(logits, greedy=greedy)
            held = env.waiting.clone() if multi_turn and env._pending else None  # rows whose actions the env ignores
            idle = env.done if held is None else env.done | held
            logps.scatter_(1, torch.where(idle, M, env.gen_len)[:, None], lp[:, None])
            env.step(actions)
            if env.all_done:
                break
            logits = policy.decode(actions) if held is None else policy.decode(actions, hold=held)
            if multi_turn and env.replied:  # the env answered some rows: append their replies to those caches
                logits = _extend_replies(env, policy, logits)
    finally:
        if hasattr(policy, "end_rollout"):
            policy.end_rollout()
    return logps[:, :M]


def _extend_replies(env, policy, logits: torch.Tensor) -> torch.Tensor:
    """Feed the reply tokens the env just appended (rows ``env.replied``) to ``policy``; their logits replace the rows'."""
    rows = torch.tensor(env.replied, device=env.device)
    n = env.reply_len[rows]
    k = int(n.max())
    start = env.max_prompt_len + env.gen_len[rows] - n
    cols = (start[:, None] + torch.arange(k, device=env.device)).clamp(max=env.seq_len - 1)
    logits = logits.clone()
    logits[rows] = policy.extend(rows, env.tokens[rows[:, None], cols], n)
    return logits


def _components(env) -> dict[str, torch.Tensor]:
    names = sorted({k for c in env.reward_components for k in c})
    return {k: torch.tensor([c.get(k, 0.0) for c in env.reward_components], device=env.device) for k in names}


def heldout_samples(task, n: int, seed: int = 10_007) -> list[dict[str, Any]]:
    """``n`` prompts from ``task`` drawn from a fixed seed kept apart from training seeds."""
    import numpy as np

    return task.batch(np.random.default_rng(seed), n)


@torch.inference_mode()
def evaluate(policy, env, samples: list[dict[str, Any]], greedy: bool = True) -> dict[str, float]:
    """Score ``policy`` on ``samples`` (group_size 1 env) in batches of ``env.num_envs``.

    Returns ``mean_reward`` (the env's outcome reward), ``accuracy`` (fraction with outcome >= 1,
    which for 0/1 verifiers is the fraction solved), ``mean_length`` and ``truncated``; for a multi-turn env also
    ``replies_per_episode`` (a tool env's calls per episode).
    """
    if env.group_size != 1:
        raise ValueError("evaluate() needs an env with group_size=1")
    n = env.num_envs
    rewards, lengths, truncs, replies = [], [], [], []
    for start in range(0, len(samples), n):
        chunk = list(samples[start : start + n])
        pad = n - len(chunk)
        ro = collect(env, policy, greedy=greedy, samples=chunk + chunk[:1] * pad)
        keep = slice(0, n - pad)
        rewards.append(ro.outcome[keep])
        lengths.append(ro.lengths[keep].float())
        truncs.append(ro.truncated[keep].float())
        if ro.turn_counts:
            replies.append(ro.turn_counts["replies"][keep].float())
    r = torch.cat(rewards)
    out = {
        "mean_reward": r.mean().item(),
        "accuracy": (r >= 1.0 - 1e-6).float().mean().item(),
        "mean_length": torch.cat(lengths).mean().item(),
        "truncated": torch.cat(truncs).mean().item(),
    }
    if replies:
        out["replies_per_episode"] = torch.cat(replies).mean().item()
    return out

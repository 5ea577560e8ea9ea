"""The :class:`Rollout` record (one batch of finished episodes) and how a collector makes one from an env: the argument
check every collector runs first, the snapshot of the env's finished episodes, the critic's values.

Both collectors build on these: the token-level loop (:mod:`~tokengym.agents.engine.rollout`) and the generation
replay (:mod:`~tokengym.agents.engine.replay`), which ``collect`` hands an engine's rollouts to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tokengym.envs.masks import TokenMasks
from tokengym.rewards.protocols import DROP, is_counter

__all__ = ["Rollout", "attach_values", "check_collect_args", "drop_flagged", "reward_counters", "snapshot_rollout"]


@dataclass
class Rollout:
    """One batch of finished episodes; tensors ``[N, ...]`` on the env's device.

    Token layout is the env's: ``tokens[:, :P]`` left-padded prompts, ``tokens[:, P:]`` the episode (the agent's
    tokens and, in multi-turn envs, the env's replies between its turns). Per-token tensors ``[N, M]`` are aligned
    with ``tokens[:, P:]``; ``action_mask`` (the env's) is 1 on the agent's tokens only: losses, KL, entropy and
    advantages cover those, and env tokens are context. ``turn_rewards`` are the env's per-turn rewards (on the token
    that ended each turn, also included in ``rewards``); for a task whose ``outcome_is_return`` (a library env's adapter,
    whose rewards are all turn rewards) they are folded into ``outcome`` instead, so that metrics and evaluation read
    the episode's return, and ``turn_rewards`` is ``None``. ``turn_counts`` holds each episode's multi-turn events.
    ``values``/``last_values`` are filled only when a critic was given (``last_values`` is the bootstrap value V(s_M)
    for truncated rows and 0 for terminated ones).
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
    policy_version: int | None = None
    """The policy version that sampled the batch: in async modes the learner's number of updates when a worker took
    its weights, with an inference engine the version its weights were loaded as; ``None``: the policy as it stood
    (synchronous training)."""
    token_masks: TokenMasks | None = None
    """The allowed set each token was sampled under (an env that masks its actions: a grammar), compact; the trainer
    scores every log-prob under the same sets (``mask_training="masked"``). ``None``: unmasked sampling."""
    generation_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Rollouts through the generation seam (an engine's tokens replayed through the env): per episode, the
    ``requests`` sent to the engine and the tokens it generated that were ``dropped`` because the env ended the turn
    first (``{}`` for token-level rollouts)."""

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
            elif isinstance(v, TokenMasks):
                v = v.select(idx_t)
            out[f.name] = v
        return Rollout(**out)


def reward_counters(ro: Rollout) -> dict[str, float]:
    """The reward's per-episode counters (components named with a ``/``, e.g. ``judge/errors``) summed over the
    rollout, for the step's metrics."""
    return {k: float(v.sum()) for k, v in ro.reward_components.items() if is_counter(k)}


def drop_flagged(ro: Rollout) -> tuple[Rollout, int]:
    """``(rollout, rows left out)``: without the groups of episodes that the reward flagged :data:`DROP` (it could not
    score them: a judge's error under ``on_error="drop"``). A whole group goes, as its other rows' advantages would be
    measured against a reward that is not one. With every group flagged, the rows stay with no token to train on (an
    update of zero gradient), so a step always has a batch."""
    flag = ro.reward_components.get(DROP)
    if flag is None or not bool((flag > 0).any()):
        return ro, 0
    g = max(ro.group_size, 1)
    keep = ~(flag > 0).view(-1, g).any(1).repeat_interleave(g)
    if not bool(keep.any()):
        return dataclasses.replace(ro, action_mask=torch.zeros_like(ro.action_mask)), ro.num_episodes
    return ro.select(keep.nonzero().flatten()), int((~keep).sum())


def attach_values(ro: Rollout, critic) -> Rollout:
    """Fill ``ro.values`` and ``ro.last_values`` with ``critic``'s values in one pass; return ``ro``."""
    M = ro.action_mask.shape[1]
    with torch.no_grad():
        v = critic(ro.tokens, ro.attention_mask, ro.prompt_len)  # [N, M + 1]: V(s_0) .. V(s_M)
    ro.values = v[:, :M] * ro.action_mask
    after = v.gather(1, ro.episode_lengths[:, None])[:, 0]  # V after the last token (M unless a reply overflowed)
    ro.last_values = torch.where(ro.truncated, after, torch.zeros_like(after))
    return ro


def check_collect_args(fn: str, env: Any, greedy: Any) -> None:
    """TypeError in one line for arguments of the wrong kind (a string where the env goes, ``greedy="yes"``)."""
    if not all(hasattr(env, a) for a in ("reset", "step", "autoreset_mode", "max_new_tokens", "vocab_size")):
        raise TypeError(f"{fn}() needs a tokengym vector env (TokenVectorEnv, or gymnasium.make_vec(env_id, num_envs=N, "
                        f"vectorization_mode='vector_entry_point')), got {type(env).__name__}: {env!r:.60}")
    if not isinstance(greedy, bool):
        raise TypeError(f"{fn}(greedy=...) must be True or False, got {greedy!r}")


def snapshot_rollout(env, logps: torch.Tensor, slots: list[int] | None = None) -> Rollout:
    """A :class:`Rollout` of the episodes in ``env``'s ``slots`` (default: all) as they stand (``env.record``), with
    the sampled log-probs ``logps[N, M]`` (every tensor a copy: built outside inference mode, it can be used in
    autograd)."""
    record = env.record(slots)
    idx = slice(None) if slots is None else torch.tensor(slots, dtype=torch.long, device=env.device)
    return Rollout(**record, logprobs=logps[idx].masked_fill(~record["action_mask"], 0.0))

"""What a rollout loop needs from a token env: the declared interface :class:`RolloutEnv`.

The rollout loops in ``tokengym.agents.engine`` (the token-level one that decodes with a ``Sampler``, the
generation-level one that replays an inference engine's tokens, continuous batching, evaluation) read an env through
these names only, so a second env type that implements them runs through every loop. :class:`TokenVectorEnv` is the
implementation; ``tests/envs/test_rollout_env.py`` runs each loop on an env that exposes nothing else.

Layout (constants): ``num_envs`` (N), ``group_size``, ``max_prompt_len`` (P), ``max_new_tokens`` (M), ``seq_len``
(P + M), ``vocab_size``, ``pad_id``, ``device``, ``autoreset_mode``, ``multi_turn``.

Calls: ``reset(seed=, options=)``; ``step(actions, hold=None)``, where ``hold[N]`` (bool) rows sit the step out (their
action is ignored and their episode does not advance: a row whose next tokens are not sampled yet);
``stop_rule()`` (:class:`StopRule`); ``record(slots=None)``, the finished episodes' fields (a ``Rollout`` without
its log-probs).

State after a step (tensors ``[N]`` on ``device`` unless said): ``tokens`` / ``attention_mask`` ``[N, P + M]``,
``gen_len`` (episode tokens so far, agent's and env's), ``episode_id``, ``done`` (ended), ``finished`` (nothing left
to run), ``waiting`` (a reply is still out), ``pending_replies`` (host bool: any reply out), ``all_done`` (host bool),
``reward_seconds`` (host float, cumulative time in reward calls).

Events of the last step (host lists of slots): ``ended`` (episodes that ended), ``replied`` (rows the env answered:
``reply_len[N]`` reply tokens appended), ``restarted`` (next-step mode: slots that took a new prompt).

Action masks (:mod:`tokengym.envs.masks`): ``masker`` (``None`` where the env does not mask; else its
``engine_grammar(slot)`` tells a generation backend the grammar to apply), ``mask_logits(logits, rows)`` (the rows'
next-token logits with ``-inf`` outside their masks: what the token-level loop samples from). ``record`` then carries
``token_masks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ROLLOUT_ENV_NAMES", "RolloutEnv", "StopRule", "check_rollout_env"]


@dataclass(frozen=True)
class StopRule:
    """What ends an agent turn (and, in single-turn envs, the episode), as an inference engine can be told it.

    ``token_ids``: tokens that end a turn on their own (EOS, end-of-turn markers, one-token stop strings).
    ``sequences``: token-id sequences that end a turn when the agent's current turn ends with one (multi-token stop
    strings, matched on ids: tokens in = tokens out); ``strings`` are their texts, for engines that match text. A text
    match can come before the id match (a string can be spelled with other tokens), never after it, so an engine that
    stops on the text stops at or before the env; the env's own rule decides, and a rollout loop asks the engine to go
    on where the env did not stop.
    """

    token_ids: tuple[int, ...]
    sequences: tuple[tuple[int, ...], ...] = ()
    strings: tuple[str, ...] = ()


ROLLOUT_ENV_NAMES: tuple[str, ...] = (
    "num_envs", "group_size", "max_prompt_len", "max_new_tokens", "seq_len", "vocab_size", "pad_id", "device",
    "autoreset_mode", "multi_turn",
    "reset", "step", "stop_rule", "record",
    "tokens", "attention_mask", "gen_len", "episode_id", "done", "finished", "waiting", "pending_replies", "all_done",
    "reward_seconds",
    "ended", "replied", "reply_len", "restarted",
    "masker", "mask_logits",
)
"""Every name of :class:`RolloutEnv` (the module docstring says what each is)."""


@runtime_checkable
class RolloutEnv(Protocol):
    """The token env a rollout loop drives (see the module docstring for every name)."""

    num_envs: int
    group_size: int
    max_prompt_len: int
    max_new_tokens: int
    seq_len: int
    vocab_size: int
    pad_id: int
    multi_turn: bool

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any: ...

    def step(self, actions: Any, hold: Any = None) -> Any: ...

    def stop_rule(self) -> StopRule: ...

    def record(self, slots: list[int] | None = None) -> dict[str, Any]: ...


def check_rollout_env(env: Any, who: str) -> None:
    """Raise ``ValueError`` (one line) if ``env`` is not a token vector env a rollout loop can drive: a single
    Gymnasium env (``gym.make``), or anything else without the layout and calls of :class:`RolloutEnv`."""
    missing = [n for n in ("num_envs", "group_size", "max_prompt_len", "max_new_tokens", "seq_len", "reset", "step",
                           "stop_rule", "record") if not hasattr(env, n)]
    if missing:
        single = " (a single env: gym.make)" if not hasattr(env, "num_envs") and hasattr(env, "unwrapped") else ""
        raise ValueError(f"{who} needs a vector env of token episodes, such as gym.make_vec(id, num_envs=N, "
                         f"vectorization_mode='vector_entry_point') or TokenVectorEnv(...), and got "
                         f"{type(env).__name__}{single}, which has no {missing[0]!r}")

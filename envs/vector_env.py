"""``TokenVectorEnv``: N token-level generation episodes as tensors on one device.

Layout of one row of the token buffer (``obs["tokens"][i]``, length ``L = P + M``)::

    [ <pad> ... <pad> <bos> p r o m p t | g e n e r a t e d <pad> ... ]
      <------- P = max_prompt_len ----->  <---- M = max_new_tokens ---->

Prompts are **left-padded** into the first ``P`` slots, so every row's generation starts at column ``P``
and a lockstep batch writes each new token into the same column: the layout a KV-cached policy wants.
``obs["mask"]`` is ``True`` on real tokens (prompt and generated), ``False`` on padding, and
``obs["action_mask"]`` is ``True`` on the tokens the agent emitted (its actions): agents train on those only.

Multi-turn tasks (those that override :meth:`Task.respond`, see :mod:`tokengym.envs.multiturn`) answer the agent
mid-episode: when an agent turn ends, the env's reply tokens are appended to that row right after it, as
context (``mask`` 1, ``action_mask`` 0), and the agent goes on from there. The ``M`` columns are then the
episode's whole token budget, agent and env tokens together; ``info["reply_len"]`` says how many reply tokens
each row got in the step.

Per step, each active slot appends its action. A slot **terminates** when it emits a stop token (EOS,
or the last token of a task/user stop string, matched on token ids) and is **truncated** when it
reaches ``M`` generated tokens. Rewards are per token: a process reward (PRM) score lands on the token
that ends a reasoning step, the outcome reward on the episode's last token; ``step`` returns the sum
for the token just emitted, and the env keeps the full per-token record (:attr:`rewards`,
:attr:`process_rewards`, :attr:`step_end`, :attr:`outcome`) for agents to read after the episode.

Autoreset modes (``metadata["autoreset_mode"]``):

* ``DISABLED`` (default, the agents' fast path): a batch of episodes runs in lockstep. Finished slots
  are masked: their actions are ignored, their reward is 0 and their ``terminated``/``truncated`` flags
  stay set until the next ``reset()``, which starts the next batch (``options={"reset_mask": m}``
  resets only whole groups marked in ``m``). Stepping when every slot has finished is an error.
* ``NEXT_STEP`` (what generic Gymnasium loops expect): the step after a slot finishes resets that slot
  with a new prompt, ignoring its action and returning reward 0 and flags ``False``. Needs
  ``group_size=1`` (a GRPO group must start together; use ``DISABLED`` for groups).
  ``reset(options={"episodes": prompts})`` (or a count ``n``: the task's next ``n`` prompts) runs a finite list
  instead of the task's endless stream: the first
  ``N`` start at once, each later one starts in the next slot to finish, and once the list runs out finished slots
  stay :attr:`idle`; :attr:`episode_id` says which list entry each slot holds (what continuous batching,
  :func:`tokengym.agents.engine.rollout.collect_episodes`, uses).

Where each part lives: this module holds the Gymnasium calls (``__init__``, ``reset``, ``step``) and the action-mask
views; the buffers, prompt writes, :meth:`~TokenVectorEnv.record` and the saved state are
:class:`~tokengym.envs.episode_store.EpisodeStore`'s, the rewards :class:`~tokengym.envs.scoring.ScoringMixin`'s, the
env's replies :class:`~tokengym.envs.multiturn.MultiTurnMixin`'s; the env owns a
:class:`~tokengym.envs.stops.StopMatcher` (what ends a turn) and an :class:`~tokengym.envs.masks.ActionMasker`, and
:mod:`tokengym.envs.vector_setup` resolves the constructor's arguments.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from tokengym.envs.chat import check_chat_template
from tokengym.envs.episode_store import EpisodeStore
from tokengym.envs.multiturn import DaemonPool, MultiTurnMixin, chat_reply_wrapper
from tokengym.envs.rollout_env import StopRule
from tokengym.envs.scoring import ScoringMixin
from tokengym.envs.stops import StopMatcher
from tokengym.envs.tasks.base import Task
from tokengym.envs.tokenizer import load_tokenizer
from tokengym.envs.vector_setup import MAX_COLUMNS  # noqa: F401  (re-exported)
from tokengym.envs.vector_setup import check_sizes, default_prompt_len, make_masker, parse_mode, resolve_task, with_index
from tokengym.rewards.protocols import check_reward

__all__ = ["TokenVectorEnv", "resolve_task"]  # MAX_COLUMNS is still importable from here


class TokenVectorEnv(EpisodeStore, ScoringMixin, MultiTurnMixin, VectorEnv):
    """N token-generation episodes held as torch tensors on ``device``.

    Args:
        num_envs: number of slots N (a multiple of ``group_size``).
        task: a :class:`Task` or a task name; ``**task_kwargs`` go to the task's constructor.
        tokenizer: ``None``/``"char"`` for the bundled char tokenizer, a local folder, or a tokenizer object.
        reward: outcome reward replacing the task's verifier.
        process_reward: ``None`` (off), ``True`` (the task's PRM) or a process-reward callable.
        max_new_tokens: generation budget M (default: the task's).
        max_prompt_len: prompt buffer P in tokens (default: the task's longest prompt in characters + 2).
        stop_strings: texts that end an episode (default: the task's), matched on their token ids.
        group_size: G; each prompt fills G contiguous slots (``info["group_id"]``), for GRPO.
        device: where every buffer and returned tensor lives.
        autoreset_mode: ``"disabled"`` (default) or ``"next_step"``; see the module docstring.
        grammar: the actions' grammar (:func:`~tokengym.envs.masks.grammar_text`'s spec) instead of the task's
            (:attr:`Task.grammar`), or ``False``: none, even where the task has one. A masking env exposes
            :meth:`action_masks` and refuses an action outside them; rollouts sample under them.
        action_mask_fn: masks from a callable ``fn(sample, generated_ids) -> None | bool [V] | allowed ids`` instead.

    Example:
        >>> import torch
        >>> env = TokenVectorEnv(4, "arithmetic", group_size=2)
        >>> obs, info = env.reset(seed=0)
        >>> obs["tokens"].shape == (4, env.max_prompt_len + env.max_new_tokens)
        True
        >>> eos = torch.full((4,), env.tokenizer.eos_token_id)
        >>> obs, reward, terminated, truncated, info = env.step(eos)
        >>> bool(terminated.all()), reward.shape
        (True, torch.Size([4]))
    """

    def __init__(
        self,
        num_envs: int = 1,
        task: str | Task = "arithmetic",
        *,
        tokenizer: Any = None,
        reward: Callable | None = None,
        process_reward: Callable | bool | None = None,
        max_new_tokens: int | None = None,
        max_prompt_len: int | None = None,
        stop_strings: Sequence[str] | None = None,
        group_size: int = 1,
        device: str | torch.device = "cpu",
        autoreset_mode: str | AutoresetMode = AutoresetMode.DISABLED,
        render_mode: str | None = None,
        grammar: Any = None,
        action_mask_fn: Callable | None = None,
        **task_kwargs: Any,
    ):
        check_sizes(num_envs, group_size, max_new_tokens, max_prompt_len)
        if reward is not None:
            check_reward(reward, "reward")
        if process_reward is not None and not isinstance(process_reward, bool):
            check_reward(process_reward, "process_reward")
        self.task = resolve_task(task, **task_kwargs)
        self.tokenizer = load_tokenizer(tokenizer)
        self.task.bind(self.tokenizer)
        if self.task.chat:
            check_chat_template(self.tokenizer)
        self.reward_fn = reward if reward is not None else self.task.reward()
        if process_reward is True:
            process_reward = self.task.process_reward()
            if process_reward is None:
                raise ValueError(f"task {self.task.name!r} has no process reward; pass a callable")
        self.process_reward_fn = process_reward or None
        self._task_scores = (reward is None, process_reward is True)  # the task's own: rebuilt after pickling
        self.num_envs, self.group_size, self.n_groups = num_envs, group_size, num_envs // group_size
        self.device = with_index(device)
        self.max_new_tokens = int(max_new_tokens if max_new_tokens is not None else self.task.default_max_new_tokens)
        self.max_prompt_len = int(max_prompt_len if max_prompt_len is not None else default_prompt_len(self.task, self.tokenizer))
        mode = parse_mode(autoreset_mode)
        if mode is AutoresetMode.NEXT_STEP and group_size != 1:
            raise ValueError("autoreset_mode='next_step' needs group_size=1: a group's G episodes must start together")
        self.autoreset_mode = mode
        self.metadata = {"autoreset_mode": mode, "render_modes": ["ansi"]}
        self.render_mode = render_mode
        self.vocab_size = len(self.tokenizer)
        self.seq_len = self.max_prompt_len + self.max_new_tokens
        self.pad_id = int(self.tokenizer.pad_token_id)

        L, V = self.seq_len, self.vocab_size
        self.single_action_space = spaces.Discrete(V)
        self.single_observation_space = spaces.Dict(
            {"tokens": spaces.Box(0, V - 1, (L,), np.int64), "mask": spaces.Box(0, 1, (L,), np.bool_),
             "action_mask": spaces.Box(0, 1, (L,), np.bool_)}
        )
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)

        self.multi_turn = self.task.multi_turn
        self._ends_episodes = self.multi_turn and type(self.task).episode_over is not Task.episode_over
        stops = list(stop_strings if stop_strings is not None else self.task.stop_strings)
        self._markers = [*stops, *self.task.turn_stop_strings] if self.multi_turn else stops
        self._stops = StopMatcher(self.tokenizer, self._markers, self.vocab_size, self.max_prompt_len, self.device)
        self.stop_sequences: list[torch.Tensor] = self._stops.sequences
        """The multi-token stop strings' ids (:class:`~tokengym.envs.stops.StopMatcher`'s ``sequences``)."""
        self._is_stop = self._stops.is_stop  # read by bench/real_model.py and bench/longtail.py
        self._place_process_reward()
        wrap = chat_reply_wrapper(self.tokenizer, self.task.reply_role) if self.multi_turn and self.task.chat else ("", "")
        # the role markers around a reply, tokenized once with their special tokens (a reply's own text never has any)
        self._wrap_ids = tuple(list(ids) for ids in self.tokenizer(list(wrap), add_special_tokens=False)["input_ids"])
        self._pool: DaemonPool | None = None  # tool replies (multi-turn), started on the first one
        self._alloc()
        self.masker = make_masker(self.task, grammar, action_mask_fn, self.num_envs, self.max_new_tokens, self.vocab_size,
                                  self.tokenizer, self.device)
        """The env's :class:`~tokengym.envs.masks.ActionMasker` (``None``: the env does not mask its actions)."""

    def _live(self) -> torch.Tensor:
        """Bool ``[N]``: slots whose next action the env takes (not ended, idle, restarting or waiting for a reply)."""
        if self.autoreset_mode is AutoresetMode.NEXT_STEP:
            return ~self._needs_reset & ~self.waiting & ~self.idle
        return ~(self.terminated | self.truncated | self.waiting)

    def action_masks(self) -> torch.Tensor:
        """Bool ``[N, V]``: the tokens each slot may emit next (MaskablePPO's ``action_masks()``); all true for a slot
        whose action is ignored, and everywhere when the env does not mask. A live slot whose grammar allows nothing
        raises, naming the slot and its prefix."""
        if self.masker is None:
            return torch.ones((self.num_envs, self.vocab_size), dtype=torch.bool, device=self.device)
        return self.masker.allowed(self._live())

    def mask_logits(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Next-token ``logits[R, V']`` of slots ``rows`` with ``-inf`` outside :meth:`action_masks` (possibly in place):
        what a rollout samples from, so that its log-probs are the masked distribution's."""
        return logits if self.masker is None else self.masker.mask_logits(logits, self._live(), rows)

    # ------------------------------------------------------------------ reset
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start a new batch of episodes (or, with ``options["reset_mask"]``, only the masked groups).

        Options:
            samples: ``n_groups`` prompts to use instead of drawing from the task (each a str or a
                dict with ``"prompt"`` and task fields); with ``reset_mask``, one per reset group.
            reset_mask: bool ``[N]``; only these slots restart (whole groups only).
        """
        super().reset(seed=seed)
        if seed is not None and hasattr(self.task, "on_seed"):
            self.task.on_seed(seed)
        options = dict(options or {})
        unknown = set(options) - {"samples", "reset_mask", "episodes"}
        if unknown:
            raise ValueError(f"unknown reset options {sorted(unknown)}; valid: ['episodes', 'reset_mask', 'samples']")
        self._queue = None
        self.idle.zero_()
        if self.autoreset_mode is AutoresetMode.DISABLED:  # one batch: episode i runs in slot i
            self.episode_id.copy_(self._arange_n)
        else:
            self.episode_id.fill_(-1)
        self.ended, self.restarted = [], []
        if self.masker is not None and options.get("reset_mask") is None:
            self.masker.forget()  # every slot restarts: no record points into the old sets
        if options.get("episodes") is not None:
            return self._start_episodes(options)
        groups = list(range(self.n_groups))
        if options.get("reset_mask") is not None:
            m = torch.as_tensor(options["reset_mask"], dtype=torch.bool).reshape(-1).cpu()
            if m.shape != (self.num_envs,):
                raise ValueError(f"reset_mask must have shape ({self.num_envs},), got {tuple(m.shape)}")
            g = m.view(self.n_groups, self.group_size)
            if not bool((g.all(1) | ~g.any(1)).all()):
                raise ValueError("reset_mask must cover whole groups (all G slots of a group or none)")
            if not self._started and not bool(m.all()):
                raise ValueError("the first reset must reset every slot")
            groups = g.all(1).nonzero().flatten().tolist()
        samples = options.get("samples")
        if samples is None:
            samples = self.task.batch(self.np_random, len(groups))
        elif isinstance(samples, (str, bytes, dict)) or not hasattr(samples, "__len__"):
            raise ValueError(f"options['samples'] must be a list of prompts or sample dicts (one per group), got "
                             f"{type(samples).__name__}: {samples!r:.60}")
        elif len(samples) != len(groups):
            raise ValueError(f"options['samples'] has {len(samples)} prompts for {len(groups)} groups being reset")
        samples = [s if isinstance(s, dict) else {"prompt": s} for s in samples]
        slots = [gi * self.group_size + j for gi in groups for j in range(self.group_size)]
        self._fill(slots, [s for s in samples for _ in range(self.group_size)], groups)
        self._started = True
        self.all_done = bool(self.done.all())
        return self._obs(), self._info()

    # ------------------------------------------------------------------ step
    def _check_actions(self, actions: Any) -> torch.Tensor:
        if isinstance(actions, torch.Tensor):
            if actions.device != self.device:
                raise ValueError(f"actions are on {actions.device} but the env is on {self.device}")
        else:
            actions = torch.as_tensor(np.asarray(actions), device=self.device)
        if actions.shape != (self.num_envs,):
            raise ValueError(f"actions must have shape ({self.num_envs},), got {tuple(actions.shape)}")
        if actions.dtype.is_floating_point or actions.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"actions must be integer token ids, got dtype {actions.dtype}")
        return actions.long()

    def step(self, actions: Any, hold: Any = None):
        """Append one token per active slot. Returns ``(obs, reward[N], terminated[N], truncated[N], info)``.

        ``hold[N]`` (bool, optional): slots that sit this step out; their action is ignored and their episode does not
        advance (a rollout loop's rows whose next token is not there yet: :class:`~tokengym.envs.rollout_env.RolloutEnv`).
        """
        if not self._started:
            raise RuntimeError("call reset() before step()")
        a = self._check_actions(actions)
        resetting = self._needs_reset.clone() if self.autoreset_mode is AutoresetMode.NEXT_STEP else None
        active = self._live()
        if hold is not None:
            hold = torch.as_tensor(hold, device=self.device)
            if hold.shape != (self.num_envs,) or hold.dtype != torch.bool:
                raise ValueError(f"hold must be a bool tensor of shape ({self.num_envs},), got {hold.dtype} {tuple(hold.shape)}")
            active, going = active & ~hold, active  # held slots go on after this step
        else:
            going = active
        V, M, P = self.vocab_size, self.max_new_tokens, self.max_prompt_len
        invalid = active & ((a < 0) | (a >= V))
        a_safe = a.clamp(0, V - 1)
        stop = self._stops.is_stop[a_safe] | self._stops.sequence_hit(a_safe, self.tokens, self.gen_len, self.turn_start)
        term_now = active & stop
        trunc_now = active & ~stop & (self.gen_len + 1 >= M)
        done_now = term_now | trunc_now
        delim_now = active & self._is_delim[a_safe] if self._is_delim is not None else None
        events = done_now if delim_now is None else done_now | delim_now
        checks = [invalid.any(), active.any(), events.any(), (going & ~done_now).any(),
                  resetting.any() if resetting is not None else invalid.any(), term_now.any()]
        flags = torch.stack(checks).tolist()  # the one host sync per step
        if flags[0]:
            bad = int(invalid.nonzero()[0])
            raise ValueError(f"action {int(a[bad])} for env {bad} is outside the action space [0, {V})")
        if not flags[1] and not self._pending and not (resetting is not None and flags[4]):
            if flags[3]:  # live slots, all held
                raise ValueError("hold covers every live slot and no reply is out: the step would do nothing")
            raise RuntimeError("step() called after every episode ended (terminated or truncated); call reset() first")
        if self.masker is not None and flags[1]:  # a forbidden action is refused before anything changes
            self.masker.take(active, a_safe, self.gen_len)

        col = (self.gen_len + P).clamp(max=self.seq_len - 1).unsqueeze(1)
        self.tokens.scatter_(1, col, torch.where(active, a, self.tokens.gather(1, col)[:, 0]).unsqueeze(1))
        self.attention_mask.scatter_(1, col, (active | self.attention_mask.gather(1, col)[:, 0]).unsqueeze(1))
        self.action_mask.scatter_(1, col, (active | self.action_mask.gather(1, col)[:, 0]).unsqueeze(1))
        self.last_action = torch.where(active, self.gen_len, self.last_action)
        self.gen_len += active.long()
        reward = torch.zeros(self.num_envs, dtype=torch.float32, device=self.device)
        info: dict[str, Any] = {}
        answered = False
        if self.multi_turn:
            self.reply_len.zero_()
            self.replied = []
            if flags[5] or self._pending:  # the env answers ended turns, or ends or truncates those episodes
                answered = True
                term_now, trunc_now, ended = self._answer_turns(term_now if flags[5] else None, term_now, trunc_now, active, reward)
                done_now = term_now | trunc_now
                info["reply_len"] = self.reply_len.clone()
                flags[2] = flags[2] or ended
                flags[3] = bool((~(self.terminated | self.truncated | done_now)).any())
        self.terminated |= term_now
        self.truncated |= trunc_now
        self.all_done = not flags[3]

        if flags[2]:
            t0 = time.perf_counter()
            self._score_events(done_now, delim_now, reward, info)
            self.reward_seconds += time.perf_counter() - t0
        if (flags[2] or answered) and not bool(torch.isfinite(reward).all()):  # each part was finite; their sum is not
            slot = int((~torch.isfinite(reward)).nonzero()[0])
            raise ValueError(f"the rewards of episode slot {slot} add up to {float(reward[slot])} in float32 this step "
                             f"(turn reward, step scores and outcome are each finite; their sum overflows): scale them down")
        self.ended = done_now.nonzero().flatten().tolist() if flags[2] else []
        if self.ended and self._ends_episodes:
            self._episodes_over(trunc_now)
        if resetting is not None:
            term_out, trunc_out = term_now, trunc_now
            self.restarted = resetting.nonzero().flatten().tolist() if flags[4] else []
            if self.restarted:
                slots = self.restarted
                if self._queue is None:
                    self._fill(slots, self.task.batch(self.np_random, len(slots)), slots)
                else:
                    self._fill(slots, self._queue[:len(slots)], slots)
                    self.episode_id[slots] = torch.arange(self._queued, self._queued + len(slots), device=self.device)
                    self._queue, self._queued = self._queue[len(slots):], self._queued + len(slots)
            self._needs_reset = done_now
            if self._queue is not None:  # slots the list has no episode left for go idle now
                rest = self.ended[len(self._queue):]
                if rest:
                    self.idle[rest] = True
                    self._needs_reset[rest] = False
                    self._n_idle += len(rest)
                self.all_done = self._n_idle == self.num_envs
        else:
            term_out, trunc_out = self.terminated.clone(), self.truncated.clone()
        info.update(self._info())
        return self._obs(), reward, term_out, trunc_out, info

    def _episodes_over(self, trunc_now: torch.Tensor) -> None:
        """Tell the task which of the ended rows it did not end itself (truncated), with the unfinished agent turn
        of a row whose budget ran out mid-turn."""
        P = self.max_prompt_len
        for s in [s for s in self.ended if bool(trunc_now[s])]:
            history = list(self.history[s])
            partial = None
            if len(history) % 2 == 0:  # the agent was mid-turn (no turn of its own waits for a reply)
                ids = self.tokens[s, P + int(self.turn_start[s]):P + int(self.gen_len[s])].tolist()
                partial = self.tokenizer.decode(ids, skip_special_tokens=True)
            self.task.episode_over(self.samples[s], history, partial)

    # ------------------------------------------------------------------ views
    @property
    def pending_replies(self) -> bool:
        """Whether any row waits for a reply still out (a multi-turn task's ``reply_grace``)."""
        return bool(self._pending)

    def stop_rule(self) -> StopRule:
        """What ends an agent turn, as an inference engine can be told it (:class:`~tokengym.envs.rollout_env.StopRule`)."""
        return self._stops.rule

    def render(self) -> list[str] | None:
        if self.render_mode != "ansi":
            return None
        texts = self.tokenizer.batch_decode(self.generated_ids(range(self.num_envs)), skip_special_tokens=True)
        return [p + t for p, t in zip(self.prompts, texts)]

    def close(self, **kwargs: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

"""The episode store of a token env: its N rows of buffers, how episodes are started in them, and what reads them.

One row per slot, on the env's device: the token buffer ``[N, P + M]`` with its attention and action masks, the
per-token reward record ``[N, M]`` (rewards, process rewards, step ends, turn rewards), per-row flags and counters,
and host lists of each row's sample, history and texts. :meth:`_fill` starts episodes in rows (left-padded prompts,
cleared state), from a batch or an ``episodes`` list (:meth:`_start_episodes`); :meth:`record` and the views read
them. The env's persistent state (:meth:`state_dict`, pickling)
is the prompt stream's position and its reward functions, not the buffers.
"""

from __future__ import annotations

import concurrent.futures as cf
import warnings
from typing import Any, Sequence

import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from tokengym.envs.chat import check_roles, encode_prompts, is_messages, prompt_texts
from tokengym.envs.multiturn import TURN_EVENTS
from tokengym.rewards.common import TokengymWarning

__all__ = ["EpisodeStore"]


class EpisodeStore:
    """The buffers of :class:`~tokengym.envs.TokenVectorEnv` (public attributes of the env, which the rollout loops
    read), their writes at episode start and their reads: :meth:`record`, :meth:`generated_ids` and the views."""

    # ------------------------------------------------------------------ buffers

    def _alloc(self) -> None:
        N, L, M, dev = self.num_envs, self.seq_len, self.max_new_tokens, self.device
        self.tokens = torch.full((N, L), self.pad_id, dtype=torch.long, device=dev)
        self.attention_mask = torch.zeros((N, L), dtype=torch.bool, device=dev)
        self.action_mask = torch.zeros((N, L), dtype=torch.bool, device=dev)
        self.last_action = torch.zeros(N, dtype=torch.long, device=dev)  # generation column of the newest action
        self.turn_start = torch.zeros(N, dtype=torch.long, device=dev)  # where the current agent turn began
        self.reply_len = torch.zeros(N, dtype=torch.long, device=dev)  # reply tokens appended by the last step
        self.turn_counts = {k: torch.zeros(N, dtype=torch.long, device=dev)
                            for k in (*TURN_EVENTS, *self.task.turn_events)}
        """Each row's multi-turn events in its current episode (see :data:`TURN_EVENTS`)."""
        self.turn_rewards = torch.zeros((N, M), dtype=torch.float32, device=dev)
        self.history: list[list[str]] = [[] for _ in range(N)]
        self.replied: list[int] = []  # rows that got a reply in the last step (host list, for the rollout engine)
        self.waiting = torch.zeros(N, dtype=torch.bool, device=dev)  # rows whose reply is still out (reply_grace)
        self._pending: dict[int, tuple[cf.Future, float]] = {}
        self.gen_len = torch.zeros(N, dtype=torch.long, device=dev)
        self.terminated = torch.zeros(N, dtype=torch.bool, device=dev)
        self.truncated = torch.zeros(N, dtype=torch.bool, device=dev)
        self.rewards = torch.zeros((N, M), dtype=torch.float32, device=dev)
        self.process_rewards = torch.zeros((N, M), dtype=torch.float32, device=dev)
        self.step_end = torch.zeros((N, M), dtype=torch.bool, device=dev)
        self.outcome = torch.zeros(N, dtype=torch.float32, device=dev)
        self.group_id = torch.zeros(N, dtype=torch.long, device=dev)
        self._needs_reset = torch.zeros(N, dtype=torch.bool, device=dev)
        self._arange_n = torch.arange(N, device=dev)
        self.samples: list[dict[str, Any]] = [{} for _ in range(N)]
        self.step_scores: list[list[float]] = [[] for _ in range(N)]
        self.completions: list[str | None] = [None] * N
        self.reward_components: list[dict[str, float]] = [{} for _ in range(N)]
        self._next_group = 0
        self.episode_id = torch.full((N,), -1, dtype=torch.long, device=dev)
        """Each slot's episode: its slot in a ``disabled``-mode batch, its entry in an ``episodes`` list in ``next_step``
        mode (-1: none); what a rollout keys each episode's sampling stream by."""
        self.idle = torch.zeros(N, dtype=torch.bool, device=dev)
        """Slots with no episode left to run (``episodes`` list exhausted); their actions are ignored."""
        self.ended: list[int] = []  # slots whose episode ended in the last step (host list)
        self.restarted: list[int] = []  # slots that the last step reset with a new episode (host list)
        self._queue: list[dict[str, Any]] | None = None  # episodes not started yet (next-step mode with a list)
        self._unk_checked = 0  # prompts checked for characters the tokenizer lacks
        self._started = False
        self.reward_seconds = 0.0  # wall time spent decoding and scoring (reward/PRM calls), cumulative
        self.all_done = False  # every slot finished (a host bool, updated by step() at no extra sync)

    # ------------------------------------------------------------------ episodes into rows
    def _fill(self, slots: list[int], samples: list[dict[str, Any]], groups: list[int]) -> None:
        """Write prompts into ``slots`` and clear those slots' episode state."""
        if not slots:
            return
        P = self.max_prompt_len
        for s in samples:
            if not (isinstance(s.get("prompt"), str) or is_messages(s.get("prompt"))):
                raise ValueError(f"each sample needs a 'prompt' string or list of chat messages, got {s!r:.80}")
            check_roles(s["prompt"], "a sample's prompt")
        own = [s.get("prompt_ids") for s in samples]  # a task that renders its own prompts gives their ids
        rest = iter(encode_prompts(self.tokenizer, [s["prompt"] for s, o in zip(samples, own) if o is None])
                    if None in own else [])
        enc = [list(o) if o is not None else next(rest) for o in own]
        longest = max(len(ids) for ids in enc)
        if longest > P:
            i = max(range(len(enc)), key=lambda k: len(enc[k]))
            raise ValueError(
                f"prompt of {longest} tokens exceeds max_prompt_len={P}: {str(samples[i]['prompt'])[:60]!r}; "
                "pass a larger max_prompt_len or shorten the prompt"
            )
        self._warn_unknown(samples, enc)
        rows = torch.full((len(slots), P), self.pad_id, dtype=torch.long)
        for r, ids in enumerate(enc):
            rows[r, P - len(ids):] = torch.tensor(ids, dtype=torch.long)
        # the mask comes from the lengths: a chat model's pad token may also be its end-of-turn marker, which
        # its template writes inside prompts
        real = torch.arange(P) >= P - torch.tensor([len(ids) for ids in enc])[:, None]
        idx = torch.tensor(slots, device=self.device)
        rows = rows.to(self.device)
        self.tokens[idx] = self.pad_id
        self.tokens[idx, :P] = rows
        self.attention_mask[idx] = False
        self.attention_mask[idx, :P] = real.to(self.device)
        for buf in (self.gen_len, self.terminated, self.truncated, self.rewards, self.process_rewards,
                    self.step_end, self.outcome, self._needs_reset, self.action_mask, self.last_action,
                    self.turn_start, self.reply_len, self.turn_rewards, self.waiting, *self.turn_counts.values()):
            buf[idx] = 0
        gid = torch.tensor([self._next_group + g for g in groups], device=self.device)
        self.group_id[idx] = gid.repeat_interleave(self.group_size)
        self._next_group += self.n_groups
        if self.masker is not None:
            self.masker.start(slots, samples)
        for s, sample in zip(slots, samples):
            self.samples[s] = sample
            self.history[s] = []
            self._pending.pop(s, None)  # a reply still out for the slot's previous episode is dropped
            self.step_scores[s] = []
            self.completions[s] = None
            self.reward_components[s] = {}

    def _start_episodes(self, options: dict[str, Any]):
        """``reset(options={"episodes": prompts})``: start the list's first ``N`` prompts, queue the rest."""
        if self.autoreset_mode is not AutoresetMode.NEXT_STEP:
            raise ValueError("options['episodes'] runs a list through next-step autoresets: create the env with "
                             "autoreset_mode='next_step' (in 'disabled' mode pass options['samples'], one batch at a time)")
        if set(options) & {"samples", "reset_mask"}:
            raise ValueError("options['episodes'] starts every slot from the list; it does not combine with 'samples' or 'reset_mask'")
        episodes = options["episodes"]
        if isinstance(episodes, (int, np.integer)) and not isinstance(episodes, bool):
            episodes = self.task.batch(self.np_random, int(episodes))  # the task's next n prompts
        queue = [s if isinstance(s, dict) else {"prompt": s} for s in episodes]
        if not queue:
            raise ValueError("options['episodes'] is empty: give at least one prompt")
        n = min(len(queue), self.num_envs)
        self._fill(list(range(n)), queue[:n], list(range(n)))
        self.episode_id[:n] = torch.arange(n, device=self.device)
        if n < self.num_envs:  # more slots than episodes: the rest idle from the start
            self._fill(list(range(n, self.num_envs)), [queue[0]] * (self.num_envs - n), list(range(n, self.num_envs)))
            self.idle[n:] = True
        self._queue, self._queued, self._n_idle = queue[n:], n, self.num_envs - n
        self._started = True
        self.all_done = False
        return self._obs(), self._info()

    def _warn_unknown(self, samples: list[dict[str, Any]], enc: list[list[int]]) -> None:
        """Warn (once per text) when prompts or answers hold characters the tokenizer maps to its unknown token:
        such an answer can never be generated, and such a prompt is not what the model sees."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is None or self._unk_checked >= 4096:  # a sample of the data is enough to tell
            return
        self._unk_checked += len(samples)
        answers = [str(s["answer"]) for s in samples if s.get("answer") is not None]
        ids = enc + (self.tokenizer(answers, add_special_tokens=False)["input_ids"] if answers else [])
        texts = prompt_texts(self.tokenizer, [s["prompt"] for s in samples]) + answers
        bad = sorted({c for t, i in zip(texts, ids) if unk in i for c in t
                      if unk in self.tokenizer(c, add_special_tokens=False)["input_ids"]})
        if bad:
            warnings.warn(f"the tokenizer has no token for {''.join(bad)!r} (in {self.task.name} prompts or answers): "
                          "those characters become its unknown token, so such answers can never be generated",
                          TokengymWarning, stacklevel=4)

    # ------------------------------------------------------------------ state
    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the task's own reward functions, which ``__setstate__`` asks the task for again: a
        ``reward()`` may return a nested function (the usual way to write one), and an async run's rollout workers
        receive the env pickled."""
        state = dict(self.__dict__)
        own, own_process = state.get("_task_scores", (False, False))
        if own:
            state["reward_fn"] = None
        if own_process:
            state["process_reward_fn"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        own, own_process = state.get("_task_scores", (False, False))
        if own:
            self.reward_fn = self.task.reward()
        if own_process:
            self.process_reward_fn = self.task.process_reward()

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position (generator state, task walk, next group id), for exact resume.

        Only plain Python values, so it round-trips through JSON and ``torch.load(weights_only=True)``.
        Episode buffers are not included: save between lockstep batches, as the agents do.
        """
        return {"np_random": self.np_random.bit_generator.state, "next_group": self._next_group,
                "task": self.task.state_dict(self.np_random)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the prompt stream from a :meth:`state_dict` (the env must be built with the same task)."""
        missing = {"np_random", "next_group", "task"} - set(state)
        if missing:
            raise ValueError(f"env state is missing {sorted(missing)}; was it written by TokenVectorEnv.state_dict()?")
        self.np_random  # creates the generator if the env was never seeded
        self.np_random.bit_generator.state = state["np_random"]
        self._next_group = int(state["next_group"])
        self.task.load_state_dict(state["task"], self.np_random)

    # ------------------------------------------------------------------ views
    def generated_ids(self, slots: Sequence[int]) -> list[list[int]]:
        """Generated token ids of ``slots`` (host lists)."""
        P = self.max_prompt_len
        rows = self.tokens[torch.tensor(list(slots), device=self.device), P:].tolist()
        lens = self.gen_len[torch.tensor(list(slots), device=self.device)].tolist()
        return [r[:n] for r, n in zip(rows, lens)]

    def _obs(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens.clone(), "mask": self.attention_mask.clone(), "action_mask": self.action_mask.clone()}

    def _info(self) -> dict[str, Any]:
        return {"group_id": self.group_id.clone()}

    @property
    def turn_stats(self) -> dict[str, int]:
        """The current episodes' multi-turn events, summed over rows (see :data:`TURN_EVENTS`)."""
        return {k: int(v.sum()) for k, v in self.turn_counts.items()}

    @property
    def done(self) -> torch.Tensor:
        """Bool ``[N]``: the slot's episode has ended (terminated or truncated)."""
        return self.terminated | self.truncated

    @property
    def finished(self) -> torch.Tensor:
        """Bool ``[N]``: slots with nothing left to run: an ended episode in ``disabled`` mode, an :attr:`idle` slot in
        ``next_step`` mode (where an ended episode is followed by the next)."""
        return self.idle if self.autoreset_mode is AutoresetMode.NEXT_STEP else self.done

    @property
    def prompts(self) -> list[str]:
        """Each slot's prompt as text (chat prompts rendered by the template)."""
        return prompt_texts(self.tokenizer, [s.get("prompt", "") for s in self.samples])

    def record(self, slots: Sequence[int] | None = None) -> dict[str, Any]:
        """The episodes in ``slots`` (default: all) as they stand: the fields of a rollout batch but its log-probs
        (``tokens``, masks, per-token rewards ``[n, M]``, ``outcome``, flags, group ids, texts, reward components,
        multi-turn counts), every tensor a copy. A task whose ``outcome_is_return`` (an adapter of a library env,
        whose rewards all come per turn) has its turn rewards folded into ``outcome`` (``turn_rewards`` is then
        ``None``), so that metrics and evaluation read the episode's return, counted once."""
        P = self.max_prompt_len
        idx = slice(None) if slots is None else torch.tensor(list(slots), dtype=torch.long, device=self.device)
        pick = range(self.num_envs) if slots is None else list(slots)
        outcome = self.outcome[idx].clone()
        turn_rewards = self.turn_rewards[idx].clone() if self.multi_turn else None
        if turn_rewards is not None and getattr(self.task, "outcome_is_return", False):
            outcome, turn_rewards = outcome + turn_rewards.sum(1), None
        comps = [self.reward_components[i] for i in pick]
        names = sorted({k for c in comps for k in c})
        return dict(
            tokens=self.tokens[idx].clone(), attention_mask=self.attention_mask[idx].clone(),
            action_mask=self.action_mask[idx, P:].clone(), prompt_len=P, rewards=self.rewards[idx].clone(),
            process_rewards=self.process_rewards[idx].clone(), step_end=self.step_end[idx].clone(), outcome=outcome,
            terminated=self.terminated[idx].clone(), truncated=self.truncated[idx].clone(),
            group_id=self.group_id[idx].clone(), group_size=self.group_size,
            completions=[self.completions[i] for i in pick], samples=[self.samples[i] for i in pick],
            step_scores=[list(self.step_scores[i]) for i in pick],
            reward_components={k: torch.tensor([c.get(k, 0.0) for c in comps], device=self.device) for k in names},
            turn_rewards=turn_rewards,
            turn_counts={k: v[idx].clone() for k, v in self.turn_counts.items()} if self.multi_turn else {},
            token_masks=self.masker.record(idx) if self.masker is not None else None,
        )

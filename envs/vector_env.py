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
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from tokengym.envs.masks import ActionMasker, EveryTurn, grammar_text
from tokengym.envs.chat import check_chat_template, check_roles, encode_prompts, end_of_turn_ids, is_messages, prompt_texts, template_overhead
from tokengym.envs.multiturn import TURN_EVENTS, DaemonPool, MultiTurnMixin, chat_reply_wrapper
from tokengym.envs.rollout_env import StopRule
from tokengym.envs.tasks.base import Task
from tokengym.envs.tasks.registry import TASK_SPECS
from tokengym.envs.tokenizer import load_tokenizer
from tokengym.rewards.common import TokengymWarning
from tokengym.rewards.protocols import check_reward, score_outcome, score_process

__all__ = ["TokenVectorEnv", "resolve_task"]


def resolve_task(task: str | Task, **task_kwargs: Any) -> Task:
    """A :class:`Task` from a registered name (``"arithmetic"``, ``"calculator"``, ...: the keys of
    :data:`~tokengym.envs.tasks.registry.TASK_SPECS`) or instance."""
    if isinstance(task, Task):
        if task_kwargs:
            raise TypeError(f"got a Task instance and extra task arguments {sorted(task_kwargs)}; pass one or the other")
        return task
    if not isinstance(task, str) or task not in TASK_SPECS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASK_SPECS)} or pass a Task instance")
    return TASK_SPECS[task].cls(**task_kwargs)


def _parse_mode(mode: Any) -> AutoresetMode:
    if isinstance(mode, AutoresetMode):
        return mode
    by_name = {m.name.lower(): m for m in AutoresetMode} | {m.value.lower(): m for m in AutoresetMode}
    key = str(mode).lower().replace("-", "_")
    if key not in by_name or by_name[key] is AutoresetMode.SAME_STEP:
        raise ValueError(f"autoreset_mode {mode!r} is not supported; use 'disabled' or 'next_step'")
    return by_name[key]



def _with_index(device: Any) -> torch.device:
    """``device`` with its index: tensors made on ``"cuda"`` report ``cuda:<current>``, and the env compares devices."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d

MAX_COLUMNS = 2**20
"""The largest buffer dimension an env accepts (rows, prompt or generation columns): beyond it, allocation fails."""


class TokenVectorEnv(MultiTurnMixin, VectorEnv):
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
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or not 1 <= num_envs <= MAX_COLUMNS:
            raise ValueError(f"num_envs must be an int from 1 to {MAX_COLUMNS}, got {num_envs!r}")
        if not isinstance(group_size, int) or group_size < 1 or num_envs % group_size:
            raise ValueError(f"num_envs={num_envs} must be a positive multiple of group_size={group_size!r}")
        for name, v in (("max_new_tokens", max_new_tokens), ("max_prompt_len", max_prompt_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= MAX_COLUMNS):
                raise ValueError(f"{name} must be None (the task's default) or an int from 1 to {MAX_COLUMNS}, got {v!r}")
        if reward is not None:
            check_reward(reward, "reward")
        if process_reward is not None and not isinstance(process_reward, bool):
            check_reward(process_reward, "process_reward")
        self.task = resolve_task(task, **task_kwargs)
        self.tokenizer = load_tokenizer(tokenizer)
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
        self.device = _with_index(device)
        self.max_new_tokens = int(max_new_tokens if max_new_tokens is not None else self.task.default_max_new_tokens)
        self.max_prompt_len = int(max_prompt_len if max_prompt_len is not None else self._default_prompt_len())
        mode = _parse_mode(autoreset_mode)
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
        stops = list(stop_strings if stop_strings is not None else self.task.stop_strings)
        self._markers = [*stops, *self.task.turn_stop_strings] if self.multi_turn else stops
        self._build_lookups(self._markers)
        wrap = chat_reply_wrapper(self.tokenizer, self.task.reply_role) if self.multi_turn and self.task.chat else ("", "")
        # the role markers around a reply, tokenized once with their special tokens (a reply's own text never has any)
        self._wrap_ids = tuple(list(ids) for ids in self.tokenizer(list(wrap), add_special_tokens=False)["input_ids"])
        self._pool: DaemonPool | None = None  # tool replies (multi-turn), started on the first one
        self._alloc()
        self.masker = self._make_masker(grammar, action_mask_fn)
        """The env's :class:`~tokengym.envs.masks.ActionMasker` (``None``: the env does not mask its actions)."""

    # ------------------------------------------------------------------ set-up
    def _default_prompt_len(self) -> int:
        """Room for the task's longest prompt: one token per character (+ BOS and a spare); chat prompts add the
        template's own tokens, measured on one of the task's prompts."""
        extra = 2
        if self.task.chat:
            extra += template_overhead(self.tokenizer, self.task.sample(np.random.default_rng(0))["prompt"])
        return self.task.max_prompt_chars + extra

    def _make_masker(self, grammar: Any, fn: Callable | None) -> ActionMasker | None:
        """Masks from ``action_mask_fn``, else ``grammar`` (default: the task's, per agent turn: ``task.grammar_for``)."""
        if grammar is False:  # the task's grammar off: free text
            if fn is not None:
                raise ValueError("grammar=False and an action_mask_fn: pass one or the other")
            return None
        if fn is not None and grammar is not None:
            raise ValueError("pass grammar or action_mask_fn, not both")
        if fn is not None:
            if not callable(fn):
                raise TypeError(f"action_mask_fn must be callable (sample, generated_ids) -> allowed, got {fn!r:.60}")
            return ActionMasker(self.num_envs, self.max_new_tokens, self.vocab_size, self.tokenizer, self.device, fn=fn)
        if grammar is not None:
            grammar_text(grammar)  # a bad grammar (or a missing llguidance) fails here, in one line
            spec_for = EveryTurn(grammar)
        elif getattr(self.task, "grammar", None) is not None or type(self.task).grammar_for is not Task.grammar_for:
            spec_for = self.task.grammar_for
        else:
            return None
        return ActionMasker(self.num_envs, self.max_new_tokens, self.vocab_size, self.tokenizer, self.device,
                            spec_for=spec_for)

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

    def _build_lookups(self, stop_strings: Sequence[str]) -> None:
        V, dev, tok = self.vocab_size, self.device, self.tokenizer
        is_stop = torch.zeros(V, dtype=torch.bool)
        eos = tok.eos_token_id
        for i in [*(eos if isinstance(eos, (list, tuple)) else [eos]), *end_of_turn_ids(tok)]:
            is_stop[int(i)] = True
        self.stop_sequences: list[torch.Tensor] = []
        texts: list[str] = []
        for s in stop_strings:
            ids = tok(s, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"stop string {s!r} encodes to no tokens")
            if len(ids) == 1:
                is_stop[ids[0]] = True
            else:
                self.stop_sequences.append(torch.tensor(ids, device=dev))
                texts.append(s)
        self._is_stop = is_stop.to(dev)
        self._stop_rule = StopRule(tuple(is_stop.nonzero().flatten().tolist()),
                                   tuple(tuple(q.tolist()) for q in self.stop_sequences), tuple(texts))
        self._is_delim = None
        delim = self.task.step_delimiter
        self._turn_steps = self.process_reward_fn is not None and not delim and self.multi_turn  # each agent turn is a step
        if self.process_reward_fn is not None and not self._turn_steps:
            if not delim:
                raise ValueError(f"task {self.task.name!r} has no step_delimiter (and is not multi-turn, where each agent "
                                 "turn would be a step), so a process reward cannot be placed")
            texts = tok.convert_ids_to_tokens(list(range(V)))
            pieces = [tok.convert_tokens_to_string([t]) if t is not None else "" for t in texts]
            self._is_delim = torch.tensor([delim in p for p in pieces], dtype=torch.bool, device=dev)

    def _alloc(self) -> None:
        N, L, M, dev = self.num_envs, self.seq_len, self.max_new_tokens, self.device
        self.tokens = torch.full((N, L), self.pad_id, dtype=torch.long, device=dev)
        self.attention_mask = torch.zeros((N, L), dtype=torch.bool, device=dev)
        self.action_mask = torch.zeros((N, L), dtype=torch.bool, device=dev)
        self.last_action = torch.zeros(N, dtype=torch.long, device=dev)  # generation column of the newest action
        self.turn_start = torch.zeros(N, dtype=torch.long, device=dev)  # where the current agent turn began
        self.reply_len = torch.zeros(N, dtype=torch.long, device=dev)  # reply tokens appended by the last step
        self.turn_counts = {k: torch.zeros(N, dtype=torch.long, device=dev) for k in TURN_EVENTS}
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

    def _fill(self, slots: list[int], samples: list[dict[str, Any]], groups: list[int]) -> None:
        """Write prompts into ``slots`` and clear those slots' episode state."""
        if not slots:
            return
        P = self.max_prompt_len
        for s in samples:
            if not (isinstance(s.get("prompt"), str) or is_messages(s.get("prompt"))):
                raise ValueError(f"each sample needs a 'prompt' string or list of chat messages, got {s!r:.80}")
            check_roles(s["prompt"], "a sample's prompt")
        enc = encode_prompts(self.tokenizer, [s["prompt"] for s in samples])
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
        stop = self._is_stop[a_safe] | self._stop_sequence_hit(a_safe)
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

    def _stop_sequence_hit(self, a: torch.Tensor) -> torch.Tensor:
        hit = torch.zeros_like(a, dtype=torch.bool)
        for seq in self.stop_sequences:
            k = seq.numel()
            cols = (self.gen_len + self.max_prompt_len).unsqueeze(1) + torch.arange(-(k - 1), 0, device=self.device)
            prev = self.tokens.gather(1, cols.clamp(min=0))
            # only the agent's current turn counts: an env reply before it never completes a marker
            hit |= (self.gen_len - self.turn_start >= k - 1) & (prev == seq[:-1]).all(1) & (a == seq[-1])
        return hit

    # ------------------------------------------------------------------ rewards
    def generated_ids(self, slots: Sequence[int]) -> list[list[int]]:
        """Generated token ids of ``slots`` (host lists)."""
        P = self.max_prompt_len
        rows = self.tokens[torch.tensor(list(slots), device=self.device), P:].tolist()
        lens = self.gen_len[torch.tensor(list(slots), device=self.device)].tolist()
        return [r[:n] for r, n in zip(rows, lens)]

    def _fields(self, slots: Sequence[int]) -> tuple[list[str], dict[str, list]]:
        prompts = prompt_texts(self.tokenizer, [self.samples[s]["prompt"] for s in slots])
        keys = [k for k in self.samples[slots[0]] if k != "prompt"]
        return prompts, {k: [self.samples[s].get(k) for s in slots] for k in keys}

    def _score_events(self, done_now, delim_now, reward: torch.Tensor, info: dict[str, Any]) -> None:
        """Score, in one batched call each, the slots that ended a step and those that ended an episode."""
        events = done_now if delim_now is None else done_now | delim_now
        slots = events.nonzero().flatten().tolist()
        if not slots:  # only agent turns that the env answered
            return
        done_set = set(done_now.nonzero().flatten().tolist())
        texts = self.tokenizer.batch_decode(self.generated_ids(slots), skip_special_tokens=True)
        last = self.last_action  # the newest agent token (env replies are not actions)
        if self._is_delim is not None:
            self._score_steps(slots, texts, done_set, last, reward)
        ended = [s for s in slots if s in done_set]
        if ended:
            by_slot = dict(zip(slots, texts))
            completions = [by_slot[s] for s in ended]
            prompts, fields = self._fields(ended)
            total, comps = score_outcome(self.reward_fn, prompts, completions, fields)
            idx = torch.tensor(ended, device=self.device)
            total = total.to(self.device)
            self.outcome[idx] = total
            self.rewards[idx, last[idx]] += total
            reward[idx] += total
            for j, s in enumerate(ended):
                self.completions[s] = completions[j]
                self.reward_components[s] = {k: float(v[j]) for k, v in comps.items()}
            mask = np.zeros(self.num_envs, dtype=bool)
            mask[ended] = True
            completion_arr = np.array([self.completions[i] for i in range(self.num_envs)], dtype=object)
            info.update(
                completion=completion_arr,
                _completion=mask,
                episode_return=self.rewards.sum(1),
                _episode_return=mask,
                reward_components={k: self._scatter(idx, v) for k, v in comps.items()},
                _reward_components=mask,
            )

    def _scatter(self, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.num_envs, dtype=torch.float32, device=self.device)
        out[idx] = values.to(self.device)
        return out

    def _score_steps(self, slots, texts, done_set, last, reward) -> None:
        delim = self.task.step_delimiter
        todo, steps_todo, new_counts = [], [], []
        for s, text in zip(slots, texts):
            pieces = text.split(delim)
            steps = [p for p in pieces[:-1] if p.strip()]
            if s in done_set and pieces[-1].strip():
                steps.append(pieces[-1])
            if len(steps) > len(self.step_scores[s]):
                todo.append(s)
                steps_todo.append(steps)
                new_counts.append(len(steps) - len(self.step_scores[s]))
        if not todo:
            return
        prompts, fields = self._fields(todo)
        scores = score_process(self.process_reward_fn, prompts, steps_todo, fields)
        values = []
        for s, row, k in zip(todo, scores, new_counts):
            self.step_scores[s] = row
            values.append(sum(row[-k:]))
        idx = torch.tensor(todo, device=self.device)
        v = torch.tensor(values, dtype=torch.float32, device=self.device)
        pos = last[idx]
        self.process_rewards[idx, pos] += v
        self.rewards[idx, pos] += v
        self.step_end[idx, pos] = True
        reward[idx] += v

    # ------------------------------------------------------------------ views
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
    def pending_replies(self) -> bool:
        """Whether any row waits for a reply still out (a multi-turn task's ``reply_grace``)."""
        return bool(self._pending)

    def stop_rule(self) -> StopRule:
        """What ends an agent turn, as an inference engine can be told it (:class:`~tokengym.envs.rollout_env.StopRule`)."""
        return self._stop_rule

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

    @property
    def finished(self) -> torch.Tensor:
        """Bool ``[N]``: slots with nothing left to run: an ended episode in ``disabled`` mode, an :attr:`idle` slot in
        ``next_step`` mode (where an ended episode is followed by the next)."""
        return self.idle if self.autoreset_mode is AutoresetMode.NEXT_STEP else self.done

    @property
    def prompts(self) -> list[str]:
        """Each slot's prompt as text (chat prompts rendered by the template)."""
        return prompt_texts(self.tokenizer, [s.get("prompt", "") for s in self.samples])

    def render(self) -> list[str] | None:
        if self.render_mode != "ansi":
            return None
        texts = self.tokenizer.batch_decode(self.generated_ids(range(self.num_envs)), skip_special_tokens=True)
        return [p + t for p, t in zip(self.prompts, texts)]

    def close(self, **kwargs: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

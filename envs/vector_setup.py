"""What :class:`~tokengym.envs.TokenVectorEnv`'s constructor arguments resolve to: the task, the buffer sizes, the
autoreset mode, the device and the action masker. Each check raises one line naming the argument, before any
buffer is allocated."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from tokengym.envs.chat import template_overhead
from tokengym.envs.masks import ActionMasker, EveryTurn, grammar_text
from tokengym.envs.tasks.base import Task
from tokengym.envs.tasks.registry import TASK_SPECS

__all__ = ["MAX_COLUMNS", "check_sizes", "default_prompt_len", "make_masker", "parse_mode", "resolve_task", "with_index"]

MAX_COLUMNS = 2**20
"""The largest buffer dimension an env accepts (rows, prompt or generation columns): beyond it, allocation fails."""


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


def check_sizes(num_envs: Any, group_size: Any, max_new_tokens: Any, max_prompt_len: Any) -> None:
    """Refuse a slot count, group size or buffer length the env cannot hold."""
    if not isinstance(num_envs, int) or isinstance(num_envs, bool) or not 1 <= num_envs <= MAX_COLUMNS:
        raise ValueError(f"num_envs must be an int from 1 to {MAX_COLUMNS}, got {num_envs!r}")
    if not isinstance(group_size, int) or group_size < 1 or num_envs % group_size:
        raise ValueError(f"num_envs={num_envs} must be a positive multiple of group_size={group_size!r}")
    for name, v in (("max_new_tokens", max_new_tokens), ("max_prompt_len", max_prompt_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= MAX_COLUMNS):
            raise ValueError(f"{name} must be None (the task's default) or an int from 1 to {MAX_COLUMNS}, got {v!r}")


def parse_mode(mode: Any) -> AutoresetMode:
    """An :class:`AutoresetMode` from itself or its name/value (``"disabled"``, ``"next-step"``, ...); ``SAME_STEP``
    is not supported."""
    if isinstance(mode, AutoresetMode):
        return mode
    by_name = {m.name.lower(): m for m in AutoresetMode} | {m.value.lower(): m for m in AutoresetMode}
    key = str(mode).lower().replace("-", "_")
    if key not in by_name or by_name[key] is AutoresetMode.SAME_STEP:
        raise ValueError(f"autoreset_mode {mode!r} is not supported; use 'disabled' or 'next_step'")
    return by_name[key]


def with_index(device: Any) -> torch.device:
    """``device`` with its index: tensors made on ``"cuda"`` report ``cuda:<current>``, and the env compares devices."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def default_prompt_len(task: Task, tokenizer: Any) -> int:
    """Room for the task's longest prompt: one token per character (+ BOS and a spare); chat prompts add the
    template's own tokens, measured on one of the task's prompts."""
    extra = 2
    if task.chat:
        extra += template_overhead(tokenizer, task.sample(np.random.default_rng(0))["prompt"])
    return task.max_prompt_chars + extra


def make_masker(task: Task, grammar: Any, fn: Callable | None, num_envs: int, max_new_tokens: int, vocab_size: int,
                tokenizer: Any, device: torch.device) -> ActionMasker | None:
    """Masks from ``fn`` (an ``action_mask_fn``), else ``grammar`` (default: the task's, per agent turn:
    ``task.grammar_for``); ``None`` where the env does not mask (``grammar=False``, or a task without a grammar)."""
    if grammar is False:  # the task's grammar off: free text
        if fn is not None:
            raise ValueError("grammar=False and an action_mask_fn: pass one or the other")
        return None
    if fn is not None and grammar is not None:
        raise ValueError("pass grammar or action_mask_fn, not both")
    if fn is not None:
        if not callable(fn):
            raise TypeError(f"action_mask_fn must be callable (sample, generated_ids) -> allowed, got {fn!r:.60}")
        return ActionMasker(num_envs, max_new_tokens, vocab_size, tokenizer, device, fn=fn)
    if grammar is not None:
        grammar_text(grammar)  # a bad grammar (or a missing llguidance) fails here, in one line
        spec_for = EveryTurn(grammar)
    elif getattr(task, "grammar", None) is not None or type(task).grammar_for is not Task.grammar_for:
        spec_for = task.grammar_for
    else:
        return None
    return ActionMasker(num_envs, max_new_tokens, vocab_size, tokenizer, device, spec_for=spec_for)

"""``TargetTask``: the smallest learnable task, for smoke tests and learning checks of agents."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tokengym.envs.tasks.base import Task
from tokengym.envs.tasks.registry import register_task

__all__ = ["TargetTask"]


@register_task(
    "target", kind="toy", description="emit a fixed target string; the smallest learnable task, for agent smoke tests",
    prompt_format="completion: the fixed target (target='ok'); reward 1 iff exact, or partial_credit=True",
    models="the untrained tiny preset learns it with GRPO or PPO in seconds (agent smoke tests)")
class TargetTask(Task):
    """Reward 1 for generating exactly ``target`` (surrounding whitespace ignored), else 0.

    Prompts are ``n_prompts`` fixed strings (``"p0\\n"``, ``"p1\\n"``, ...) drawn uniformly; the answer
    never depends on the prompt, so a policy only has to learn one string. ``partial_credit=True``
    gives the fraction of ``target`` characters matched in position instead.

    Example:
        >>> t = TargetTask("ok")
        >>> t.reward()(["p0\\n", "p0\\n"], ["ok", "no"])
        [1.0, 0.0]
    """

    name = "target"
    stop_strings = ()
    step_delimiter = None

    def __init__(self, target: str = "ok", n_prompts: int = 4, partial_credit: bool = False, max_new_tokens: int = 8):
        if not isinstance(target, str) or not target:
            raise ValueError(f"target must be a non-empty string, got {target!r}")
        if not isinstance(n_prompts, int) or isinstance(n_prompts, bool) or not 1 <= n_prompts <= 10**6:
            raise ValueError(f"n_prompts must be an int from 1 to 1000000, got {n_prompts!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or not 1 <= max_new_tokens <= 4096:
            raise ValueError(f"max_new_tokens must be an int from 1 to 4096, got {max_new_tokens!r}")
        if max_new_tokens < len(target):
            raise ValueError(f"max_new_tokens={max_new_tokens} cannot fit target {target!r}")
        self.target, self.n_prompts, self.partial_credit = target, n_prompts, partial_credit
        self.max_prompt_chars = len(f"p{n_prompts - 1}\n")
        self.default_max_new_tokens = max_new_tokens

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        i = int(rng.integers(self.n_prompts))
        return {"prompt": f"p{i}\n", "solution": self.target, "answer": self.target}

    def reward(self) -> Callable:
        target, partial = self.target, self.partial_credit

        def target_match(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
            out = []
            for c in completions:
                c = c.strip()
                if partial:
                    out.append(sum(a == b for a, b in zip(c, target)) / max(len(target), len(c)))
                else:
                    out.append(float(c == target))
            return out

        return target_match

"""``TokenEnv``: one prompt, then one generated token per step, as a plain ``gymnasium.Env``.

It is a one-slot :class:`~tokengym.envs.vector_env.TokenVectorEnv` on the CPU with numpy
observations, so single and vector envs share every line of episode logic.

Observation (a ``Dict`` space that ``check_env`` and stable-baselines3 accept):
``tokens`` int64 ``[P + M]`` (prompt left-padded into the first ``P`` slots, generated tokens from
slot ``P`` on, pad after), ``mask`` int8 ``[P + M]`` (1 on real tokens) and ``action_mask`` int8 ``[P + M]`` (1 on
the agent's own tokens). In a multi-turn task one step can add many tokens: the agent's action and then the env's
reply (``info["reply_tokens"]`` of them, with ``info["reply"]`` its text).

An env with a grammar (``grammar=`` or the task's) or an ``action_mask_fn`` masks its actions: :meth:`TokenEnv.action_masks`
and ``info["action_mask"]`` (int8 ``[V]``) say which tokens the next action may be, and a forbidden one is refused.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from tokengym.envs.vector_env import TokenVectorEnv

__all__ = ["TokenEnv"]


class TokenEnv(gym.Env):
    """A single token-level generation episode.

    ``terminated`` is set when a stop token (EOS or a stop string) is emitted, ``truncated`` when
    ``max_new_tokens`` tokens have been generated. At episode end ``info`` carries ``prompt``,
    ``completion`` (decoded text, EOS stripped), ``outcome_reward``, ``reward_components``,
    ``step_rewards`` (PRM scores, when a process reward is on) and ``episode_return``.

    Arguments are those of :class:`TokenVectorEnv` without ``num_envs``/``group_size``/``device``.

    Example:
        >>> env = TokenEnv("arithmetic")
        >>> obs, info = env.reset(seed=0)
        >>> obs["tokens"].dtype, bool(obs["mask"].sum() > 0)
        (dtype('int64'), True)
        >>> obs, r, terminated, truncated, info = env.step(env.unwrapped.tokenizer.eos_token_id)
        >>> terminated, info["completion"]
        (True, '')
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, task: Any = "arithmetic", render_mode: str | None = None, **kwargs: Any):
        for k in ("num_envs", "group_size", "device", "autoreset_mode"):
            if k in kwargs:
                raise TypeError(f"TokenEnv does not take {k!r}; use gymnasium.make_vec for a TokenVectorEnv")
        self.venv = TokenVectorEnv(1, task, **kwargs)
        self.render_mode = render_mode
        v = self.venv
        L = v.seq_len
        self.action_space = spaces.Discrete(v.vocab_size)
        self.observation_space = spaces.Dict(
            {"tokens": spaces.Box(0, v.vocab_size - 1, (L,), np.int64), "mask": spaces.MultiBinary(L),
             "action_mask": spaces.MultiBinary(L)}
        )

    @property
    def tokenizer(self) -> Any:
        return self.venv.tokenizer

    @property
    def task(self) -> Any:
        return self.venv.task

    def _obs(self, obs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        return {"tokens": obs["tokens"][0].numpy(), "mask": obs["mask"][0].numpy().astype(np.int8),
                "action_mask": obs["action_mask"][0].numpy().astype(np.int8)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode. ``options={"prompt": str | dict}`` sets the prompt instead of drawing one."""
        super().reset(seed=seed)
        options = dict(options or {})
        prompt = options.pop("prompt", None)
        if options:
            raise ValueError(f"unknown reset options {sorted(options)}; valid: ['prompt']")
        opts = {"samples": [prompt]} if prompt is not None else None
        obs, _ = self.venv.reset(seed=seed, options=opts)
        info = {"prompt": self.venv.samples[0]["prompt"]}
        if self.venv.masker is not None:
            info["action_mask"] = self.action_masks().astype(np.int8)
        return self._obs(obs), info

    def action_masks(self) -> np.ndarray:
        """Bool ``[V]``: the tokens the next action may be (sb3-contrib MaskablePPO reads this); all true when the env
        does not mask, or the episode has ended."""
        return self.venv.action_masks()[0].cpu().numpy()

    def step(self, action: Any):
        if isinstance(action, torch.Tensor):
            action = action.item() if action.numel() == 1 else action
        a = np.asarray(action)
        if a.shape not in ((), (1,)) or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"action must be one integer token id, got {action!r}")
        obs, r, term, trunc, vinfo = self.venv.step(torch.as_tensor(a.reshape(1), dtype=torch.long))
        terminated, truncated = bool(term[0]), bool(trunc[0])
        info: dict[str, Any] = {}
        n = int(self.venv.reply_len[0]) if "reply_len" in vinfo else 0
        if n:
            info.update(reply_tokens=n, reply=self.venv.history[0][-1])
        if terminated or truncated:
            v = self.venv
            info = {
                "prompt": v.samples[0]["prompt"],
                "completion": v.completions[0],
                "outcome_reward": float(v.outcome[0]),
                "reward_components": dict(v.reward_components[0]),
                "step_rewards": list(v.step_scores[0]),
                "episode_return": float(v.rewards[0].sum()),
            }
        if self.venv.masker is not None and not (terminated or truncated):
            info["action_mask"] = self.action_masks().astype(np.int8)
        return self._obs(obs), float(r[0]), terminated, truncated, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        v = self.venv
        text = v.tokenizer.batch_decode(v.generated_ids([0]), skip_special_tokens=True)[0]
        return v.prompts[0] + text

    def close(self) -> None:
        self.venv.close()

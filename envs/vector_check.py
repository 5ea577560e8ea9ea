"""``check_vector_env``: conformance checks for vector environments (Gymnasium only checks single envs).

These check the Gymnasium vector API of any vector env; the rules a task must keep on the token env (replies are
context, rewards on actions, ...) are checked by :func:`~tokengym.envs.task_check.check_task`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

__all__ = ["check_vector_env"]


def _np(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, dict):
        return {k: _np(v) for k, v in x.items()}
    return x


def _devices(x: Any) -> set[str]:
    if isinstance(x, torch.Tensor):
        return {str(x.device)}
    if isinstance(x, dict):
        return set().union(*(_devices(v) for v in x.values())) if x else set()
    return set()


def _equal(a: Any, b: Any) -> bool:
    a, b = _np(a), _np(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _check_step(env: VectorEnv, out: tuple, n: int) -> None:
    assert isinstance(out, tuple) and len(out) == 5, f"step() must return a 5-tuple, got {type(out).__name__}"
    obs, reward, term, trunc, info = out
    assert env.observation_space.contains(_np(obs)), "step() observation is not in observation_space"
    for name, x, kind in (("reward", reward, "f"), ("terminated", term, "b"), ("truncated", trunc, "b")):
        arr = _np(x)
        assert np.shape(arr) == (n,), f"{name} must have shape ({n},), got {np.shape(arr)}"
        assert np.asarray(arr).dtype.kind == kind, f"{name} has dtype {np.asarray(arr).dtype}, expected kind {kind!r}"
    assert np.isfinite(_np(reward)).all(), "reward contains NaN or inf"
    assert isinstance(info, dict), f"info must be a dict, got {type(info).__name__}"
    devs = _devices(obs) | _devices(reward) | _devices(term) | _devices(trunc)
    assert len(devs) <= 1, f"step() returned tensors on several devices: {sorted(devs)}"


def check_vector_env(env: VectorEnv, seed: int = 0, max_steps: int = 512) -> None:
    """Check that a vector env follows the Gymnasium vector API; raise ``AssertionError`` naming what fails.

    Checks: declared ``metadata["autoreset_mode"]``; batched spaces equal ``batch_space`` of the single
    spaces; ``reset``/``step`` return types, shapes, dtypes and a single device; observations inside the
    space; seeded determinism of ``reset`` and of ``step``; returned observations not mutated by later
    steps; in ``DISABLED`` mode every episode ends within ``max_steps`` and finished flags stay set; in
    ``NEXT_STEP`` mode a finished slot restarts on the next step with reward 0.

    Example:
        >>> from tokengym.envs import TokenVectorEnv
        >>> check_vector_env(TokenVectorEnv(4, "reverse", group_size=2))
    """
    mode = env.metadata.get("autoreset_mode")
    assert isinstance(mode, AutoresetMode), f"metadata['autoreset_mode'] must be an AutoresetMode, got {mode!r}"
    n = env.num_envs
    assert isinstance(n, int) and n >= 1, f"num_envs must be a positive int, got {n!r}"
    assert env.observation_space == batch_space(env.single_observation_space, n), "observation_space != batch_space(single_observation_space, num_envs)"
    assert env.action_space == batch_space(env.single_action_space, n), "action_space != batch_space(single_action_space, num_envs)"

    out = env.reset(seed=seed)
    assert isinstance(out, tuple) and len(out) == 2, "reset() must return (obs, info)"
    obs0, info0 = out
    assert isinstance(info0, dict), "reset() info must be a dict"
    assert env.observation_space.contains(_np(obs0)), "reset() observation is not in observation_space"
    obs0b, _ = env.reset(seed=seed)
    assert _equal(obs0, obs0b), "reset(seed=s) twice gave different observations"

    env.action_space.seed(seed)
    actions = [env.action_space.sample() for _ in range(max_steps)]
    like = obs0["tokens"] if isinstance(obs0, dict) else obs0
    to_act = (lambda a: torch.as_tensor(a, device=like.device)) if isinstance(like, torch.Tensor) else (lambda a: a)

    if getattr(env, "masker", None) is not None:  # an env that masks its actions is stepped inside its masks
        plain = to_act
        to_act = lambda a: plain(within_masks(env, torch.as_tensor(a)))  # noqa: E731

    def rollout(k: int) -> list[tuple]:
        env.reset(seed=seed)
        return [env.step(to_act(actions[i])) for i in range(k)]

    first = rollout(3)
    for o in first:
        _check_step(env, o, n)
    snapshot = _np(first[0][0])
    assert _equal(snapshot, first[0][0]), "observation changed after being returned"
    second = rollout(3)
    for a, b in zip(first, second):
        assert all(_equal(x, y) for x, y in zip(a[:4], b[:4])), "same seed and actions gave different steps"

    env.reset(seed=seed)
    prev_done = np.zeros(n, dtype=bool)
    for i in range(max_steps):
        o = env.step(to_act(actions[i]))
        _check_step(env, o, n)
        done = _np(o[2]) | _np(o[3])
        if mode is AutoresetMode.DISABLED:
            assert (done >= prev_done).all(), "DISABLED mode: a finished slot's flags were cleared before reset()"
            if done.all():
                break
        elif mode is AutoresetMode.NEXT_STEP:
            restarted = prev_done
            assert (_np(o[1])[restarted] == 0).all(), "NEXT_STEP mode: a restarting slot got a non-zero reward"
            assert not done[restarted].any(), "NEXT_STEP mode: a restarting slot was flagged done"
            if i > 4 and prev_done.any():
                break
        prev_done = done
    else:
        if mode is AutoresetMode.DISABLED:
            raise AssertionError(f"DISABLED mode: episodes did not all end within {max_steps} steps")


def within_masks(env: Any, actions: torch.Tensor) -> torch.Tensor:
    """``actions[N]`` moved inside ``env.action_masks()``: an allowed action stays, a forbidden one becomes the
    ``(a mod k)``-th of the row's ``k`` allowed tokens (deterministic, so a seeded check repeats)."""
    allowed = env.action_masks().cpu()
    a = actions.reshape(-1).cpu().long().clamp(0, allowed.shape[1] - 1)
    ok = allowed[torch.arange(len(a)), a]
    k = a % allowed.sum(1).clamp(min=1)
    pick = (allowed.long().cumsum(1) <= k[:, None]).sum(1).clamp(max=allowed.shape[1] - 1)  # the (k+1)-th allowed one
    return torch.where(ok, a, pick).to(actions.device).reshape(actions.shape)

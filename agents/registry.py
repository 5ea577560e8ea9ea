"""The algorithm registry: ``tokengym train <name>`` finds an algorithm, its config dataclass, its run
settings, its presets and its builder here, so ``train.py`` holds no per-algorithm branches.

An algorithm registers itself where it is defined (``register("rloo", RLOOConfig, agent=RLOOAgent, ...)``
at the end of ``agents/rloo.py``). On-policy agents need no builder of their own: the run's env, rewards
and checks are the same for every agent that follows :class:`~tokengym.agents.onpolicy.OnPolicyAgent`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Algorithm", "register", "algorithms", "ON_POLICY_RUN_FIELDS"]

ON_POLICY_RUN_FIELDS = frozenset({"prompts", "group_size", "temperature", "reward_model", "prm_model", "save_every",
                                  "keep_checkpoints"})
"""The :class:`~tokengym.agents.train.RunConfig` fields an on-policy algorithm takes beyond the common ones."""

BUILTIN_MODULES = ("grpo", "rloo", "reinforce_pp", "ppo", "offline_jobs")
"""Modules of ``tokengym.agents`` whose import registers the bundled algorithms (in ``tokengym train`` order)."""


@dataclass
class Algorithm:
    """One ``tokengym train`` algorithm."""

    name: str
    config_cls: type
    help: str
    agent: type | None = None
    """An on-policy agent class (built by the generic on-policy builder), or None with ``build`` set."""
    build: Callable[[Any, Any], Any] | None = None
    """``build(run, cfg) -> job``: loads and checks everything, writing nothing (offline algorithms)."""
    run_fields: frozenset[str] = ON_POLICY_RUN_FIELDS
    """RunConfig fields it takes beyond the common ones (env, model, name, eval_prompts, device, ...)."""
    rollout: tuple[int, int] = (8, 8)
    """Default ``(prompts, group_size)`` per step of an on-policy algorithm."""
    min_group: int = 1
    """The smallest ``group_size`` it can learn from."""
    default_model: str | None = None
    """The model when the run names none (None: the env's shipped warm start)."""
    resumable: bool = True
    data_parallel: bool = False
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``--preset NAME``: config values applied over the defaults (a config file and flags still win)."""


_REGISTRY: dict[str, Algorithm] = {}


def register(name: str, config_cls: type, help: str, **kwargs: Any) -> Algorithm:
    """Add (or replace) algorithm ``name``; returns its :class:`Algorithm`."""
    spec = Algorithm(name, config_cls, help, **kwargs)
    if (spec.agent is None) == (spec.build is None):
        raise ValueError(f"algorithm {name!r}: give exactly one of agent= (on-policy) and build=")
    for preset, values in spec.presets.items():
        config_cls(**values)  # a preset that does not make a valid config fails at import, not in a user's run
    _REGISTRY[name] = spec
    return spec


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm by name (importing the bundled ones first)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(f"tokengym.agents.{module}")
    return dict(_REGISTRY)

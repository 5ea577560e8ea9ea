"""The algorithm registry: ``tokengym train <name>`` finds an algorithm, its config dataclass, its run
settings and its presets here, so the ``tokengym train`` runner holds no per-algorithm branches.

An algorithm registers itself where it is defined (``register("rloo", RLOOConfig, agent=RLOOAgent, ...)``
at the end of ``agents/algorithms/rloo.py``). On-policy agents need no builder of their own: the run's env, rewards
and checks are the same for every agent that follows :class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`.
An offline algorithm registers with ``build=`` (its run builder), or, for the bundled ones, without: their
builders are the CLI's (:data:`tokengym.agents.cli.offline_jobs.BUILDERS`), which imports this layer, never the
other way round.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Algorithm", "register", "algorithms", "name_of", "ON_POLICY_RUN_FIELDS"]

ON_POLICY_RUN_FIELDS = frozenset({"prompts", "group_size", "temperature", "reward_model", "prm_model", "save_every",
                                  "keep_checkpoints", "sharding"})
"""The :class:`~tokengym.agents.cli.runner.RunConfig` fields an on-policy algorithm takes beyond the common ones."""

ORDER = ("grpo", "ppo", "reinforce-pp", "rloo", "distill", "dpo", "spin", "sft", "rm", "prm")
"""``tokengym train``'s order of the bundled algorithms (others follow in registration order)."""


@dataclass
class Algorithm:
    """One ``tokengym train`` algorithm."""

    name: str
    config_cls: type
    help: str
    agent: type | None = None
    """An on-policy agent class (built by the generic on-policy builder); None for an offline algorithm."""
    build: Callable[[Any, Any], Any] | None = None
    """``build(run, cfg) -> job`` of an offline algorithm: loads and checks everything, writing nothing (None for
    the bundled ones: the CLI has their builders)."""
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
    if spec.agent is not None and spec.build is not None:
        raise ValueError(f"algorithm {name!r}: give agent= (on-policy) or build= (offline), not both")
    for preset, values in spec.presets.items():
        config_cls(**values)  # a preset that does not make a valid config fails at import, not in a user's run
    _REGISTRY[name] = spec
    return spec


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm by name, after importing every module of :mod:`tokengym.agents.algorithms` (so a
    new algorithm is one file there, registering itself at its end)."""
    import pkgutil

    package = importlib.import_module("tokengym.agents.algorithms")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        importlib.import_module(f"{package.__name__}.{info.name}")
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(_REGISTRY.items(), key=lambda kv: rank.get(kv[0], len(ORDER))))


def name_of(cls: type) -> str:
    """The registered name of an agent or learner class (``GRPOAgent`` -> ``"grpo"``), for a run's ``config.json``."""
    for name, spec in algorithms().items():
        if spec.agent is cls:
            return name
    return cls.__name__

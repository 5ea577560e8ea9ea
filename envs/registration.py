"""Gymnasium registration: the id-keyed views of the task table (:mod:`~tokengym.envs.tasks.registry`).

Every task registers its id when it registers itself (:func:`~tokengym.envs.tasks.registry.register_task`), with a
single-env entry point (``TokenEnv``) and a vector one (``TokenVectorEnv``). :data:`ENV_IDS` and :data:`ENV_GUIDE`
are computed from the table on each access, so they list tasks registered later too.
"""

from __future__ import annotations

from tokengym.envs.tasks.registry import TASK_SPECS, TableView, register_envs

__all__ = ["ENV_IDS", "ENV_GUIDE", "register_envs"]

ENV_IDS = TableView(lambda: {s.env_id: (s.name, s.description) for s in TASK_SPECS.values()})
"""id -> (task name, one-line description). Each id works with gymnasium.make and gymnasium.make_vec."""

ENV_GUIDE = TableView(lambda: {s.env_id: (s.prompt_format, s.models) for s in TASK_SPECS.values()})
"""id -> (prompt and answer format, which models it fits); ``tokengym envs`` prints them."""

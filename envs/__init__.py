"""Token-level Gymnasium environments: one emitted token = one action.

Importing this package registers every ``tokengym/<Task>-v0`` id for ``gymnasium.make`` (a
:class:`TokenEnv`) and ``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")`` (a
:class:`TokenVectorEnv`); a task of your own joins them with :func:`register_task`. Multi-turn tasks answer
the agent mid-episode (:meth:`Task.respond`, :class:`Reply`; see :mod:`tokengym.envs.multiturn`).
"""

from tokengym.envs.task_check import check_task
from tokengym.envs.vector_check import check_vector_env
from tokengym.envs.grammar_check import check_grammar
from tokengym.envs.masks import TokenMasks, grammar_text
from tokengym.envs.multiturn import Reply
from tokengym.envs.registration import ENV_GUIDE, ENV_IDS, register_envs
from tokengym.envs.tasks.base import Task
from tokengym.envs.tasks.registry import import_modules, load_entry_points, register_task, resolve_env, unregister_task
from tokengym.envs.token_env import TokenEnv
from tokengym.envs.tokenizer import char_tokenizer, check_tokenizer, load_tokenizer
from tokengym.envs.vector_env import TokenVectorEnv, resolve_task

register_envs()

_LAZY = {"AgentTask": "tokengym.envs.adapters.agent", "agent_env": "tokengym.envs.adapters.agent"}
"""Names loaded on first use (an agent env needs the ``openai`` client: ``pip install 'tokengym[agents]'``)."""


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = [
    "AgentTask",
    "agent_env",
    "ENV_GUIDE",
    "ENV_IDS",
    "Reply",
    "Task",
    "TokenEnv",
    "TokenMasks",
    "TokenVectorEnv",
    "char_tokenizer",
    "check_grammar",
    "check_task",
    "check_tokenizer",
    "check_vector_env",
    "grammar_text",
    "load_tokenizer",
    "register_envs",
    "import_modules",
    "load_entry_points",
    "register_task",
    "resolve_env",
    "resolve_task",
    "unregister_task",
]

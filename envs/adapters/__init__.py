"""Adapters for the community's environment libraries, each an optional extra and a thin layer over its own API.

======================  ==========================  =====================================================
name                    extra (``pip install``)     what
======================  ==========================  =====================================================
:class:`AgentTask`      ``tokengym[agents]``        an agent written against the OpenAI client (its calls)
:class:`VerifiersTask`  ``tokengym[verifiers]``     a verifiers environment (parser, rubric, env_response)
:class:`OpenEnvTask`    ``tokengym[openenv]``       an OpenEnv environment, in-process or via its client
:class:`GEMTask`        ``tokengym[gem]``           a GEM env id (games, reasoning-gym, ...)
:class:`TextArenaTask`  ``tokengym[textarena]``     a single-player TextArena game
:class:`TRLEnvironment` (none)                      a tokengym task as TRL's ``environment_factory`` object
:func:`gem_env`         ``tokengym[gem]``           a tokengym task as a ``gem.Env``
======================  ==========================  =====================================================

Library envs act on whole turns; :class:`~tokengym.envs.adapters.episodes.EpisodeTask` runs them as tokengym
multi-turn tasks: their observations are replies (context, not actions) and their rewards are turn rewards on the
agent token that ended the turn; a rollout reports their sum, the library's return, as the episode's outcome.
Each name is imported on first use, so this package needs none of the libraries.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "EpisodeTask": "episodes", "Turn": "episodes",
    "AgentTask": "agent", "agent_env": "agent",
    "ChatFormat": "chat_format", "TemplateFormat": "chat_format", "PlainFormat": "chat_format", "TagTools": "chat_format",
    "VerifiersTask": "verifiers",
    "OpenEnvTask": "openenv",
    "GEMTask": "gem",
    "TextArenaTask": "textarena",
    "TaskEpisode": "export", "TRLEnvironment": "export", "trl_rows": "export", "gem_env": "export",
    "register_gem_env": "export",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)

"""RL agents for tokengym; the pure advantage/loss math lives in :mod:`tokengym.agents.functional`."""

from . import functional

__all__ = ["functional"]

"""The ``tokengym`` command: ``train`` (one runner for every registered algorithm), ``eval``, ``sample``, ``envs``,
``convert`` and ``plot``. The top layer: it imports everything below, nothing imports it."""

from tokengym.agents.cli.command import main

__all__ = ["main"]

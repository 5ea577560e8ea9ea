"""Rollout backends by name: what the ``sampler`` setting (``sampler=`` in the on-policy configs, ``--sampler``)
chooses. A new backend is one file that calls :func:`register_backend` (and its tests); the configs, the rollout
workers (local and remote) and the command line read this registry.

A backend's factory takes the policy and the room it needs and returns what the rollout loops drive: a token-level
``Sampler`` (the policy itself, for ``tokengym``) or a ``Generator`` (an inference engine, for ``vllm``). An
``engine`` backend holds its own copy of the weights: the agent keeps one per learner process, loads the trainer's
weights into it by name after each update (``load_weights(None, version)``, ``version``) and ``close()``-s it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tokengym.agents.engine.registry import Names, Registry

__all__ = ["Backend", "BACKENDS", "SAMPLERS", "backend", "check_one_process", "make_backend", "register_backend",
           "unregister_backend"]


@dataclass(frozen=True)
class Backend:
    """One rollout backend."""

    name: str
    factory: Callable[..., Any]
    """``factory(policy, *, rows, row_len, bf16, version)`` -> the backend for ``policy``, with KV cache room for
    ``rows`` rows of ``row_len`` tokens, holding the policy's current weights as ``version``."""
    engine: bool = True
    """It holds its own copy of the weights (see the module docstring); False: it is (or shares) the policy."""
    help: str = ""


BACKENDS: Registry[Backend] = Registry("rollout backend", "sampler")
"""Every registered backend by name."""

SAMPLERS = Names(BACKENDS)
"""The registered backends' names (a live view; once a tuple of the bundled two)."""


def register_backend(name: str, factory: Callable[..., Any] | None = None, *, engine: bool = True, help: str = ""):
    """Register ``factory`` as backend ``name``; without ``factory``, a decorator (of a factory function or class)."""
    if factory is None:
        def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
            register_backend(name, f, engine=engine, help=help)
            return f

        return decorate
    return BACKENDS.add(name, Backend(name, factory, engine, help))


def unregister_backend(name: str) -> Backend:
    """Remove backend ``name`` (what a test registered)."""
    return BACKENDS.remove(name)


def backend(name: str) -> Backend:
    """Backend ``name``; an unknown one is a one-line ``ValueError`` naming the registered ones."""
    return BACKENDS.get(name)


def check_one_process(name: str, data_parallel: bool) -> None:
    """One-line ``ValueError`` for an engine backend ``name`` in a data-parallel (torchrun) learner: its engine runs in
    one learner process, and the ranks would each start one and sample apart."""
    if data_parallel and backend(name).engine:
        raise ValueError(f"sampler={name!r} runs one engine in one learner process; data-parallel learners (torchrun) "
                         "sample with sampler='tokengym'")


def make_backend(name: str, policy: Any, *, rows: int = 64, row_len: int = 512, bf16: bool = False,
                 version: int | None = None) -> Any:
    """The rollout backend ``name`` for ``policy``: the policy itself, or a new engine holding its current weights
    as ``version``, with KV cache room for ``rows`` rows of ``row_len`` tokens."""
    return backend(name).factory(policy, rows=rows, row_len=row_len, bf16=bf16, version=version)


def _tokengym(policy: Any, **room: Any) -> Any:
    return policy


def _vllm(policy: Any, *, rows: int, row_len: int, bf16: bool, version: int | None) -> Any:
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    return VLLMGenerator(policy, bf16=bf16, max_rows=rows, row_len=row_len, version=version)


register_backend("tokengym", _tokengym, engine=False, help="the policy's own fast decoder, in process (token-level)")
register_backend("vllm", _vllm, help="an in-process vLLM engine (pip install 'tokengym[vllm]', or [vllm-cuda] on a GPU; generation-level)")

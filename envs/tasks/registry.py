"""The one table of tasks: each task registers once, by name, and gets its Gymnasium id from it.

A row (:class:`TaskSpec`) holds what the package needs to know about a task: its name (for
``resolve_task``), its class, its id ``tokengym/<Task>-v0`` (for ``gymnasium.make`` and ``make_vec``), the
id's default keyword arguments, and the guide lines ``tokengym envs`` prints. :data:`TASKS`,
``resolve_task``, ``ENV_IDS``, ``ENV_GUIDE`` and Gymnasium's registry are views of this table, so a new task is
its own file with a :func:`register_task` decorator (plus its import in ``tasks/__init__.py`` for a bundled one).

Example:
    >>> import gymnasium as gym
    >>> from tokengym.envs.tasks import Task, register_task, unregister_task
    >>> @register_task("echo", description="say 'hi'")
    ... class EchoTask(Task):
    ...     name = "echo"
    ...     def sample(self, rng):
    ...         return {"prompt": "say hi\\n", "answer": "hi"}
    ...     def reward(self):
    ...         return lambda prompts, completions, **_: [float(c == "hi") for c in completions]
    >>> TASK_SPECS["echo"].env_id
    'tokengym/Echo-v0'
    >>> env = gym.make("tokengym/Echo-v0")
    >>> type(env.unwrapped.venv.task).__name__
    'EchoTask'
    >>> unregister_task("echo")
    >>> "tokengym/Echo-v0" in gym.registry
    False
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gymnasium as gym

from .base import Task

__all__ = ["TaskSpec", "TASK_SPECS", "TASKS", "register_task", "unregister_task", "register_envs", "TableView"]

KINDS = ("procedural", "data", "toy")
"""``procedural``: prompts drawn from the seed alone, scored by the task's own verifier (the :data:`TASKS`);
``data``: prompts from data given at construction; ``toy``: smoke tests of agents."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One row of the task table."""

    name: str
    """The task's name for ``resolve_task`` and ``TokenVectorEnv(task=...)``."""
    cls: type[Task]
    """The class ``resolve_task(name, **task_kwargs)`` constructs."""
    env_id: str
    """The Gymnasium id; its single-env entry point is ``TokenEnv``, its vector one ``TokenVectorEnv``."""
    description: str
    """One line: what the task asks (``tokengym envs``)."""
    prompt_format: str = ""
    """The prompt and answer format and the reward (``tokengym envs``, ``format:``)."""
    models: str = ""
    """Which models fit the task (``tokengym envs``, ``models:``)."""
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Default keyword arguments of the id, as Gymnasium's own ``kwargs`` (``make`` arguments override them)."""
    kind: str = "procedural"
    """One of :data:`KINDS`."""


_SPECS: dict[str, TaskSpec] = {}
TASK_SPECS: Mapping[str, TaskSpec] = types.MappingProxyType(_SPECS)
"""name -> :class:`TaskSpec`, in registration order (read-only; :func:`register_task` writes it)."""


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _gym_register(spec: TaskSpec) -> None:
    gym.register(id=spec.env_id, entry_point="tokengym.envs.token_env:TokenEnv",
                 vector_entry_point="tokengym.envs.vector_env:TokenVectorEnv",
                 kwargs={"task": spec.name, **spec.kwargs})


def register_task(name: str, cls: type[Task] | None = None, *, description: str, env_id: str | None = None,
                  prompt_format: str = "", models: str = "", kwargs: Mapping[str, Any] | None = None,
                  kind: str = "procedural") -> Any:
    """Add a task to the table and its id to Gymnasium's registry; a class decorator when ``cls`` is left out.

    ``env_id`` defaults to ``tokengym/<Name>-v0`` (``guess_number`` -> ``GuessNumber``). Returns ``cls`` (or the
    decorator). A name or id that is already taken raises ``ValueError``; the table is unchanged then.
    """
    if cls is None:
        return lambda c: register_task(name, c, description=description, env_id=env_id, prompt_format=prompt_format,
                                       models=models, kwargs=kwargs, kind=kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a task name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"task {name!r}: {cls!r} is not a subclass of tokengym.envs.Task")
    if kind not in KINDS:
        raise ValueError(f"task {name!r}: kind must be one of {KINDS}, got {kind!r}")
    env_id = env_id if env_id is not None else f"tokengym/{_camel(name)}-v0"
    if name in _SPECS:
        raise ValueError(f"task name {name!r} is already registered (by {_SPECS[name].cls.__name__}); "
                         f"unregister_task({name!r}) first or pick another name")
    if env_id in gym.registry:
        raise ValueError(f"env id {env_id!r} is already registered with gymnasium; pass another env_id=")
    spec = TaskSpec(name, cls, env_id, description, prompt_format, models, dict(kwargs or {}), kind)
    _gym_register(spec)
    _SPECS[name] = spec
    return cls


def unregister_task(name: str) -> None:
    """Remove a task from the table and its id from Gymnasium's registry (e.g. at the end of a test)."""
    if name not in _SPECS:
        raise ValueError(f"no task named {name!r} is registered; registered: {sorted(_SPECS)}")
    gym.registry.pop(_SPECS.pop(name).env_id, None)


def register_envs() -> None:
    """Register every task's id with Gymnasium again where it is missing (idempotent)."""
    for spec in _SPECS.values():
        if spec.env_id not in gym.registry:
            _gym_register(spec)


class TableView(Mapping):
    """A read-only mapping computed from the task table on every access, so that it follows registrations."""

    def __init__(self, build: Callable[[], dict]):
        self._build = build

    def __getitem__(self, key: Any) -> Any:
        return self._build()[key]

    def __iter__(self) -> Iterator:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())


TASKS: Mapping[str, type[Task]] = TableView(lambda: {s.name: s.cls for s in _SPECS.values() if s.kind == "procedural"})
"""The procedural tasks by name (a view of :data:`TASK_SPECS`)."""

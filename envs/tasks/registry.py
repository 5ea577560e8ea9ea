"""The one table of tasks: each task registers once, by name, and gets its Gymnasium id from it.

A row (:class:`TaskSpec`) holds what the package needs to know about a task: its name (for
``resolve_task``), its class, its id ``tokengym/<Task>-v0`` (for ``gymnasium.make`` and ``make_vec``), the
id's default keyword arguments, and the guide lines ``tokengym envs`` prints. :data:`TASKS`,
``resolve_task``, ``ENV_IDS``, ``ENV_GUIDE`` and Gymnasium's registry are views of this table, so a new task is
its own file with a :func:`register_task` decorator (plus its import in ``tasks/__init__.py`` for a bundled one).

A task from elsewhere joins by name (:func:`resolve_env`, what ``tokengym --env`` takes): ``module:Class`` (a Task
class, registered on the fly as ``module/Class-v0``), ``module:EnvId-v0`` (an id the module registers when imported),
or an id registered by an installed package's ``tokengym.envs`` entry point (loaded once, when an id is not found).

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
import importlib
import os
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gymnasium as gym

from .base import Task

__all__ = ["TaskSpec", "TASK_SPECS", "TASKS", "register_task", "unregister_task", "register_envs", "TableView",
           "resolve_env", "import_modules", "env_imports", "env_source", "load_entry_points", "ENTRY_POINT_GROUP"]

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


def register_task(name: str | type[Task] | None = None, cls: type[Task] | None = None, *, description: str | None = None,
                  env_id: str | None = None, prompt_format: str = "", models: str = "",
                  kwargs: Mapping[str, Any] | None = None, kind: str = "procedural") -> Any:
    """Add a task to the table and its id to Gymnasium's registry; a class decorator when ``cls`` is left out.

    Used bare (``@register_task`` or ``@register_task()``), the name is the class's own ``name`` attribute, else its
    class name in snake case less a ``Task`` suffix (``SortLettersTask`` -> ``sort_letters``). ``description``
    defaults to the first line of the class's docstring. ``env_id`` defaults to ``tokengym/<Name>-v0``
    (``guess_number`` -> ``GuessNumber``). Returns ``cls`` (or the decorator). A name or id that is already taken
    raises ``ValueError``; the table is unchanged then.
    """
    if isinstance(name, type) and cls is None:  # @register_task on a class
        name, cls = None, name
    if cls is None:
        return lambda c: register_task(name, c, description=description, env_id=env_id, prompt_format=prompt_format,
                                       models=models, kwargs=kwargs, kind=kind)
    if name is None and isinstance(cls, type):
        name = _default_name(cls)
    if description is None and isinstance(cls, type):
        description = _describe_class(cls)
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


def _default_name(cls: type) -> str:
    """A bare registration's task name: the class's own ``name`` (not one inherited), else its snake-cased name."""
    own = cls.__dict__.get("name")
    if isinstance(own, str) and own and own != Task.name:
        return own
    base = cls.__name__[:-4] if cls.__name__.endswith("Task") and cls.__name__ != "Task" else cls.__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", base).lower()


def _describe_class(cls: type) -> str:
    """The first line of a class's own docstring, else ``Class from module`` (a task's default description)."""
    doc = (cls.__dict__.get("__doc__") or "").strip().splitlines()
    return doc[0].strip() if doc else f"{cls.__name__} from {cls.__module__}"


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


# ---------------------------------------------------------------------------------------------- envs from elsewhere
ENTRY_POINT_GROUP = "tokengym.envs"
"""The entry-point group of third-party tasks: each entry names a module (importing it registers its tasks), a
Task class (registered as ``module:Class`` is) or a function called with no arguments to register them."""

_entry_points_loaded = False


_ENV_IMPORTS: dict[str, list[str]] = {}  # env id -> the modules resolve_env imported for it (--import)


def import_modules(modules: Any) -> None:
    """Import each module (``--import``; the current folder first on ``sys.path``, as ``python -m`` has it); one that
    cannot be imported raises ``ValueError`` naming it."""
    for name in modules or ():
        _import(name, "--import")


def env_imports(env_id: str) -> list[str]:
    """The modules :func:`resolve_env` imported before it resolved ``env_id`` (``--import``): another process (a
    remote rollout worker) imports them too."""
    return list(_ENV_IMPORTS.get(env_id, ()))


def env_source(env_id: str) -> str:
    """What :func:`resolve_env` takes in another process to make ``env_id`` there (a remote rollout worker): the
    ``module:Class`` a task class was named by (its id, ``module/Class-v0``, exists only once that names it), else
    ``module:EnvId-v0`` for an id whose task or entry point lives outside tokengym (importing the module registers
    it), else the id itself (tokengym's own, or an installed package's entry point)."""
    spec = next((s for s in _SPECS.values() if s.env_id == env_id), None)
    if spec is not None and ":" in spec.name:
        return spec.name
    module = spec.cls.__module__ if spec is not None else None
    if spec is None and env_id in gym.registry:
        entry = gym.registry[env_id].vector_entry_point
        module = entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", None)
    if module and module != "__main__" and module.split(".")[0] != "tokengym":
        return f"{module}:{env_id}"
    return env_id


def _import(module: str, what: str) -> types.ModuleType:
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script's path lacks the folder it runs in
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module!r} ({e}); run from the folder holding it or install "
                         "its package") from None
    except Exception as e:  # the module's own code failed
        raise ValueError(f"{what}: importing module {module!r} failed: {type(e).__name__}: {e}") from None
    except SystemExit as e:  # sys.exit() at import: it would end the command without a word
        raise ValueError(f"{what}: importing module {module!r} called sys.exit({e.code!r}); a module of tasks must not "
                         "exit when imported (put script code under `if __name__ == \"__main__\":`)") from None


def _class_id(cls: type[Task]) -> str:
    """The Gymnasium id a Task class named as ``module:Class`` gets: ``module/Class-v0`` (apart from tokengym's own), a
    package's dots written as dashes (Gymnasium's namespaces take no dots): ``mypkg.tasks:Ok`` -> ``mypkg-tasks/Ok-v0``."""
    return f"{cls.__module__.replace('.', '-')}/{cls.__qualname__}-v0"


def _register_class(cls: Any, spec: str) -> str:
    """The id of Task class ``cls`` (named by ``spec``), registering it first if it is not in the table yet; an agent
    function (``agent(client, sample)``) registers as the agent env that runs it."""
    if callable(cls) and not isinstance(cls, type):
        from tokengym.envs.adapters.agent import agent_task_class

        known = next((s for s in _SPECS.values() if getattr(s.cls, "agent", None) is cls), None)
        if known is not None:
            return known.env_id
        task_cls = agent_task_class(cls, lambda name: _resolve_name(name))
        register_task(spec, task_cls, env_id=_class_id(task_cls), description=task_cls.__doc__.splitlines()[0])
        return _class_id(task_cls)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"{spec} is not a tokengym Task class (it is {type(cls).__name__} {cls!r:.60}); name a "
                         "subclass of tokengym.envs.Task, an agent function agent(client, sample), or an env id the "
                         "module registers")
    known = next((s for s in _SPECS.values() if s.cls is cls), None)
    if known is not None:
        return known.env_id
    register_task(f"{cls.__module__}:{cls.__qualname__}", cls, env_id=_class_id(cls), description=_describe_class(cls))
    return _class_id(cls)


def _resolve_name(name: str) -> Task:
    """A registered task by name (an agent env's ``data``), with its defaults."""
    if name not in _SPECS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(_SPECS)}, a JSONL file or a list of dicts")
    return _SPECS[name].cls()


def load_entry_points() -> None:
    """Load the ``tokengym.envs`` entry points of installed packages, once; a broken one is one warning naming it."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    from tokengym.rewards.common import TokengymWarning

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if isinstance(obj, type):
                _register_class(obj, f"{ep.value}")
            elif callable(obj):
                obj()
        except (Exception, SystemExit) as e:  # anything a third-party package raises (even sys.exit()) must not
            # break or silently end unrelated commands
            why = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {str(e).strip()[:160]}"
            warnings.warn(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r} failed to load and is "
                          f"skipped: {why}", TokengymWarning, stacklevel=2)


def resolve_env(env: str, imports: Any = ()) -> str:
    """The Gymnasium id (with a tokengym vector entry point) that ``env`` names, after importing ``imports``.

    ``env`` is a registered id (``tokengym/Arithmetic-v0``, or one from ``imports`` or an entry point), ``module:Class``
    (a Task class, registered on the fly) or ``module:EnvId-v0`` (the module registers the id when imported). Raises
    ``ValueError``, one line naming the problem: a module that does not import, a missing attribute, a class that is
    not a Task, an id nobody registered.
    """
    import gymnasium as gym

    if not isinstance(env, str) or not env.strip():
        raise ValueError(f"env must be an env id or module:Class, got {env!r}")
    import_modules(imports)
    if ":" in env:
        module, _, attr = env.partition(":")
        if not module or not attr:
            raise ValueError(f"env {env!r}: write module:Class or module:EnvId-v0")
        mod = _import(module, f"env {env!r}")
        obj = getattr(mod, attr, None)
        if obj is not None and not isinstance(obj, str):
            env_id = _register_class(obj, env)
        elif attr in gym.registry:
            env_id = attr
        else:
            raise ValueError(f"env {env!r}: module {module!r} has no Task class {attr!r} and registers no env id {attr!r}")
    else:
        env_id = env
        if env_id not in gym.registry:
            load_entry_points()
        if env_id not in gym.registry:
            ids = ", ".join(s.env_id for s in _SPECS.values())
            raise ValueError(f"unknown env id {env!r}; registered: {ids} (or name your own: module:Class, "
                             "module:EnvId-v0, --import MODULE)")
    if gym.registry[env_id].vector_entry_point is None:
        raise ValueError(f"env {env!r}: {env_id} has no vector entry point; register it with register_task (a Task "
                         "class) or give gymnasium.register a vector_entry_point such as TokenVectorEnv")
    if imports:
        _ENV_IMPORTS[env_id] = list(dict.fromkeys(imports))
    return env_id

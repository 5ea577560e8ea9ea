"""One check for every agent config (types, bounds and choices, each failure naming the field), the arguments every
learner takes (a policy, a config of its own class), and which settings a resumed run may change.

``check_config`` lives in :mod:`tokengym.rewards.common` (the lowest package, whose configs use it too).
"""

import dataclasses
from typing import Any

from tokengym.rewards.common import check_config

__all__ = ["check_config", "check_learner_args", "resumable", "resumable_fields"]


def resumable(default: Any) -> Any:
    """A dataclass field (``name: type = resumable(default)``) that a resumed run may change: ``--resume`` and
    ``learn/fit(..., resume=True)`` take another value of it (where to run, how often to save, how long to wait),
    while any other setting must match the saved ``config.json``. A subclass that redeclares the field must
    declare it with ``resumable`` again."""
    return dataclasses.field(default=default, metadata={"resumable": True})


def resumable_fields(*classes: type) -> set[str]:
    """Names of the fields declared :func:`resumable` in the dataclasses ``classes`` (their bases' included)."""
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.metadata.get("resumable")}


def check_learner_args(owner: str, policy: Any, config: Any, config_cls: type) -> None:
    """TypeError in one line when a learner gets a policy that is not one (a model name) or a config of the wrong
    type (a dict of settings), naming what to pass instead."""
    if not (hasattr(policy, "model") and hasattr(policy, "tokenizer") and hasattr(policy, "parameters")):
        hint = f": load it with Policy.from_pretrained({policy!r})" if isinstance(policy, str) else ""
        raise TypeError(f"{owner}(policy=...) takes a tokengym Policy, got {type(policy).__name__}{hint}")
    if config is not None and not isinstance(config, config_cls):
        hint = f": pass {config_cls.__name__}(**settings)" if isinstance(config, dict) else ""
        raise TypeError(f"{owner}(config=...) takes a {config_cls.__name__}, got {type(config).__name__}{hint}")

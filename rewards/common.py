"""What every tokengym package uses: config checks and the warning category (the lowest package, so
``envs`` and ``agents`` may import it too)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from typing import Any, Iterable, Iterator, Mapping

__all__ = ["TokengymWarning", "check_config", "check_field_types", "quiet_transformers"]


class TokengymWarning(UserWarning):
    """A warning about a run or its data (the ``tokengym`` command prints it as ``tokengym: warning: ...``)."""


def check_config(cfg: Any, checks: Mapping[str, bool] = {}, choices: Mapping[str, Iterable[str]] = {}) -> None:
    """Raise ``ValueError("<Config>.<field> ...")`` for the first wrong type, failed bound or unknown choice.

    Types come from the dataclass annotations (:func:`check_field_types`), so bounds can assume them.
    ``choices`` maps a field to its valid values; pass the registries of the math (e.g. ``F.AGGREGATIONS``)
    so a config accepts exactly what is implemented.
    """
    check_field_types(cfg)
    name = type(cfg).__name__
    for field, ok in checks.items():
        if not ok:
            raise ValueError(f"{name}.{field} has an invalid value: {getattr(cfg, field)!r}")
    for field, valid in choices.items():
        valid = sorted(valid)
        if getattr(cfg, field) not in valid:
            raise ValueError(f"{name}.{field}={getattr(cfg, field)!r}; choose one of {valid}")


def _type_ok(tp: Any, v: Any) -> tuple[bool, str]:
    """``(ok, what was expected)`` for a value against an annotation (containers and Any are not checked)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        results = [_type_ok(a, v) for a in typing.get_args(tp)]
        return any(ok for ok, _ in results), " or ".join(w for _, w in results)
    if tp is type(None):
        return v is None, "None"
    if tp is bool:
        return isinstance(v, bool), "true or false"
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), "an int"
    if tp is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok, "a finite number"
    if tp is str:
        return isinstance(v, str), "a string"
    return True, ""


def check_field_types(cfg: Any) -> None:
    """Every field of dataclass ``cfg`` holds a value of its annotated type (``float`` fields: finite numbers)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        ok, expected = _type_ok(hints[f.name], v)
        if not ok:
            raise ValueError(f"{type(cfg).__name__}.{f.name} must be {expected}, got {v!r}")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """``transformers`` without its "Loading weights" / "Writing model shards" progress bars (restored afterwards):
    reading or writing a local model is not a download, and a run's own progress bar is the one that matters."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()

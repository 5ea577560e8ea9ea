"""One check for every agent config: bounds and choices, each failure naming the field."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

__all__ = ["check_config"]


def check_config(cfg: Any, checks: Mapping[str, bool], choices: Mapping[str, Iterable[str]] = {}) -> None:
    """Raise ``ValueError("<Config>.<field> ...")`` for the first failed bound or unknown choice.

    ``choices`` maps a field to its valid values; pass the registries of :mod:`functional`
    (e.g. ``F.AGGREGATIONS``) so a config accepts exactly what the math implements.
    """
    name = type(cfg).__name__
    for field, ok in checks.items():
        if not ok:
            raise ValueError(f"{name}.{field} has an invalid value: {getattr(cfg, field)!r}")
    for field, valid in choices.items():
        valid = sorted(valid)
        if getattr(cfg, field) not in valid:
            raise ValueError(f"{name}.{field}={getattr(cfg, field)!r}; choose one of {valid}")

"""What every tokengym package uses: config checks, renamed config fields and the warning categories (the lowest
package, so ``envs`` and ``agents`` may import it too)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
import warnings
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, NamedTuple, Sequence

__all__ = ["PACKING", "F32_MAX", "TokengymWarning", "finite32", "TokengymDeprecationWarning", "check_config", "check_field_types", "quiet_transformers",
           "FieldChecks", "Rename", "Renamed", "renamed_keys", "max_positions", "check_rows_fit", "read_secret_file"]

PACKING = ("off", "bins", "auto")
"""The values of every trainer's ``packing`` setting (``tokengym.rewards.packing``): padded forwards, forwards
over the real tokens packed into bins, or bins where they save enough tokens."""


F32_MAX = 3.4028234663852886e38
"""The largest float32: a Python float above it is finite, and inf in the float32 buffers rewards are kept in."""


def finite32(x: float) -> bool:
    """Whether ``x`` stays a finite number in float32 (``1e308`` is a finite float and inf in float32)."""
    return math.isfinite(x) and abs(x) <= F32_MAX


class TokengymWarning(UserWarning):
    """A warning about a run or its data (the ``tokengym`` command prints it as ``tokengym: warning: ...``)."""


class TokengymDeprecationWarning(TokengymWarning, DeprecationWarning):
    """An old name that still works for one release (a ``DeprecationWarning``; the command prints it on one line)."""


# ---------------------------------------------------------------------------------------------- renamed fields
class Rename(NamedTuple):
    """Where an old config field went: its ``new`` name and, when the old value meant something else, ``convert``."""

    new: str
    convert: Callable[[Any], Any] | None = None


def renamed_keys(cls: type, values: Mapping[str, Any], where: str, name: Callable[[str], str] = repr,
                 stacklevel: int = 2) -> dict[str, Any]:
    """``values`` with the old field names of ``cls`` (a :class:`Renamed` config) replaced by the new ones.

    Each old name warns once (:class:`TokengymDeprecationWarning`, ``"<where>: 'old' is renamed 'new' ..."``;
    ``name`` formats a key, e.g. as a flag). Any other class, or values without old names, come back unchanged.

    Raises:
        ValueError: an old name and its new one are both given (the message names both).
    """
    renames: Mapping[str, Rename] = getattr(cls, "renames", {})
    if not any(k in renames for k in values):
        return dict(values)
    values = cls.legacy_values(dict(values))
    out: dict[str, Any] = {}
    for key, value in values.items():
        rename = renames.get(key)
        if rename is None:
            out[key] = value
            continue
        if rename.new in values:
            raise ValueError(f"{where}: {name(key)} and {name(rename.new)} are the same setting ({name(key)} is its "
                             f"old name); give only {name(rename.new)}")
        _warn_renamed(where, name(key), name(rename.new), stacklevel)
        out[rename.new] = rename.convert(value) if rename.convert is not None else value
    return out


class _RenamedMeta(type):
    """Renames a call's old keywords before ``__init__``: a dataclass subclass gets a fresh ``__init__`` that knows
    nothing of them, and the metaclass is inherited where a decorator would not be."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **renamed_keys(cls, kwargs, cls.__name__, stacklevel=3))


class Renamed(metaclass=_RenamedMeta):
    """Base of a config dataclass whose fields were renamed: ``class C(Renamed, renames={"old": "new"})``.

    For one release an old name works as a keyword (``C(old=1)``) and as an attribute (``c.old``, ``c.old = 1``),
    each time with a :class:`TokengymDeprecationWarning` naming the new one; reading it gives the new field's value.
    ``renames`` (values: a new name or a :class:`Rename`) add up along subclasses.
    """

    renames: ClassVar[Mapping[str, Rename]] = {}

    def __init_subclass__(cls, renames: Mapping[str, str | Rename] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {old: Rename(r) if isinstance(r, str) else r for old, r in (renames or {}).items()}
        cls.renames = {**cls.renames, **own}

    @classmethod
    def legacy_values(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Old settings whose meaning a rename alone does not carry, translated (a subclass's hook; default: as is)."""
        return values

    def __getattr__(self, name: str) -> Any:  # only reached when the normal lookup failed
        rename = type(self).renames.get(name)
        if rename is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        _warn_renamed(type(self).__name__, repr(name), repr(rename.new), 2)
        return getattr(self, rename.new)

    def __setattr__(self, name: str, value: Any) -> None:
        rename = type(self).renames.get(name)
        if rename is not None:
            _warn_renamed(type(self).__name__, repr(name), repr(rename.new), 2)
            name, value = rename.new, rename.convert(value) if rename.convert is not None else value
        object.__setattr__(self, name, value)


def _warn_renamed(where: str, old: str, new: str, stacklevel: int) -> None:
    """The deprecation warning of an old name, attributed ``stacklevel`` frames up (1: the caller)."""
    warnings.warn(f"{where}: {old} is renamed {new} (the old name goes in the next release)", TokengymDeprecationWarning,
                  stacklevel=stacklevel + 1)


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


class FieldChecks:
    """Base of a config dataclass whose field checks add up along its bases: each class's :meth:`checks` and
    :meth:`choices` name the bounds and valid values of the fields it declares, and :meth:`check_fields` runs those
    of every class of the config (bases first), so a shared base (the optimiser's settings, the engine's) checks its
    fields once for every config that extends it. (A class's methods may also merge ``super()``'s: same result.)"""

    def checks(self) -> dict[str, bool]:
        """``{field: valid}`` bounds of the fields this class declares."""
        return {}

    def choices(self) -> dict[str, Iterable[Any]]:
        """``{field: valid values}`` of the choice-valued fields this class declares."""
        return {}

    def check_fields(self) -> None:
        """Raise ``ValueError("<Config>.<field> ...")`` for the first wrong type, then failed bound or unknown choice."""
        check_field_types(self)  # types first: the bounds compare values
        checks: dict[str, bool] = {}
        choices: dict[str, Iterable[Any]] = {}
        for klass in reversed(type(self).__mro__):
            if "checks" in vars(klass):
                checks.update(klass.checks(self))
            if "choices" in vars(klass):
                choices.update(klass.choices(self))
        check_config(self, checks, choices)


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


def plain_scalars(cfg: Any) -> None:
    """Turn NumPy scalars in the fields of dataclass ``cfg`` (``np.float32(1e-4)``, ``np.int64(8)``, ``np.bool_``, as
    sweeps and grids hand them over) into the Python numbers they hold, so they check and save as those."""
    import numpy as np

    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, np.generic):
            object.__setattr__(cfg, f.name, v.item())


def check_field_types(cfg: Any) -> None:
    """Every field of dataclass ``cfg`` holds a value of its annotated type (``float`` fields: finite numbers; NumPy
    scalars are taken as the Python numbers they hold)."""
    plain_scalars(cfg)
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


def max_positions(model: Any) -> int | None:
    """The model's position limit (``config.max_position_embeddings``, GPT-2's ``n_positions`` too), or None."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_rows_fit(model: Any, lengths: Sequence[int], name: Callable[[int], str], fix: str) -> None:
    """``ValueError`` (one line) when the longest row (``lengths``: token counts) is over the model's positions:
    past them a model with learned positions raises an IndexError, one with rotary ones trains on garbage, silently.
    The line names the row (``name(i)``), its tokens, the limit and ``fix`` (what to do)."""
    limit = max_positions(model)
    if limit is None or not lengths:
        return
    i = max(range(len(lengths)), key=lambda k: lengths[k])
    if lengths[i] > limit:
        raise ValueError(f"{name(i)} is {lengths[i]} tokens long, over the model's {limit} positions "
                         f"(max_position_embeddings): {fix}")


def read_secret_file(path: str, what: str) -> str:
    """The first line of the secret file ``path``, stripped. ``ValueError`` in one line naming ``what`` (the setting)
    when the file cannot be read, is empty, or may be read by every user: refused as ssh refuses such a private key.
    The one reader of the worker's, the server's and the judge's secrets."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
        if mode & stat.S_IROTH:
            raise ValueError(f"{what} {path!r} is readable by every user (mode {stat.S_IMODE(mode):o}); chmod 600 it")
        with open(path, encoding="utf-8") as f:
            secret = f.readline().strip()
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if not secret:
        raise ValueError(f"{what} {path!r} is empty")
    return secret

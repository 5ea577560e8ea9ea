"""Config text: dataclass field docstrings (for ``--help``), command-line and TOML/JSON values turned into a field's
type with errors that name the field, and config files. Bad input is a :class:`UsageError`: one line, exit 2."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import textwrap
import types
import typing
from typing import Any

from tokengym.rewards.common import renamed_keys

__all__ = ["UsageError", "field_docs", "field_types", "parse_value", "apply_overrides", "renamed_settings",
           "read_config_file", "first_line", "short_error"]


class UsageError(Exception):
    """Bad input from the command line or a config file: the CLI prints it on one line and exits with 2."""


# ---------------------------------------------------------------------------------------------- configs
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields are followed by a string literal."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_value(name: str, tp: Any, value: Any) -> Any:
    """``value`` (text from a flag, or a TOML/JSON value) converted to the annotated type ``tp``.

    Raises:
        UsageError: naming the field, the expected type and the value.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(name, arg, value)
            except UsageError as e:
                errors.append(str(e))
        raise UsageError(errors[-1] if errors else f"{name}: cannot parse {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise UsageError(f"{name} expects true or false, got {value!r}")
    if tp in (int, float, str):
        if isinstance(value, str) and tp is not str:
            try:
                return tp(float(value)) if tp is int and float(value).is_integer() and "." not in value else tp(value)
            except ValueError:
                raise UsageError(f"{name} expects {tp.__name__}, got {value!r}") from None
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, tp) and not isinstance(value, bool):
            return value
        raise UsageError(f"{name} expects {tp.__name__}, got {value!r}")
    if origin in (tuple, list):
        if isinstance(value, str):
            value = json.loads(value) if value.strip().startswith("[") else [v for v in value.replace(",", " ").split()]
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{name} expects a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise UsageError(f"{name} expects {len(args)} values, got {value!r}")
            return tuple(parse_value(name, a, v) for a, v in zip(args, value))
        inner = args[0] if args else str
        return origin(parse_value(name, inner, v) for v in value)
    if origin is dict or tp is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise UsageError(f"{name} expects a JSON object, e.g. '{{\"digits\": 2}}', got {value!r}") from None
        if not isinstance(value, dict):
            raise UsageError(f"{name} expects a table / JSON object, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    raise UsageError(f"{name}: unsupported config type {tp!r}")


def renamed_settings(cls: type, values: dict[str, Any], source: str, flags: bool = False) -> dict[str, Any]:
    """``values`` with the old field names of config class ``cls`` replaced by the new ones, each with one
    deprecation warning naming both (as ``--flags`` with ``flags``); keys may be spelt with ``-`` or ``_``.

    Raises:
        UsageError: an old name and its new one both given.
    """
    raw = {k.replace("-", "_"): k for k in values}
    name = (lambda k: "--" + k.replace("_", "-")) if flags else (lambda k: repr(raw.get(k, k)))
    if not set(raw) & set(getattr(cls, "renames", {})):
        return values
    try:
        new = renamed_keys(cls, {k.replace("-", "_"): v for k, v in values.items()}, source, name, stacklevel=3)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return {raw.get(k, k): v for k, v in new.items()}


def apply_overrides(configs: dict[str, Any], values: dict[str, Any], source: str) -> None:
    """Set ``values`` (``{field: value}``) on the dataclass instances of ``configs`` that have each field (an old,
    renamed field's name too, with a warning: :func:`renamed_settings`).

    Raises:
        UsageError: an unknown key (with the closest valid one), or a value of the wrong type.
    """
    owners: dict[str, list[Any]] = {}
    for cfg in configs.values():
        for f in dataclasses.fields(cfg):
            owners.setdefault(f.name, []).append(cfg)
        values = renamed_settings(type(cfg), values, source)
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key not in owners:
            close = difflib.get_close_matches(key, list(owners), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "; see --help for the list"
            raise UsageError(f"unknown config key {raw_key!r} in {source}{hint}")
        for cfg in owners[key]:  # a field both configs have (e.g. eval_prompts) is set on both
            setattr(cfg, key, parse_value(key, field_types(type(cfg))[key], value))


def read_config_file(path: str) -> dict[str, Any]:
    """Flat ``{key: value}`` from a TOML or JSON file (TOML tables are flattened one level)."""
    if os.path.isdir(path):
        raise UsageError(f"config file {path!r} is a folder; pass a .toml or .json file")
    if not os.path.isfile(path):
        raise UsageError(f"config file {path!r} does not exist")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise UsageError(f"reading {path!r} needs Python 3.11's tomllib; pass the settings as a .json file") from None
            with open(path, "rb") as f:
                data = tomllib.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot parse config file {path!r}: {short_error(e)}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path!r} holds a {type(data).__name__}; it must be a table / JSON object of settings")
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and k not in ("env_kwargs", "judge"):
            flat.update(v)
        else:
            flat[k] = v
    return flat


def short_error(e: BaseException) -> str:
    """An exception as one short line (library errors are often several lines long)."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return line if len(line) <= 120 else line[:117] + "..."


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

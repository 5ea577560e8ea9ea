"""Run folders: resolved configs, atomic checkpoints, exact resume.

A run lives in ``runs/<name>/``::

    config.json            the resolved configuration (algorithm, run settings, agent config)
    metrics.jsonl          one JSON record per logged step (also TensorBoard event files)
    checkpoints/latest     the name of the newest complete checkpoint, e.g. ``step-00000040``
    checkpoints/step-N/    <module>.safetensors (policy, critic, ref, ...) + trainer_state.pt
    model/                 the final policy, ``save_pretrained`` format (loadable with ``--model``)

Writes are atomic: a checkpoint is written into a temporary folder that is renamed into place, and
``latest`` (like ``config.json``) is replaced with ``os.replace``; a crash at any point leaves the
previous checkpoint as the latest. Loading uses only safetensors and ``torch.load(weights_only=True)``.

Configs are dataclasses; :func:`field_docs` reads each field's docstring (for ``--help``) and
:func:`parse_value` turns command-line text into the field's type, with errors that name the field.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import random
import shutil
import textwrap
import types
import typing
from typing import Any

import numpy as np
import torch

__all__ = ["UsageError", "field_docs", "parse_value", "apply_overrides", "read_config_file", "is_run_dir",
           "field_types", "write_json_atomic", "save_checkpoint", "latest_checkpoint", "load_checkpoint", "truncate_metrics",
           "read_metrics", "rng_state", "set_rng_state"]

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"


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


def apply_overrides(configs: dict[str, Any], values: dict[str, Any], source: str) -> None:
    """Set ``values`` (``{field: value}``) on the dataclass instances of ``configs`` that have each field.

    Raises:
        UsageError: an unknown key (with the closest valid one), or a value of the wrong type.
    """
    owners: dict[str, list[Any]] = {}
    for cfg in configs.values():
        for f in dataclasses.fields(cfg):
            owners.setdefault(f.name, []).append(cfg)
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
    if not os.path.isfile(path):
        raise UsageError(f"config file {path!r} does not exist")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
        else:
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
    except (ValueError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot parse config file {path!r}: {e}") from None
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and k not in ("env_kwargs",):
            flat.update(v)
        else:
            flat[k] = v
    return flat


# ---------------------------------------------------------------------------------------------- files
def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file and ``os.replace`` (never a half-written file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch global RNG states (plain values and tensors)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": json.dumps(random.getstate()), "torch": torch.get_rng_state(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}}


def set_rng_state(state: dict[str, Any]) -> None:
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: str, step: int, modules: dict[str, torch.nn.Module], state: dict[str, Any],
                    keep: int = 2) -> str:
    """Write ``checkpoints/step-<step>/`` atomically, point ``latest`` at it, keep the newest ``keep``."""
    from safetensors.torch import save_model

    root = os.path.join(run_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    name = f"step-{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for key, module in modules.items():
        save_model(module, os.path.join(tmp, f"{key}.safetensors"))
    torch.save({"step": step, "modules": sorted(modules), "rng": rng_state(), **state}, os.path.join(tmp, STATE_FILE))
    if os.path.exists(final):  # a checkpoint of this step from a run that was killed after writing it
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = os.path.join(root, "latest")
    with open(pointer + ".tmp", "w") as f:
        f.write(name + "\n")
    os.replace(pointer + ".tmp", pointer)
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str) -> str | None:
    """The folder named by ``checkpoints/latest``, or None when the run has no checkpoint yet."""
    pointer = os.path.join(run_dir, CHECKPOINTS, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(run_dir, CHECKPOINTS, f.read().strip())
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise UsageError(f"checkpoint {path!r} named by {pointer!r} is missing or incomplete")
    return path


def load_checkpoint(path: str, modules: dict[str, torch.nn.Module]) -> dict[str, Any]:
    """Load module weights (strict) and return the trainer state (RNG states restored)."""
    from safetensors.torch import load_model

    state = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
    if sorted(modules) != state["modules"]:
        raise UsageError(f"checkpoint {path!r} holds modules {state['modules']}, this run needs {sorted(modules)}: "
                         "was it written with a different config?")
    for key, module in modules.items():
        load_model(module, os.path.join(path, f"{key}.safetensors"), strict=True)
    set_rng_state(state["rng"])
    return state


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a crash
                    break
    return out


def truncate_metrics(run_dir: str, step: int) -> list[dict[str, Any]]:
    """Drop records logged after ``step`` (work lost with a crash, about to be redone); return those kept."""
    kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= step]
    path = os.path.join(run_dir, "metrics.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return kept

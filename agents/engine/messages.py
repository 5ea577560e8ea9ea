"""Typed messages between a learner and its rollout workers: tensors as safetensors, everything else as JSON.

Nothing pickled crosses (a pickle runs code when read). A message is ``[8-byte little-endian header length][JSON
header][safetensors body]``. A rollout message carries one :class:`~tokengym.agents.engine.rollout.Rollout` and the
worker's stream position after it; a weight manifest names every tensor a sync sends (name, shape, dtype, in order),
so a worker checks what it receives against its own model before it loads anything.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import torch

from tokengym.envs.masks import TokenMasks

__all__ = ["MessageError", "encode", "decode", "encode_rollout", "decode_rollout", "manifest", "check_manifest",
           "check_weights"]

_HEAD = struct.Struct("<Q")
MAX_HEADER = 64 << 20


class MessageError(ValueError):
    """A message that is malformed or does not match what its reader expects; the text says what."""


def encode(header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """``header`` (JSON) and ``tensors`` (safetensors, CPU copies) as one message."""
    from safetensors.torch import save

    meta = json.dumps(header).encode()
    body = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}) if tensors else b""
    return _HEAD.pack(len(meta)) + meta + body


def decode(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(header, tensors)`` of an :func:`encode`d message; :class:`MessageError` for anything else."""
    from safetensors.torch import load

    if len(data) < _HEAD.size:
        raise MessageError(f"a message of {len(data)} bytes is shorter than its header length")
    (n,) = _HEAD.unpack_from(data)
    if n > min(MAX_HEADER, len(data) - _HEAD.size):
        raise MessageError(f"a message's header claims {n} bytes and the message has {len(data) - _HEAD.size}")
    try:
        header = json.loads(data[_HEAD.size:_HEAD.size + n])
        body = data[_HEAD.size + n:]
        tensors = load(bytes(body)) if body else {}
    except Exception as e:
        raise MessageError(f"a malformed message ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    if not isinstance(header, dict):
        raise MessageError("a message's header is not a JSON object")
    return header, tensors


# ---------------------------------------------------------------------------------------------- rollouts
def encode_rollout(ro: Any, meta: dict[str, Any], stream: dict[str, Any]) -> bytes:
    """A rollout, its ``meta`` (index, version, worker, seconds) and the worker's ``stream`` (``env``: the env's
    JSON state; ``rng``: the sampler's generator state) as one message."""
    fields: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {"stream/rng": stream["rng"]}
    for f in dataclasses.fields(ro):
        v = getattr(ro, f.name)
        if isinstance(v, torch.Tensor):
            tensors[f.name] = v
            fields[f.name] = "tensor"
        elif isinstance(v, TokenMasks):
            tensors[f"{f.name}/index"], tensors[f"{f.name}/table"] = v.index, v.table
            fields[f.name] = {"masks": v.vocab_size}
        elif isinstance(v, dict):
            tensors.update({f"{f.name}/{k}": t for k, t in v.items()})
            fields[f.name] = {"dict": list(v)}
        else:  # None, ints, lists of text and numbers; a task's samples as JSON (any other value by its repr)
            fields[f.name] = {"value": v}
    header = {"kind": "rollout", **meta, "fields": fields, "env": stream["env"]}
    return encode(json.loads(json.dumps(header, default=repr)), tensors)


def decode_rollout(data: bytes, device: torch.device | str = "cpu") -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``(rollout, header, stream)`` of an :func:`encode_rollout` message, its tensors on ``device``."""
    from tokengym.agents.engine.rollout_data import Rollout

    header, tensors = decode(data)
    if header.get("kind") != "rollout" or not isinstance(header.get("fields"), dict):
        raise MessageError(f"expected a rollout message, got kind {header.get('kind')!r}")
    names = {f.name for f in dataclasses.fields(Rollout)}
    if set(header["fields"]) != names:
        raise MessageError(f"a rollout message's fields differ from this tokengym's Rollout: "
                           f"{sorted(set(header['fields']) ^ names)}")
    try:
        kw: dict[str, Any] = {}
        for name, how in header["fields"].items():
            if how == "tensor":
                kw[name] = tensors[name].to(device)
            elif "masks" in how:
                kw[name] = TokenMasks(tensors[f"{name}/index"].to(device), tensors[f"{name}/table"].to(device),
                                      int(how["masks"]))
            elif "dict" in how:
                kw[name] = {k: tensors[f"{name}/{k}"].to(device) for k in how["dict"]}
            else:
                kw[name] = how["value"]
        stream = {"env": header["env"], "rng": tensors["stream/rng"]}
    except (KeyError, TypeError) as e:
        raise MessageError(f"a rollout message lacks {e}") from None
    return Rollout(**kw), header, stream


def check_rollout(ro: Any, rows: int, width: int, versions: range) -> None:
    """:class:`MessageError` unless ``ro`` has ``rows`` episodes of ``width`` tokens, per-row tensors of ``rows``,
    integer tokens, and a policy version in ``versions``."""
    if tuple(ro.tokens.shape) != (rows, width) or ro.tokens.dtype.is_floating_point:
        raise MessageError(f"a rollout of tokens {tuple(ro.tokens.shape)} {ro.tokens.dtype}, and this learner's env "
                           f"makes ({rows}, {width}) integer tokens: is the worker running the same env?")
    for f in dataclasses.fields(ro):
        v = getattr(ro, f.name)
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] != rows:
            raise MessageError(f"a rollout's {f.name} has {v.shape[0]} rows, not {rows}")
    if ro.policy_version not in versions:
        raise MessageError(f"a rollout sampled by policy version {ro.policy_version}, outside {versions.start}.."
                           f"{versions.stop - 1}")


# ---------------------------------------------------------------------------------------------- weights
def manifest(named: list[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``[[name, shape, dtype], ...]`` of named tensors, in order (what a sync sends, and how)."""
    return [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in named]


def check_manifest(theirs: list, mine: list) -> None:
    """:class:`MessageError` (one line, the first difference) unless the learner's manifest is this model's."""
    if not isinstance(theirs, list) or not all(isinstance(e, list) and len(e) == 3 for e in theirs):
        raise MessageError("a weight manifest must be a list of [name, shape, dtype]")
    have = {e[0]: e for e in mine}
    for name, shape, dtype in theirs:
        if name not in have:
            raise MessageError(f"weights name {name!r}, which this worker's model does not have")
        if [name, shape, dtype] != have[name]:
            raise MessageError(f"weights {name!r} are {shape} {dtype}, and this worker's model has "
                               f"{have[name][1]} {have[name][2]}")
    missing = [n for n in have if n not in {e[0] for e in theirs}]
    if missing:
        raise MessageError(f"the weights lack {missing[0]!r} (and {len(missing) - 1} more) of this worker's model")
    if [e[0] for e in theirs] != [e[0] for e in mine]:
        raise MessageError("the weights come in another order than this worker's model's parameters")


def check_weights(named: list[tuple[str, torch.Tensor]]) -> None:
    """:class:`MessageError` naming the first tensor with a NaN or infinite value."""
    for name, t in named:  # a NaN makes both extremes NaN, an inf one of them: exact, and 20x faster than isfinite
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
            raise MessageError(f"weights {name!r} hold non-finite values (NaN or inf)")

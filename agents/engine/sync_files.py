"""Weight versions through a shared folder (``sync_dir``), where no weight group can be formed between the learner and
its remote workers.

A version is written as pieces ``<prefix>-v<version>-<i>.safetensors`` of at most ``bucket`` bytes each (the files'
own sizes; a tensor larger than that goes alone in a piece of its own), then a small manifest
``<prefix>-v<version>.json`` naming each piece, its tensors (name, shape, dtype), its size and its SHA-256, written
last and renamed into place (so is each piece): a worker told the manifest's path finds every piece written. The
learner holds one piece at a time, the worker reads one at a time into its receive buffer and checks it (size,
checksum, the tensors the manifest names) before the next, and keeps the version only when every piece was whole:
a missing or damaged piece is refused in one line and nothing of that version is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Iterable, Sequence

import torch

from tokengym.agents.engine.messages import MessageError, check_manifest
from tokengym.agents.runtime.runs import replace_atomic
from tokengym.agents.runtime.weight_sync import nbytes, views

__all__ = ["plan", "write_version", "read_version", "FORMAT"]

FORMAT = 1


def _cost(entry: Sequence, n: int) -> int:
    """A tensor's bytes in a safetensors file: its data and, generously, its header entry."""
    name, shape, _ = entry
    return n + len(name.encode()) + 24 * len(shape) + 128


def plan(manifest: Sequence[Sequence], bucket: int) -> list[list[int]]:
    """The tensors (indices into ``manifest``, in order) of each piece: runs whose file stays within ``bucket``
    bytes; a tensor that alone exceeds it is a piece of its own."""
    pieces: list[list[int]] = []
    run: list[int] = []
    size = 0
    overhead = 64  # the header's length word, braces and padding
    for i, (entry, n) in enumerate(zip(manifest, nbytes(manifest))):
        cost = _cost(entry, n)
        if run and overhead + size + cost > bucket:
            pieces.append(run)
            run, size = [], 0
        run.append(i)
        size += cost
    if run:
        pieces.append(run)
    return pieces


def write_version(folder: str, prefix: str, version: int, named: Iterable[tuple[str, torch.Tensor]],
                  manifest: list, bucket: int) -> list[str]:
    """Write ``named`` (``(name, tensor)`` in ``manifest`` order, taken one at a time) as ``version``: its pieces,
    then its manifest; return the paths written, the manifest's last (what a worker is told). A failure removes
    what was written."""
    from safetensors.torch import save

    written: list[str] = []
    entries: list[dict[str, Any]] = []
    named = iter(named)
    try:
        for i, piece in enumerate(plan(manifest, bucket)):
            tensors = {}
            for _ in piece:
                name, t = next(named)
                tensors[name] = t.detach().to("cpu").contiguous()
            data = save(tensors)
            file = f"{prefix}-v{version}-{i}.safetensors"
            replace_atomic(os.path.join(folder, file), data, durable=False)
            written.append(os.path.join(folder, file))
            entries.append({"file": file, "tensors": [manifest[j] for j in piece], "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
            del tensors, data
        head = os.path.join(folder, f"{prefix}-v{version}.json")
        replace_atomic(head, json.dumps({"format": FORMAT, "version": version, "pieces": entries}).encode(), durable=False)
        written.append(head)
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise
    return written


def read_version(path: str, manifest: list, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Read the version whose manifest is ``path`` into ``buf`` (a worker's receive buffer, laid out by its own
    ``manifest``), piece by piece; return ``(name, view)`` of every tensor. :class:`MessageError` (one line) for a
    manifest that does not fit this model, or a piece that is missing or damaged."""
    if not path.endswith(".json"):  # (an older learner sent the whole model as one file)
        raise MessageError(f"the learner sent weights as {os.path.basename(path)}, not a version manifest: install the "
                           "same tokengym on the learner and the workers")
    try:
        with open(path, "rb") as f:
            head = json.loads(f.read())
        pieces = head["pieces"]
        theirs = [list(e) for p in pieces for e in p["tensors"]]
        files = [(str(p["file"]), int(p["bytes"]), str(p["sha256"])) for p in pieces]
    except OSError as e:
        raise MessageError(f"the version's manifest {path} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise MessageError(f"the version's manifest {path} is malformed ({type(e).__name__}: {e})") from None
    if any(os.sep in f or f.startswith(".") for f, _, _ in files):
        raise MessageError(f"the version's manifest {path} names a piece outside its folder")
    check_manifest(theirs, manifest)
    at = dict(zip((e[0] for e in manifest), views(buf, manifest)))
    folder = os.path.dirname(path)
    from safetensors.torch import load

    for piece, (file, size, digest) in zip(pieces, files):
        try:
            with open(os.path.join(folder, file), "rb") as f:
                data = f.read(size + 1)
        except OSError as e:
            raise MessageError(f"piece {file} of the version is missing or unreadable ({type(e).__name__}: "
                               f"{e.strerror or e})") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise MessageError(f"piece {file} of the version is damaged ({len(data) if len(data) <= size else 'over'} "
                               f"bytes of {size}, or its checksum differs); the version is refused")
        tensors = load(data)
        for name, shape, dtype in piece["tensors"]:
            t = tensors.get(name)
            if t is None or list(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise MessageError(f"piece {file} of the version does not hold {name!r} as its manifest says")
            at[name].copy_(t)
        del tensors, data
    return [(name, at[name]) for name, _, _ in manifest]

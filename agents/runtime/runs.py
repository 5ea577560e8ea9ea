"""Run folders: resolved configs, atomic checkpoints, exact resume.

A run lives in ``runs/<name>/``::

    config.json            the resolved configuration (algorithm, run settings, agent config)
    metrics.jsonl          one JSON record per logged step (also TensorBoard event files)
    .lock                  held (flock) by the tokengym process working on the run; names its PID and host
    checkpoints/latest     the name of the newest complete checkpoint, e.g. ``step-00000040``
    checkpoints/step-N/    <module>.safetensors (policy, critic, ref, ...) + trainer_state.pt + manifest.json
    model/                 the final policy, ``save_pretrained`` format (loadable with ``--model``)

Guarantees, so that a kill, a full disk or a damaged file never leaves something half-made or goes unnoticed:

* atomic: checkpoints and the final ``model/`` are written into a temporary folder that is renamed into place
  (:func:`write_folder_atomic`); ``latest``, ``config.json`` and a truncated ``metrics.jsonl`` are replaced with
  ``os.replace``. A crash at any point leaves the previous checkpoint as the latest, plus at most some
  ``*.tmp-<pid>`` leftovers that :func:`clean_stale_tmp` removes.
* durable: every file is fsynced before its rename and the folder after it.
* checksummed: ``manifest.json`` holds each checkpoint file's size and SHA-256; :func:`verify_checkpoint` checks
  them and :func:`latest_intact_checkpoint` falls back to the newest intact checkpoint, saying what it skipped.
  A damaged file raises a one-line :class:`UsageError` naming it, never a traceback; so does a full or
  read-only disk (:func:`storage_errors`).
* locked: :class:`RunLock` lets one process work on a run at a time.
* metrics survive damage: unreadable lines are skipped, never the valid records after them, and a damaged
  ``metrics.jsonl`` is kept as ``metrics.jsonl.damaged-<time>`` before it is rewritten.

Loading uses only safetensors and ``torch.load(weights_only=True)``. (Testing hook: the environment variable
``TOKENGYM_SIGKILL_DURING_WRITE=checkpoint`` (or ``model``, or any ``what`` given to :func:`write_folder_atomic`;
several separated by commas) makes the process SIGKILL itself in the middle of that write, before the rename.)

Config text (flags, TOML/JSON files) is read by :mod:`tokengym.agents.runtime.config_io`, whose names this module
re-exports.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import time
import unicodedata
from typing import Any, Callable, Iterator

import numpy as np
import torch

from tokengym.agents.runtime.config_io import (UsageError, short_error, apply_overrides, field_docs, field_types, first_line,
                                               parse_value, read_config_file)

__all__ = ["UsageError", "read_run_config", "field_docs", "parse_value", "apply_overrides", "read_config_file", "read_data_file", "is_run_dir",
           "field_types", "replace_atomic", "write_json_atomic", "write_folder_atomic", "storage_errors", "run_path", "RunLock",
           "clean_stale_tmp", "save_checkpoint", "verify_checkpoint", "latest_intact_checkpoint", "latest_checkpoint",
           "load_checkpoint", "nonfinite_weights", "truncate_metrics", "KeptMetrics", "metrics_damage", "read_metrics", "rng_state",
           "set_rng_state", "kill_during_write"]

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
LOCK_FILE = ".lock"
KILL_ENV = "TOKENGYM_SIGKILL_DURING_WRITE"
_STEP_RE = re.compile(r"step-(\d+)")
_TMP_RE = re.compile(r"[^.].*\.tmp(-\d+)?")  # <name>.tmp-<pid> (and <name>.tmp from older versions)


def read_data_file(path: str, flag: str, what: str, read: Callable[[str], Any]) -> Any:
    """``read(path)`` of a data file named by ``--<flag>`` (preference pairs, step labels), with a missing file or
    bad contents as a one-line :class:`UsageError` naming the file (``read``'s ValueError, KeyError, TypeError or
    OSError: the reader's own message, first line)."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} file {path!r} does not exist")
    try:
        return read(path)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise UsageError(f"cannot read {what} from {path!r}: {first_line(e)}") from None


# ---------------------------------------------------------------------------------------------- files
def kill_during_write(what: str) -> None:
    """Testing hook: SIGKILL this process when ``TOKENGYM_SIGKILL_DURING_WRITE`` names ``what``."""
    if what in [w.strip() for w in os.environ.get(KILL_ENV, "").split(",")]:  # a comma-separated list of names
        os.kill(os.getpid(), signal.SIGKILL)


def _human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


def _existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


_FULL = {errno.ENOSPC} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


def storage_error(e: OSError, path: str, what: str) -> UsageError | None:
    """The one-line UsageError for a full or non-writable disk hit while writing ``what`` to ``path``, else None."""
    if e.errno in _FULL:
        where = _existing(path)
        try:
            free = _human(shutil.disk_usage(where).free)
        except OSError:
            free = "an unknown amount"
        reason = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return UsageError(f"cannot write {what} to {path}: {reason} ({free} free on the file system of {where}); "
                          "free some space and retry")
    if e.errno in _NOT_WRITABLE:
        where = _existing(e.filename if isinstance(e.filename, str) else path)
        kind = "folder" if os.path.isdir(where) else "file"
        reason = "read-only file system" if e.errno == errno.EROFS else "permission denied"
        return UsageError(f"cannot write {what} to {path}: the {kind} {where} is not writable ({reason})")
    return None


@contextlib.contextmanager
def storage_errors(path: str, what: str) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT) or a non-writable folder (EACCES, EPERM, EROFS) inside the block into a
    one-line :class:`UsageError` that says what could not be written where (and how much space is free).

    Other OSErrors propagate unchanged: they are not the user's to fix.
    """
    try:
        yield
    except OSError as e:
        err = storage_error(e, path, what)
        if err is None:
            raise
        raise err from e


def _fsync_dir(path: str) -> None:
    """Make creations, renames and removals inside the folder ``path`` durable."""
    if os.name == "nt":  # folders cannot be opened (nor need to be synced) there
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some file systems cannot sync folders; nothing more to do there
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file and folder under ``root`` (symlinks are not followed)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(folder)


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sync_and_hash(path: str) -> dict[str, Any]:
    """fsync a file just written and return its manifest entry (size, SHA-256 of what is on disk)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"size": os.path.getsize(path), "sha256": file_sha256(path)}


def remove_path(path: str) -> None:
    """Remove a file, a link or a folder tree at ``path`` (nothing there: nothing to do)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _rmtree_quiet(path: str) -> None:
    """Best-effort removal (cleanup after a failure that is already being raised)."""
    try:
        remove_path(path)
    except OSError:
        pass


def replace_atomic(path: str, data: bytes, durable: bool = True) -> None:
    """Replace the file ``path`` with ``data``: temporary file, ``os.replace`` (a reader sees the old file or the new
    one, never part of one; the temporary file is removed on failure). ``durable``: fsync the file and its folder
    too, so it survives a crash (a weight version that the next one replaces within a step does not need to)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _rmtree_quiet(tmp)
        raise
    if durable:
        _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to ``path`` atomically and durably (never a half-written file); a full or read-only disk
    raises a one-line :class:`UsageError`."""
    data = json.dumps(obj, indent=2, sort_keys=True).encode()
    with storage_errors(path, os.path.basename(path)):
        replace_atomic(path, data)


def write_folder_atomic(path: str, write: Callable[[str], None], what: str = "model") -> None:
    """Create the folder ``path`` whole or not at all: ``write(tmp)`` fills ``<path>.tmp-<pid>``, which is fsynced
    and renamed into place. ``path`` must not exist (UsageError). ``what`` names it in errors and is the
    ``TOKENGYM_SIGKILL_DURING_WRITE`` key (the kill comes after ``write`` returns, before the rename).
    """
    path = os.path.normpath(path)
    if os.path.lexists(path):
        raise UsageError(f"{path} already exists; not overwriting it")
    tmp = f"{path}.tmp-{os.getpid()}"
    with storage_errors(path, what):
        try:
            remove_path(tmp)
            os.makedirs(tmp)
            write(tmp)
            kill_during_write(what)
            _fsync_tree(tmp)
            if os.path.lexists(path):
                raise UsageError(f"{path} appeared while it was being written; not overwriting it")
            os.rename(tmp, path)
        except BaseException:
            _rmtree_quiet(tmp)
            raise
        _fsync_dir(os.path.dirname(os.path.abspath(path)))


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def read_run_config(run_dir: str) -> dict[str, Any]:
    """A run folder's ``config.json`` (algorithm, ``run`` and ``config`` sections), or a one-line :class:`UsageError`
    saying why it cannot be used (no such run folder, unreadable, not JSON, a section missing)."""
    if not is_run_dir(run_dir):
        raise UsageError(f"{run_dir!r} is not a run folder (no config.json); runs are created by `tokengym train`")
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {first_line(e)}") from None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), dict) for k in ("run", "config")):
        raise UsageError(f"{path} is damaged: it needs an 'algorithm' name and 'run' and 'config' sections")
    return saved


def run_path(runs_dir: str, name: str) -> str:
    """``runs_dir/name``, refusing (UsageError) a name that is not one plain folder name or a runs_dir that is a file.

    >>> run_path("no-such-runs-dir", "grpo-1") == os.path.join("no-such-runs-dir", "grpo-1")
    True
    >>> try:
    ...     run_path("no-such-runs-dir", "../escape")
    ... except UsageError as e:
    ...     print(e)
    run name '../escape' contains a path separator; use a plain folder name such as 'grpo-arith-1'
    """
    if os.path.exists(runs_dir) and not os.path.isdir(runs_dir):
        raise UsageError(f"--runs-dir {runs_dir} is a file, not a folder")
    real = os.path.realpath(runs_dir)
    if any(real == v or real.startswith(v + os.sep) for v in ("/proc", "/sys", "/dev")):
        raise UsageError(f"--runs-dir {runs_dir} is on a virtual filesystem ({real}); pick a folder on a disk")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    control = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf")), None)
    problem = ("is empty" if not name.strip() else
               "is an absolute path" if os.path.isabs(name) or name[0] in seps else
               "contains a path separator" if any(s in name for s in seps) else
               "contains '..'" if ".." in name else
               "starts with '.'" if name.startswith(".") else
               "starts with '-' (it would read as a command-line flag)" if name.startswith("-") else
               f"contains the control character U+{ord(control):04X}" if control is not None else
               f"is {len(name.encode())} bytes long, over the filesystem's 255" if len(name.encode()) > 255 else None)
    if problem:
        raise UsageError(f"run name {name!r} {problem}; use a plain folder name such as 'grpo-arith-1'")
    path = os.path.join(runs_dir, name)
    if os.path.islink(path):
        raise UsageError(f"{path} is a symbolic link (to {os.readlink(path)}); a run is written only inside --runs-dir, "
                         "pick another --name")
    return path


# ---------------------------------------------------------------------------------------------- run lock
class RunLock:
    """One tokengym process per run folder: an exclusive ``flock`` on ``run_dir/.lock`` (holds the PID and host).

    Use as ``with RunLock(run_dir):`` or ``.acquire()`` / ``.release()``. The OS drops the lock when its holder
    exits, even on SIGKILL, so a crashed run never blocks its own ``--resume``. Take it in one process (rank 0)
    for the whole run; a process forked while it is held holds it too. flock may not exclude across NFS hosts.
    """

    def __init__(self, run_dir: str, create: bool = True):
        self.run_dir, self.path, self.create = run_dir, os.path.join(run_dir, LOCK_FILE), create
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock (creating ``run_dir`` if ``create``, else a missing folder is a UsageError); raise
        UsageError naming the holder if another process has it."""
        import fcntl
        import socket

        if self._fd is not None:
            return self
        if not self.create and not os.path.isdir(self.run_dir):
            raise UsageError(f"{self.run_dir} does not exist or is not a folder")
        with storage_errors(self.path, "the run lock"):
            try:
                os.makedirs(self.run_dir, exist_ok=True)
            except OSError as e:
                if storage_error(e, self.path, "the run lock") is None:  # not a full or read-only disk: say what failed
                    raise UsageError(f"cannot create the run folder {self.run_dir}: {e.strerror or e}") from None
                raise
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 256, 0).decode(errors="replace").split()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            who = "pid unknown" if not holder else f"pid {holder[0]}" if len(holder) < 2 or holder[1] == socket.gethostname() \
                else f"pid {holder[0]} on {holder[1]}"
            raise UsageError(f"{self.run_dir} is in use by another tokengym process ({who}); "
                             "wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def clean_stale_tmp(run_dir: str) -> list[str]:
    """Remove what interrupted writes left behind; return the removed paths, relative to ``run_dir``.

    That is ``checkpoints/.tmp-*`` and ``checkpoints/latest.tmp*``, and ``<name>.tmp`` / ``<name>.tmp-<pid>`` in the
    run folder itself (``model.tmp-123``, ``config.json.tmp-123``, ``metrics.jsonl.tmp``). Only safe while holding
    :class:`RunLock`: a write in progress in another process looks exactly the same.
    """
    removed = []
    for sub, stale in (("", lambda n: _TMP_RE.fullmatch(n) is not None),
                       (CHECKPOINTS, lambda n: n.startswith(".tmp-") or _TMP_RE.fullmatch(n) is not None)):
        folder = os.path.join(run_dir, sub) if sub else run_dir
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if stale(name):
                remove_path(os.path.join(folder, name))
                removed.append(os.path.join(sub, name) if sub else name)
    if removed:
        _fsync_dir(run_dir)
    return removed


# ---------------------------------------------------------------------------------------------- checkpoints
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


def _step_dirs(root: str) -> dict[int, str]:
    """``{step: folder name}`` of the ``step-N`` folders in ``checkpoints/``."""
    if not os.path.isdir(root):
        return {}
    out: dict[int, str] = {}
    for name in sorted(os.listdir(root)):
        m = _STEP_RE.fullmatch(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out[int(m.group(1))] = name
    return out


def _library_write(write: Callable[[], None], folder: str) -> None:
    """Run a torch / safetensors writer; a failure on a (nearly) full disk, which they report as "iostream error"
    or "file write failed" rather than ENOSPC, becomes the ENOSPC OSError that :func:`storage_errors` explains."""
    try:
        write()
    except Exception as e:
        if isinstance(e, OSError):
            raise
        try:
            full = shutil.disk_usage(folder).free < _NEARLY_FULL
        except OSError:
            full = False
        if full:
            raise OSError(errno.ENOSPC, f"no space left on device ({short_error(e)})") from e
        raise


_NEARLY_FULL = 16 * 2**20
"""Free bytes under which a failed library write is taken for a full disk."""


def save_checkpoint(run_dir: str, step: int, modules: dict[str, torch.nn.Module], state: dict[str, Any],
                    keep: int = 2) -> str:
    """Write ``checkpoints/step-<step>/`` atomically and durably, point ``latest`` at it, keep the newest ``keep``.

    Every file is fsynced and its size and SHA-256 (read back from disk) recorded in ``manifest.json``, written
    last; then the folder is renamed into place and ``checkpoints/`` fsynced, then ``latest`` moves, and only
    then are older checkpoints pruned, so an intact checkpoint always exists. On failure the temporary folder
    is removed; a full or read-only disk raises a one-line :class:`UsageError`.
    """
    from safetensors.torch import save_model

    root = os.path.join(run_dir, CHECKPOINTS)
    name = f"step-{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}-{os.getpid()}")
    with storage_errors(final, "the checkpoint"):
        os.makedirs(root, exist_ok=True)
        try:
            remove_path(tmp)
            os.makedirs(tmp)
            files: dict[str, dict[str, Any]] = {}

            def written(fname: str) -> None:
                files[fname] = _sync_and_hash(os.path.join(tmp, fname))
                if len(files) == 1:
                    kill_during_write("checkpoint")

            for key, module in modules.items():
                _library_write(lambda: save_model(module, os.path.join(tmp, f"{key}.safetensors")), tmp)
                written(f"{key}.safetensors")
            _library_write(lambda: torch.save({"step": step, "modules": sorted(modules), "rng": rng_state(), **state},
                                              os.path.join(tmp, STATE_FILE)), tmp)
            written(STATE_FILE)
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump({"format": 1, "step": step, "files": files}, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if os.path.lexists(final):  # a checkpoint of this step from a run that was killed after writing it
                aside = os.path.join(root, f".tmp-old-{name}-{os.getpid()}")
                os.rename(final, aside)
                os.rename(tmp, final)
                _fsync_dir(root)
                _rmtree_quiet(aside)
            else:
                os.rename(tmp, final)
            _fsync_dir(root)
        except BaseException:
            _rmtree_quiet(tmp)
            raise
        replace_atomic(os.path.join(root, "latest"), (name + "\n").encode())
        if keep > 0:  # the new checkpoint and the newest keep-1 older ones; never one newer than this step
            older = sorted(n for n in _step_dirs(root) if n < step)
            for n in older[:max(len(older) - (keep - 1), 0)]:
                _rmtree_quiet(os.path.join(root, f"step-{n:08d}"))
    return final


def _verify_legacy(path: str) -> str | None:
    """A checkpoint without manifest.json: damaged when another checkpoint of the run has one (the manifest was lost,
    so nothing vouches for its bytes); otherwise an old checkpoint, intact if trainer_state.pt loads and every
    module file opens and holds only finite values."""
    from safetensors import safe_open

    root = os.path.dirname(path)
    if any(os.path.lexists(os.path.join(root, d, MANIFEST)) for d in _step_dirs(root).values()):
        return f"{MANIFEST}: missing, though the run's other checkpoints have one"
    note = "(old checkpoint without manifest.json)"
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        return f"{STATE_FILE}: missing {note}"
    try:
        modules = list(torch.load(state_path, map_location="cpu", weights_only=True)["modules"])
    except Exception as e:  # truncated, empty, garbled: torch raises many kinds
        return f"{STATE_FILE}: unreadable, {short_error(e)} {note}"
    for key in modules:
        fname = f"{key}.safetensors"
        if not os.path.isfile(os.path.join(path, fname)):
            return f"{fname}: missing {note}"
        try:  # the header, the file's length, and every value (no checksum vouches for them)
            with safe_open(os.path.join(path, fname), "pt") as f:
                bad = next((k for k in f.keys() if not _finite(f.get_tensor(k))), None)
        except Exception as e:
            return f"{fname}: unreadable, {short_error(e)} {note}"
        if bad is not None:
            return f"{fname}: {bad} holds NaN or inf {note}"
    return None


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def nonfinite_weights(module: torch.nn.Module) -> str | None:
    """The name of the first parameter or buffer of ``module`` holding NaN or inf, else None."""
    return next((k for k, v in module.state_dict().items() if not _finite(v)), None)


def verify_checkpoint(path: str) -> str | None:
    """None when the checkpoint folder ``path`` is intact, else a short reason ("policy.safetensors: checksum mismatch").

    Every file ``manifest.json`` lists must exist with its recorded size and SHA-256. A checkpoint without
    manifest.json is damaged when another checkpoint of the run has one; in a run written before manifests existed
    it cannot be checked byte for byte, and is accepted when trainer_state.pt loads and every module file it lists
    opens as safetensors with finite values (so a missing, empty, cut-short or NaN-filled file is still caught).
    """
    if not os.path.isdir(path):
        return "folder missing"
    mpath = os.path.join(path, MANIFEST)
    if not os.path.lexists(mpath):
        return _verify_legacy(path)
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
        entries = [(str(fname), int(e["size"]), str(e["sha256"])) for fname, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST}: unreadable"
    if STATE_FILE not in files:
        return f"{MANIFEST}: does not list {STATE_FILE}"
    for fname, size, digest in entries:
        if os.path.basename(fname) != fname or fname in ("", ".", ".."):
            return f"{MANIFEST}: bad file name {fname!r}"
        p = os.path.join(path, fname)
        if not os.path.isfile(p):
            return f"{fname}: missing"
        actual = os.path.getsize(p)
        if actual != size:
            return f"{fname}: {'cut short' if actual < size else 'too long'} ({actual} bytes, expected {size})"
        if file_sha256(p) != digest:
            return f"{fname}: checksum mismatch"
    return None


def latest_intact_checkpoint(run_dir: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint that passes :func:`verify_checkpoint`, and one line per newer one skipped (and why).

    Candidates are the ``checkpoints/step-*`` folders up to the one ``latest`` names, newest first; all of them
    when ``latest`` is missing or garbled (which adds a line too). Folders newer than ``latest`` come from a save
    killed before ``latest`` moved and are ignored. ``(None, [])``: no checkpoint yet; ``(None, lines)``: there
    are checkpoints but none is intact (a caller resuming should refuse rather than start over).
    """
    path, notes, skipped = _scan_checkpoints(run_dir)
    return path, _messages(path, notes, skipped)


def _messages(path: str | None, notes: list[str], skipped: list[str]) -> list[str]:
    tail = f"; falling back to {os.path.basename(path)}" if path else "; no intact checkpoint left"
    return notes + [f"{s}{tail}" for s in skipped]


def _scan_checkpoints(run_dir: str) -> tuple[str | None, list[str], list[str]]:
    root = os.path.join(run_dir, CHECKPOINTS)
    dirs = _step_dirs(root)
    notes: list[str] = []
    skipped: list[str] = []
    pointer = os.path.join(root, "latest")
    named: int | None = None
    if os.path.lexists(pointer):
        try:
            with open(pointer) as f:
                text = f.read(200).strip()
        except (OSError, ValueError):
            text = "<unreadable>"
        m = _STEP_RE.fullmatch(text)
        if m is None:
            notes.append(f"{CHECKPOINTS}/latest is garbled ({text[:40]!r}); looking at every step folder")
        else:
            named = int(m.group(1))
            if named not in dirs:
                skipped.append(f"{CHECKPOINTS}/{text} (named by {CHECKPOINTS}/latest) is missing")
    elif dirs:
        notes.append(f"{CHECKPOINTS}/latest is missing; looking at every step folder")
    for n in sorted((n for n in dirs if named is None or n <= named), reverse=True):
        reason = verify_checkpoint(os.path.join(root, dirs[n]))
        if reason is None:
            return os.path.join(root, dirs[n]), notes, skipped
        skipped.append(f"{CHECKPOINTS}/{dirs[n]} is damaged ({reason})")
    return None, notes, skipped


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest intact checkpoint (see :func:`latest_intact_checkpoint`; skipped ones are reported on stderr),
    None when the run has none yet; UsageError when it has checkpoints but none is intact."""
    path, notes, skipped = _scan_checkpoints(run_dir)
    if path is None and skipped:
        raise UsageError(f"{run_dir} has no intact checkpoint: {skipped[0]}" +
                         (f" (and {len(skipped) - 1} older)" if len(skipped) > 1 else ""))
    for line in _messages(path, notes, skipped):
        print(f"warning: {line}", file=sys.stderr)
    return path


def load_checkpoint(path: str, modules: dict[str, torch.nn.Module], verify: bool = False) -> dict[str, Any]:
    """Load module weights (strict) and return the trainer state (RNG states restored).

    A missing or damaged file raises a one-line :class:`UsageError` naming it. ``verify=True`` first checks the
    manifest (not needed for a path from :func:`latest_intact_checkpoint`, which already did).
    """
    from safetensors.torch import load_model

    if verify and (reason := verify_checkpoint(path)) is not None:
        raise UsageError(f"checkpoint {path} is damaged ({reason})")
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        raise UsageError(f"{state_path} is missing: the checkpoint is incomplete")
    try:
        state = torch.load(state_path, weights_only=True)
        saved = list(state["modules"])
    except Exception as e:  # truncated, empty or garbled: torch raises RuntimeError, EOFError, UnpicklingError...
        raise UsageError(f"{state_path} is damaged and cannot be loaded ({short_error(e)})") from None
    if sorted(modules) != saved:
        raise UsageError(f"checkpoint {path!r} holds modules {saved}, this run needs {sorted(modules)}: "
                         "was it written with a different config?")
    for key, module in modules.items():
        file = os.path.join(path, f"{key}.safetensors")
        if not os.path.isfile(file):
            raise UsageError(f"{file} is missing: the checkpoint is incomplete")
        try:
            load_model(module, file, strict=True)
        except RuntimeError as e:  # missing/unexpected keys or shapes: a different model
            raise UsageError(f"{file} does not fit this run's {key} ({short_error(e)}): was it written with a different config?") from None
        except Exception as e:  # SafetensorError (truncated, empty, garbled header), OSError
            raise UsageError(f"{file} is damaged and cannot be loaded ({short_error(e)})") from None
        if (bad := nonfinite_weights(module)) is not None:  # weights with NaN/inf never load silently
            raise UsageError(f"{file} holds NaN or inf in {bad}: the checkpoint cannot be resumed (diverged training, or "
                             "damaged bytes); resume from an earlier one by removing this step folder")
    try:
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise UsageError(f"{state_path} is damaged: bad RNG state ({short_error(e)})") from None
    return state


# ---------------------------------------------------------------------------------------------- metrics
class KeptMetrics(list):
    """The records :func:`truncate_metrics` kept (a plain list), plus ``warning``: one line if the file was damaged."""

    warning: str | None = None


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    if not isinstance(rec, dict):
        return None
    step = rec.get("step", 0)
    return rec if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _scan_metrics(path: str) -> tuple[list[tuple[bytes, dict[str, Any]]], list[int]]:
    """``([(line, record)] in file order, numbers of unreadable lines)``; a cut-short last line is not counted."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = lines.pop()  # b"" when the file ends with a newline; else a line cut short (or only its newline)
    records, bad = [], []
    for i, raw in enumerate(lines, 1):
        rec = _parse_record(raw)
        if rec is not None:
            records.append((raw.rstrip(), rec))
        elif raw.strip():
            bad.append(i)
    if last.strip() and (rec := _parse_record(last)) is not None:
        records.append((last.rstrip(), rec))
    return records, bad


def _line_numbers(bad: list[int]) -> str:
    shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
    return f"{len(bad)} unreadable line{'s' if len(bad) > 1 else ''} (line{'s' if len(bad) > 1 else ''} {shown})"


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Every readable record of ``metrics.jsonl`` in file order; unreadable lines are skipped."""
    path = os.path.join(run_dir, METRICS)
    return [rec for _, rec in _scan_metrics(path)[0]] if os.path.isfile(path) else []


def metrics_damage(run_dir: str) -> str | None:
    """One line if ``metrics.jsonl`` has unreadable lines (a cut-short last line, normal after a kill, is not one)."""
    path = os.path.join(run_dir, METRICS)
    bad = _scan_metrics(path)[1] if os.path.isfile(path) else []
    return f"{path} has {_line_numbers(bad)}; they are skipped" if bad else None


def _copy_damaged(path: str) -> str:
    """Copy ``path`` to ``<path>.damaged-<UTC time>[-k]``, never overwriting one; return the copy's path."""
    base = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    for k in itertools.count():
        dest = base if k == 0 else f"{base}-{k}"
        try:
            out = open(dest, "xb")
        except FileExistsError:
            continue
        try:
            with out, open(path, "rb") as src:
                shutil.copyfileobj(src, out)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            _rmtree_quiet(dest)
            raise
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
        return dest
    raise AssertionError("unreachable")


def truncate_metrics(run_dir: str, step: int) -> KeptMetrics:
    """Keep the records logged at or before ``step`` (later work was lost with a crash and is about to be redone);
    return them.

    Every readable record is kept, in file order, also after an unreadable line; a cut-short last line (normal after
    a kill) is dropped. Any other unreadable line is damage: the original is first copied to
    ``metrics.jsonl.damaged-<UTC time>`` and the returned list's ``warning`` says so. The rewrite is atomic.
    """
    path = os.path.join(run_dir, METRICS)
    kept = KeptMetrics()
    lines: list[bytes] = []
    with storage_errors(path, METRICS):
        if os.path.isfile(path):
            records, bad = _scan_metrics(path)
            if bad:
                copy = _copy_damaged(path)
                kept.warning = (f"{path} had {_line_numbers(bad)}; kept every readable record, "
                                f"the original is saved as {os.path.basename(copy)}")
            for raw, rec in records:
                if rec.get("step", 0) <= step:
                    lines.append(raw + b"\n")
                    kept.append(rec)
        replace_atomic(path, b"".join(lines))
    return kept

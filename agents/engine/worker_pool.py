"""The learner's side of rollout workers, whichever kind: :class:`WorkerPool` (the version schedule, the staleness
check, the weight publication, the checkpointed queue and streams), the :class:`WorkerError` that names a failed
worker, and the helpers both kinds use (a stream as a checkpoint holds it, the weights a sync sends).

:class:`~tokengym.agents.engine.workers.RolloutWorkers` (local processes) and
:class:`~tokengym.agents.engine.remote.RemoteWorkers` (``tokengym worker`` servers) subclass the pool;
:mod:`~tokengym.agents.engine.sources` picks one (and re-exports these names).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from tokengym.agents.engine.messages import MessageError, check_rollout, decode_rollout
from tokengym.agents.engine.rollout_data import Rollout
from tokengym.agents.runtime.weight_sync import WeightSyncError

__all__ = ["WorkerError", "WorkerPool", "full_named", "stream_from_state", "stream_state"]


class WorkerError(RuntimeError):
    """A rollout worker died, failed, was lost or refused; the message names it."""


class WorkerPool:
    """The learner's side of rollout workers (async modes): subclasses start them, move messages and weights.

    Rollout ``j`` is sampled with a version ``v >= j - k`` (exactly ``max(0, j - k)`` when ``exact``); the learner
    trains on it at step ``j``, so its staleness is at most ``k`` (checked). ``state`` continues a checkpoint's queue
    and streams. A subclass implements :meth:`_message`, :meth:`_send` and :meth:`_shutdown`.
    """

    workers: int

    def __init__(self, *, max_staleness: int, exact: bool, state: dict[str, Any] | None, workers: int,
                 total: int | None, rollout_timeout: float, rows: int, width: int, device: Any):
        self.workers, self.k, self.exact, self.total = workers, max_staleness, exact, total
        self.rollout_timeout, self.rows, self.width, self.device = rollout_timeout, rows, width, torch.device(device)
        self._pending: threading.Thread | None = None  # a sync in flight (publish(wait=False))
        self._failed: BaseException | None = None
        self.sync_seconds = 0.0
        self.version = -1  # the newest version published
        self.taken = b""  # the message of the rollout take() returned last (a torchrun learner passes it on)
        state = state or {"next": 0, "queue": [], "streams": [None] * workers}
        if len(state["streams"]) != workers:
            raise ValueError(f"the checkpoint's async state has {len(state['streams'])} rollout workers' streams, and this "
                             f"run has rollout_workers={workers}; resume with the same number of workers")
        self.next = int(state["next"])  # the next rollout the learner trains on
        self.received: dict[int, tuple] = {}
        for m in state["queue"]:
            data = _as_bytes(m["rollout"])
            ro, _, stream = decode_rollout(data, self.device)
            self.received[int(m["index"])] = (ro, int(m["version"]), int(m["worker"]), stream, 0.0, data)
        self.streams: list[Any] = [stream_from_state(s) for s in state["streams"]]  # each slot's stream after its
        self.first = self.next + len(self.received)  # newest kept rollout; the first rollout a worker samples

    # ------------------------------------------------------------------ what a subclass supplies
    def _message(self, waiting_for: int | None = None, wait: bool = True) -> bytes | None:
        """The workers' next rollout message (``wait=False``: None if none has come); a worker's failure or loss is
        a :class:`WorkerError` naming it, and so is a rollout ``waiting_for`` that has not come within
        ``rollout_timeout`` seconds."""
        raise NotImplementedError

    def _send(self, version: int) -> float:
        """Send the policy's weights as ``version`` to every worker; return the seconds."""
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Stop the workers (or end their sessions) and release what the pool holds; a sync may still be in flight
        (:meth:`_in_flight`, after Ctrl-C): it is left to run out, its groups untouched."""
        raise NotImplementedError

    def close(self, interrupted: bool = False) -> None:
        """Let a sync in flight end, then :meth:`_shutdown`; idempotent. ``interrupted`` (Ctrl-C): leave a sync in
        flight to run out in its thread instead of waiting up to ``sync_timeout`` for it; the run's checkpoints are
        written between steps, never by it, so nothing is lost."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if not interrupted:
            with contextlib.suppress(Exception):
                self.settle()
        self._shutdown()

    def _in_flight(self) -> bool:
        """Whether a sync started with ``wait=False`` still runs (closing after Ctrl-C does not wait for it)."""
        return self._pending is not None and self._pending.is_alive()

    def pids(self) -> list[int]:
        return []

    def live_count(self) -> float:
        """How many workers sample now."""
        return float(self.workers)

    # ------------------------------------------------------------------ weights
    def publish(self, version: int, wait: bool = True) -> None:
        """Send the policy's weights as ``version`` to every worker. ``wait=False``: in a thread, while the learner
        goes on; the weights must not change until :meth:`settle` (the learner calls it before its optimiser
        step, so the next update's forward and backward overlap the sync)."""
        self.settle()
        self.version = version
        if wait:
            self._publish(version)
            self._raise_failed()
            return
        self._pending = threading.Thread(target=self._publish, args=(version,), name="weight-publish", daemon=True)
        self._pending.start()

    def _publish(self, version: int) -> None:
        try:
            self.sync_seconds = self._send(version)
        except (WeightSyncError, WorkerError) as e:
            self._failed = e

    def settle(self) -> None:
        """Wait for a sync started with ``wait=False``; raise its failure as a :class:`WorkerError`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            # a broken connection is a worker dying: give its exit a moment to be seen, so the line names it
            self._check_alive(wait=5.0 if getattr(failed, "lost", None) else 0.0)
            raise WorkerError(str(failed)) from None

    def _check_alive(self, wait: float = 0.0) -> None:
        """Raise a :class:`WorkerError` naming a worker known to be gone (within ``wait`` seconds)."""

    def _pending_failed(self) -> None:
        """Called while waiting for a message: a sync that failed meanwhile means its worker will send nothing."""
        if self._pending is not None and not self._pending.is_alive():
            self.settle()

    # ------------------------------------------------------------------ rollouts
    def _receive(self, index: int) -> float:
        """Wait until rollout ``index`` has arrived; return the seconds waited."""
        t0 = time.perf_counter()
        while index not in self.received:  # (each message restarts the clock: the others' rollouts are progress too)
            self._store(self._message(waiting_for=index))
        return time.perf_counter() - t0

    def _store(self, data: bytes) -> None:
        meta: dict[str, Any] = {}
        try:
            ro, meta, stream = decode_rollout(data, self.device)
            j = int(meta["index"])
            check_rollout(ro, self.rows, self.width, range(max(0, j - self.k), j + 1))
        except (MessageError, KeyError, TypeError, ValueError) as e:
            raise WorkerError(f"{self._name(meta.get('worker'))} sent a rollout this learner refuses: {e}") from None
        self.received[j] = (ro, ro.policy_version, int(meta["worker"]), stream, float(meta["seconds"]), data)

    def _name(self, worker: Any) -> str:
        return f"rollout worker {worker}"

    def take(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """The rollout the learner trains on at ``step`` (its policy version) and its ``async/*`` metrics."""
        if step != self.next:
            raise RuntimeError(f"the learner asked for rollout {step}, and the next one is {self.next}")
        waited = self._receive(self.next)
        ro, version, i, stream, seconds, self.taken = self.received.pop(self.next)
        self.streams[i] = stream
        self.next += 1
        lag = step - version
        if not 0 <= lag <= self.k:  # the schedule makes this impossible; a broken invariant must not train silently
            raise RuntimeError(f"rollout {step} was sampled by policy version {version}: staleness {lag} is outside "
                               f"[0, max_staleness={self.k}]")
        return ro, {"async/staleness": float(lag), "async/policy_version": float(version), "async/workers": self.live_count(),
                    "time/async_wait": waited, "time/worker_rollout": seconds, "time/weight_sync": self.sync_seconds}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint after the learner's current step keeps. An exact schedule waits for its K (at most 1)
        rollouts sampled with versions before the step, so it resumes bit for bit; a bounded run keeps those that
        have arrived (in order, none past the run's last) and waits for none, so a large K never holds up a
        checkpoint or a SIGTERM: the rest are sampled again after a resume, with newer weights."""
        self.settle()
        if self.exact:
            keep = range(self.next, self.next + self.k)
            for j in keep:
                self._receive(j)
        else:
            while (msg := self._message(wait=False)) is not None:
                self._store(msg)
            end, j = self.next + self.k if self.total is None else min(self.next + self.k, self.total), self.next
            while j < end and j in self.received:
                j += 1
            keep = range(self.next, j)
        streams = list(self.streams)
        for j in keep:
            streams[self.received[j][2]] = self.received[j][3]  # j ascending: the newest kept rollout of a worker wins
        queue = [{"index": j, "version": self.received[j][1], "worker": self.received[j][2],
                  "rollout": torch.frombuffer(bytearray(self.received[j][5]), dtype=torch.uint8)} for j in keep]
        return {"next": self.next, "queue": queue, "streams": [stream_state(s) for s in streams]}


def _as_bytes(data: Any) -> bytes:
    """A checkpoint's rollout message (a uint8 tensor) as bytes."""
    if isinstance(data, dict):
        raise ValueError("the checkpoint's async queue was written by an older tokengym (pickled rollouts); resume it "
                         "with async_mode='off' once, or with that version")
    return data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)


def stream_state(stream: dict[str, Any] | None) -> dict[str, Any] | None:
    """A worker's stream as a checkpoint (and a JSON message) holds it: the env's state, the generator's bytes."""
    return None if stream is None else {"env": stream["env"], "rng": [int(b) for b in stream["rng"].tolist()]}


def stream_from_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The inverse of :func:`stream_state`: the generator's bytes as a uint8 tensor again."""
    if state is None:
        return None
    rng = state["rng"]
    return {"env": state["env"], "rng": rng if isinstance(rng, torch.Tensor) else torch.tensor(rng, dtype=torch.uint8)}


def full_named(model: torch.nn.Module):
    """``(name, tensor)`` of ``model``'s parameters, each whole when it is asked for (an FSDP2 shard is gathered
    then, a collective every rank runs in the same order); what a weight sync sends."""
    for name, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        yield name, (full() if full is not None else p)

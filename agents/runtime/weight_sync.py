"""Versioned weight sync from the learner to rollout worker processes over a torch.distributed broadcast.

The learner is rank 0 of its own process group (gloo on CPU, nccl on CUDA), apart from any data-parallel group;
each rollout worker is one further rank. A sync is one broadcast of a header ``[version, 0]`` and one broadcast
per parameter tensor (no flat copy of the model). Every worker receives every version in order (a thread of its
own, so a sync never waits for a rollout to finish) and acknowledges it in the group's store, so a sync that
fails or times out names the workers that did not take it instead of hanging: :class:`WeightSyncError`.
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["WeightSync", "WeightSyncError", "STOP"]

STOP = -1
"""The header version that tells the workers to stop."""


class WeightSyncError(RuntimeError):
    """A weight sync that failed or timed out; the message names the workers that did not take it."""


class WeightSync:
    """One side of the learner-to-workers weight channel (see the module docstring).

    The learner serves a store (:meth:`serve`), starts the workers, and is rank 0; each worker connects to it
    (:meth:`connect`) and is one further rank. ``timeout`` is the learner's: how long a sync may wait
    for the slowest worker. Workers wait for the learner's next version without a limit of their own (an update or
    an evaluation can take minutes); a learner that dies closes the connection, which ends their wait at once.
    """

    def __init__(self, store: dist.Store, rank: int, workers: int, timeout: float, device: str):
        self.store, self.rank, self.workers, self.timeout = store, rank, workers, float(timeout)
        self.device = torch.device(device)
        delta = datetime.timedelta(seconds=timeout)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = delta
            self.group = dist.ProcessGroupNCCL(store, rank, workers + 1, opts)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, workers + 1, delta)

    @staticmethod
    def serve(workers: int, timeout: float, host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
        """The learner's store on ``host:port`` (0: a free port; ``store.port`` tells the workers where). Start the
        workers, then make rank 0 with ``WeightSync(store, 0, workers, timeout, device)``, which waits for them."""
        delta = datetime.timedelta(seconds=timeout)
        return dist.TCPStore(host, port, workers + 1, True, timeout=delta, wait_for_workers=False)

    WORKER_TIMEOUT = 7 * 24 * 3600.0
    """A worker's own limit: it waits for the learner's next version as long as an update or evaluation takes."""

    @staticmethod
    def connect(port: int, workers: int, host: str = "127.0.0.1") -> dist.TCPStore:
        """A worker's connection to the learner's store on ``host:port``; then ``WeightSync(store, rank, workers,
        WeightSync.WORKER_TIMEOUT)`` with ``rank`` in 1..workers."""
        delta = datetime.timedelta(seconds=WeightSync.WORKER_TIMEOUT)
        return dist.TCPStore(host, port, workers + 1, False, timeout=delta)

    # ------------------------------------------------------------------ learner
    def publish(self, version: int, params: Iterable[torch.Tensor], names: dict[int, str] | None = None) -> float:
        """Broadcast ``params`` as ``version`` (``STOP``: no params, the workers stop); return the seconds it took.

        Raises :class:`WeightSyncError` naming the workers (``names[rank]``, default ``rollout worker <rank - 1>``)
        that did not acknowledge ``version`` when the broadcast fails or outlasts the timeout."""
        import time

        t0 = time.perf_counter()
        try:
            self._broadcast(torch.tensor([version, 0], dtype=torch.int64, device=self._comm_device))
            if version != STOP:
                with torch.no_grad():
                    for p in params:  # each tensor as it is: no flat copy of the model
                        self._broadcast(p.detach().contiguous().to(self._comm_device))
                self._wait_acks(version)
        except (RuntimeError, dist.DistBackendError) as e:
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(self._lagging(version, names, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")) from None
        return time.perf_counter() - t0

    def _broadcast(self, t: torch.Tensor) -> None:
        self.group.broadcast([t], dist.BroadcastOptions()).wait()

    def _wait_acks(self, version: int) -> None:
        try:
            self.store.wait([f"ack/{r}/{version}" for r in range(1, self.workers + 1)],
                            datetime.timedelta(seconds=self.timeout))
        except (RuntimeError, dist.DistStoreError) as e:
            raise WeightSyncError(self._lagging(version, None, "no acknowledgement")) from e

    def _lagging(self, version: int, names: dict[int, str] | None, why: str) -> str:
        late = [r for r in range(1, self.workers + 1) if not self.store.check([f"ack/{r}/{version}"])]
        who = ", ".join((names or {}).get(r, f"rollout worker {r - 1}") for r in late) or "no worker"
        return (f"weight sync of policy version {version} failed: {who} did not take it within {self.timeout:g} s "
                f"(sync_timeout) ({why})")

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # ------------------------------------------------------------------ worker
    def receive(self, into: list[torch.Tensor]) -> int:
        """Wait for the next version and receive it into ``into`` (tensors shaped like the learner's params, in its
        order); return the version, or ``STOP``. The version is acknowledged in the store once all of it arrived."""
        header = torch.zeros(2, dtype=torch.int64, device=self._comm_device)
        self._broadcast(header)
        version = int(header[0])
        if version == STOP:
            return STOP
        for t in into:
            self._broadcast(t)
        self.store.set(f"ack/{self.rank}/{version}", "1")
        return version

    @staticmethod
    @torch.no_grad()
    def load(params: list[torch.Tensor], received: list[torch.Tensor]) -> None:
        """Copy a received version into ``params``."""
        for p, t in zip(params, received):
            p.copy_(t)

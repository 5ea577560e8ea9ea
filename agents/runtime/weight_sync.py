"""Versioned, named, bucketed weight sync from the learner to rollout workers over a torch.distributed group.

The learner is rank 0 of a group of its own (gloo on CPU, nccl on CUDA), apart from any data-parallel group; each
worker is a further rank (local workers: one group of ``1 + workers`` ranks; remote workers: one 2-rank group each,
so one lost worker breaks only its own). Both sides know the weights' manifest (name, shape, dtype, in order) and lay
them out alike in one byte stream (:func:`layout`). A sync broadcasts a header ``[version, bytes, bucket]`` and then
the stream in buckets of ``bucket`` bytes: the learner holds one bucket and one gathered tensor at a time (under FSDP2
every rank gathers a tensor's shards as its bucket is filled), never the whole model. A worker receives the stream
into a buffer of its own, checks every tensor for non-finite values, and answers in the group's store (``ok`` or why
it refused), so a sync that fails or times out names the workers that did not take it instead of hanging:
:class:`WeightSyncError`.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["WeightSync", "WeightSyncError", "STOP", "layout", "send", "DEFAULT_BUCKET"]

STOP = -1
"""The header version that tells the workers to stop."""

DEFAULT_BUCKET = 64 << 20
"""Bytes per bucket (``sync_bucket_mb``): the learner's extra memory during a sync is one bucket and one tensor."""

_ALIGN = 64


class WeightSyncError(RuntimeError):
    """A weight sync that failed, timed out or was refused; the message names the workers that did not take it.
    ``sync``: the group that failed; ``lost``: why its connection broke (``None``: a timeout or a refusal)."""

    sync: "WeightSync | None" = None
    lost: str | None = None


def layout(manifest: Sequence[Sequence]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a sync's stream, and the stream's length (offsets aligned to 64 bytes)."""
    offsets, pos = [], 0
    for _, shape, dtype in manifest:
        offsets.append(pos)
        n = _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        pos += -(-n // _ALIGN) * _ALIGN
    return offsets, pos


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def views(flat: torch.Tensor, manifest: Sequence[Sequence]) -> list[torch.Tensor]:
    """The tensors of a received stream ``flat`` (uint8), as views shaped by ``manifest``."""
    offsets, _ = layout(manifest)
    out = []
    for (_, shape, dtype), o in zip(manifest, offsets):
        dt = getattr(torch, dtype)
        n = _numel(shape) * torch.empty((), dtype=dt).element_size()
        out.append(flat[o:o + n].view(dt).view(*shape))
    return out


class WeightSync:
    """One side of a learner-to-workers weight group (see the module docstring).

    ``timeout`` is the learner's: how long a sync may wait for the slowest worker. Workers wait for the learner's
    next version without a limit of their own (an update or an evaluation can take minutes); a learner that dies
    closes the connection, which ends their wait at once. ``hostname``: the address gloo listens on for this side
    (empty: the host's name; remote groups pass the address the peer reaches).
    """

    def __init__(self, store: dist.Store, rank: int, workers: int, timeout: float, device: str, hostname: str = ""):
        self.store, self.rank, self.workers, self.timeout = store, rank, workers, float(timeout)
        self.device = torch.device(device)
        delta = datetime.timedelta(seconds=timeout)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = delta
            self.group = dist.ProcessGroupNCCL(store, rank, workers + 1, opts)
        elif hostname:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = delta
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            self.group = dist.ProcessGroupGloo(store, rank, workers + 1, opts)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, workers + 1, delta)
        self.names: dict[int, str] = {}  # rank -> the worker's name in errors
        self.gone: Callable[[], str | None] = lambda: None  # why a worker is known to be gone (ends a wait at once)

    @staticmethod
    def serve(workers: int, timeout: float, host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
        """The learner's store on ``host:port`` (0: a free port; ``store.port`` tells the workers where). Start the
        workers, then make rank 0 with ``WeightSync(store, 0, workers, timeout, device)``, which waits for them."""
        delta = datetime.timedelta(seconds=timeout)
        return dist.TCPStore(host, port, workers + 1, True, timeout=delta, wait_for_workers=False)

    WORKER_TIMEOUT = 7 * 24 * 3600.0
    """A worker's own limit: it waits for the learner's next version as long as an update or evaluation takes."""

    @staticmethod
    def connect(port: int, workers: int, host: str = "127.0.0.1", timeout: float | None = None) -> dist.TCPStore:
        """A worker's connection to the learner's store on ``host:port``; then ``WeightSync(store, rank, workers,
        WeightSync.WORKER_TIMEOUT)`` with ``rank`` in 1..workers."""
        delta = datetime.timedelta(seconds=timeout or WeightSync.WORKER_TIMEOUT)
        return dist.TCPStore(host, port, workers + 1, False, timeout=delta)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _broadcast(self, t: torch.Tensor):
        return self.group.broadcast([t], dist.BroadcastOptions())

    # ------------------------------------------------------------------ learner
    def publish(self, version: int, named: Iterable[tuple[str, torch.Tensor]] = (), manifest: list | None = None,
                bucket: int = DEFAULT_BUCKET) -> float:
        """Send ``named`` (``(name, tensor)`` in ``manifest`` order) as ``version`` to this group's workers (``STOP``:
        nothing, they stop); return the seconds it took. See :func:`send`."""
        return send([self], version, named, manifest or [], bucket)

    def _lagging(self, version: int, why: str) -> str:
        late = [r for r in range(1, self.workers + 1) if not self.store.check([f"ack/{r}/{version}"])]
        who = ", ".join(self.names.get(r, f"rollout worker {r - 1}") for r in late) or "no worker"
        return (f"weight sync of policy version {version} failed: {who} did not take it within {self.timeout:g} s "
                f"(sync_timeout) ({why})")

    def _answers(self, version: int) -> None:
        keys = [f"ack/{r}/{version}" for r in range(1, self.workers + 1)]
        deadline, pause = time.monotonic() + self.timeout, 0.001
        try:
            while not self.store.check(keys):  # polled: a worker known to be gone ends the wait at once
                if (why := self.gone()) is not None or time.monotonic() > deadline:
                    raise WeightSyncError(self._lagging(version, why or "no acknowledgement"))
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
        except (RuntimeError, dist.DistStoreError) as e:
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(self._lagging(version, f"the store failed: {e}")) from None
        for r, key in enumerate(keys, 1):
            answer = self.store.get(key).decode()
            if answer != "ok":
                who = self.names.get(r, f"rollout worker {r - 1}")
                raise WeightSyncError(f"{who} refused policy version {version}: {answer}")

    # ------------------------------------------------------------------ worker
    def receive(self, flat: Callable[[int], torch.Tensor]) -> tuple[int, torch.Tensor | None]:
        """Wait for the next version; receive its stream into ``flat(nbytes)`` (a uint8 buffer of that size); return
        ``(version, buffer)``, or ``(STOP, None)``. Then :meth:`answer` it."""
        header = torch.zeros(3, dtype=torch.int64, device=self._comm_device)
        self._broadcast(header).wait()
        version, total, bucket = (int(x) for x in header.tolist())
        if version == STOP:
            return STOP, None
        buf = flat(total)
        for start in range(0, total, bucket):
            self._broadcast(buf[start:start + bucket]).wait()
        return version, buf

    def answer(self, version: int, refusal: str | None = None) -> None:
        """Tell the learner this worker took ``version`` (or why it refused it)."""
        self.store.set(f"ack/{self.rank}/{version}", refusal or "ok")


def send(syncs: Sequence[WeightSync], version: int, named: Iterable[tuple[str, torch.Tensor]], manifest: list,
         bucket: int = DEFAULT_BUCKET) -> float:
    """Broadcast ``named`` as ``version`` over every group of ``syncs`` at once, bucket by bucket; return the seconds.

    ``named`` yields each tensor in ``manifest`` order, when it is needed (a sharded learner gathers it then); only
    one bucket and one tensor are held. Raises :class:`WeightSyncError` naming the workers that did not take it."""
    t0 = time.perf_counter()
    dev = syncs[0]._comm_device if syncs else torch.device("cpu")
    offsets, total = layout(manifest)
    current = {"sync": None}

    def broadcast(t: torch.Tensor) -> None:
        works = []
        for s in syncs:
            current["sync"] = s
            works.append(s._broadcast(t))
        for s, w in zip(syncs, works):
            current["sync"] = s
            w.wait()

    try:
        broadcast(torch.tensor([version, total, bucket], dtype=torch.int64, device=dev))
        if version != STOP:
            buf = torch.empty(min(bucket, total), dtype=torch.uint8, device=dev)
            sent = 0  # stream bytes before `sent` are sent; buf holds the bucket [sent, sent + bucket)

            def flush() -> int:
                n = min(bucket, total - sent)
                broadcast(buf[:n])
                return sent + n

            for (_, t), pos in zip(named, offsets):
                data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(dev)
                done = 0
                while done < data.numel():
                    if pos >= sent + bucket:  # this tensor starts in a later bucket
                        sent = flush()
                    elif pos == sent and data.numel() - done >= bucket:  # a whole bucket of one tensor: no copy
                        broadcast(data[done:done + bucket])
                        pos, done, sent = pos + bucket, done + bucket, sent + bucket
                    else:
                        n = min(data.numel() - done, sent + bucket - pos)
                        buf[pos - sent:pos - sent + n] = data[done:done + n]
                        pos, done = pos + n, done + n
                        if pos == sent + bucket:
                            sent = flush()
                del data
            while sent < total:
                sent = flush()
            for s in syncs:
                current["sync"] = s
                s._answers(version)
    except WeightSyncError as e:
        e.sync = current["sync"]
        raise
    except (RuntimeError, dist.DistBackendError) as e:
        s = current["sync"] or syncs[0]
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if "timed out" in why.lower():
            err = WeightSyncError(s._lagging(version, why))
        else:  # the connection broke: the worker is gone, not late
            who = ", ".join(s.names.get(r, f"rollout worker {r - 1}") for r in range(1, s.workers + 1))
            err = WeightSyncError(f"weight sync of policy version {version} failed: the connection to {who} broke ({why})")
            err.lost = why
        err.sync = s  # which group failed: a pool of remote workers may go on without it
        raise err from None
    return time.perf_counter() - t0

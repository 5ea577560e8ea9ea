"""Versioned, named, bucketed weight sync from the learner to rollout workers over a torch.distributed group.

The learner is rank 0 of a group of its own (gloo on CPU, nccl on CUDA), apart from any data-parallel group; each
worker is a further rank (local workers: one group of ``1 + workers`` ranks; remote workers: one 2-rank group each,
so one lost worker breaks only its own). Both sides know the weights' manifest (name, shape, dtype, in order) and lay
them out alike in one byte stream (:func:`layout`). A sync broadcasts a header ``[version, bytes, bucket]`` and then
the stream region by region (:func:`schedule`): runs of small tensors packed into one bucket, and each large tensor
sent from its own memory in pieces of at most ``bucket`` bytes. The learner holds one bucket and one gathered tensor
at a time (under FSDP2 every rank gathers a tensor's shards when its turn comes), never the whole model. A worker receives the stream
into a buffer of its own, checks every tensor for non-finite values, and answers in the group's store (``ok`` or why
it refused), so a sync that fails or times out names the workers that did not take it instead of hanging:
:class:`WeightSyncError`.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["WeightSync", "WeightSyncError", "STOP", "layout", "nbytes", "views", "send", "send_stop", "DEFAULT_BUCKET"]

STOP = -1
"""The header version that tells the workers to stop."""

DEFAULT_BUCKET = 16 << 20
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
    for n in nbytes(manifest):
        offsets.append(pos)
        pos += -(-n // _ALIGN) * _ALIGN
    return offsets, pos


def nbytes(manifest: Sequence[Sequence]) -> list[int]:
    """Each tensor's size in bytes."""
    return [_numel(shape) * getattr(torch, dtype).itemsize for _, shape, dtype in manifest]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def schedule(manifest: Sequence[Sequence], bucket: int) -> list[tuple[int, int]]:
    """The stream's regions ``(start, end)``, one broadcast each, in order: a tensor of at least ``bucket / 4`` bytes
    goes on its own, sent from its own memory in pieces of at most ``bucket``; runs of smaller ones go packed
    together, at most ``bucket`` bytes a run. Both sides compute it from the manifest."""
    offsets, total = layout(manifest)
    sizes = nbytes(manifest)
    out: list[tuple[int, int]] = []
    run = None  # the start of the run of small tensors being packed
    for i, (o, n) in enumerate(zip(offsets, sizes)):
        end = offsets[i + 1] if i + 1 < len(offsets) else total
        if n >= bucket // 4:
            if run is not None:
                out.append((run, o))
                run = None
            out.extend((a, min(a + bucket, o + n)) for a in range(o, o + n, bucket))
            continue
        if run is not None and end - run > bucket:
            out.append((run, o))
            run = None
        run = o if run is None else run
    if run is not None:
        out.append((run, total))
    return out


def views(flat: torch.Tensor, manifest: Sequence[Sequence], start: int | None = None) -> list[torch.Tensor]:
    """The tensors of a received stream ``flat`` (uint8), as views shaped by ``manifest`` (a slice of a whole
    manifest: ``start`` is its first tensor's offset)."""
    offsets, _ = layout(manifest)
    if start is not None:
        offsets = [o + start for o in offsets]
    return [flat[o:o + n].view(getattr(torch, dtype)).view(*shape)
            for (_, shape, dtype), o, n in zip(manifest, offsets, nbytes(manifest))]


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
    def comm_device(self) -> torch.device:
        """Where the group's broadcasts run: the sync's CUDA device, else the CPU (gloo); a worker's receive buffers
        live there."""
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

    def _broke(self, version: int, why: str, ranks: Sequence[int] = ()) -> WeightSyncError:
        """The error for workers that are gone (not late; ``ranks``, else every worker of the group): ``lost`` says
        why, so a pool may go on without them."""
        who = ", ".join(self.names.get(r, f"rollout worker {r - 1}") for r in ranks or range(1, self.workers + 1))
        err = WeightSyncError(f"weight sync of policy version {version} failed: the connection to {who} broke ({why})")
        err.lost = why
        return err

    def _answers(self, version: int) -> None:
        keys = [f"ack/{r}/{version}" for r in range(1, self.workers + 1)]
        start = time.monotonic()
        deadline = start + self.timeout
        try:
            while not self.store.check(keys):  # polled: a worker known to be gone ends the wait at once
                if (why := self.gone()) is not None:
                    raise self._broke(version, why, [r for r, k in enumerate(keys, 1) if not self.store.check([k])])
                now = time.monotonic()
                if now > deadline:
                    raise WeightSyncError(self._lagging(version, "no acknowledgement"))
                time.sleep(min(0.05, max(0.0002, (now - start) / 20)))  # an answer is seen at most 5% late
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
    def receive(self, flat: Callable[[int], torch.Tensor], manifest: Sequence[Sequence],
                arrived: Callable[[torch.Tensor, int], None] | None = None) -> tuple[int, torch.Tensor | None]:
        """Wait for the next version; receive its stream (laid out by ``manifest``) into ``flat(nbytes)`` (a uint8
        buffer of that size); return ``(version, buffer)``, or ``(STOP, None)``. Then :meth:`answer` it.
        ``arrived(buffer, n)`` is called while each region is in flight with the bytes before it (and at the end with
        all of them), so the worker can check the tensors that have arrived while the rest comes."""
        header = torch.zeros(3, dtype=torch.int64, device=self.comm_device)
        self._broadcast(header).wait()
        version, total, bucket = (int(x) for x in header.tolist())
        if version == STOP:
            return STOP, None
        if total != layout(manifest)[1]:
            raise WeightSyncError(f"the learner sends {total} bytes of weights, and this worker's manifest lays out "
                                  f"{layout(manifest)[1]}")
        buf = flat(total)
        for a, b in schedule(manifest, bucket):
            work = self._broadcast(buf[a:b])
            if arrived is not None:
                arrived(buf, a)
            work.wait()
        if arrived is not None:
            arrived(buf, total)
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
    dev = syncs[0].comm_device if syncs else torch.device("cpu")
    offsets, total = layout(manifest)
    current = {"sync": None}

    def broadcast(t: torch.Tensor) -> None:
        works = []
        for s in syncs:
            current["sync"] = s
            works.append(s._broadcast(t))
        for s, w in zip(syncs, works):
            current["sync"] = s
            _wait(w, s, version)

    try:
        broadcast(torch.tensor([version, total, bucket], dtype=torch.int64, device=dev))
        if version != STOP:
            regions = iter(schedule(manifest, bucket))
            buf = _bucket(syncs, min(bucket, total), dev)
            start, end = next(regions, (0, 0))
            for (_, t), o, n in zip(named, offsets, nbytes(manifest)):
                data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(dev)
                if n >= bucket // 4:  # on its own, from its own memory: no copy
                    for a in range(0, n, bucket):
                        broadcast(data[a:a + bucket])
                        start, end = next(regions, (0, 0))
                    continue
                buf[o - start:o - start + n] = data  # packed with its neighbours
                if o + -(-n // _ALIGN) * _ALIGN >= end:  # the run's last tensor
                    broadcast(buf[:end - start])
                    start, end = next(regions, (0, 0))
                del data
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
            err = s._broke(version, why)
        err.sync = s  # which group failed: a pool of remote workers may go on without it
        raise err from None
    return time.perf_counter() - t0


def _wait(work, sync: WeightSync, version: int) -> None:
    """Wait for a broadcast of ``sync``'s group without one blocking call: a worker known to be gone (``sync.gone``)
    ends the wait at once (a broadcast to a dead peer can otherwise wait out the whole sync timeout), and Ctrl-C is
    taken, each at most 50 ms late. The broadcast's completion wakes the wait at once (its future's callback), so
    a sync costs no polling latency. (An NCCL wait only orders the streams; it never blocks the learner's thread.)"""
    if sync.device.type != "cuda" and not work.is_completed():
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(0.05):
            if (why := sync.gone()) is not None:
                raise sync._broke(version, why)
    work.wait()


def send_stop(syncs: Sequence[WeightSync], limit: float = 5.0) -> bool:
    """Tell the workers of ``syncs`` to stop, waiting at most ``limit`` seconds; whether they all took it. The
    broadcast runs in a daemon thread that keeps the groups alive when it does not finish: a group destroyed with a
    broadcast in flight waits out its timeout first (a stopped or unreachable worker would hold up the exit)."""
    if not syncs:
        return True
    done = threading.Event()

    def stop() -> None:
        try:
            send(syncs, STOP, (), [])
            done.set()
        except Exception:  # noqa: BLE001 (a worker that did not take it: the caller goes on closing)
            pass

    t = threading.Thread(target=stop, name="weight-sync-stop", daemon=True)
    t.start()
    t.join(limit)
    return done.is_set()


def _bucket(syncs: Sequence[WeightSync], n: int, dev: torch.device) -> torch.Tensor:
    """The send buffer, kept on the first group between syncs (a fresh one costs its page faults every sync)."""
    held = getattr(syncs[0], "_bucket", None) if syncs else None
    if held is None or held.numel() != n or held.device != dev:
        held = torch.empty(n, dtype=torch.uint8, device=dev)
        if syncs:
            syncs[0]._bucket = held
    return held

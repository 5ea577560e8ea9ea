"""Where an on-policy agent's rollouts come from: the agent asks its source for rollout ``j`` and tells it each new
policy version; it does not know which source it has.

* :class:`InProcess`: the agent's own sampler (the policy, or an in-process engine), synchronous training.
* :class:`WorkerPool` (shared by :class:`~tokengym.agents.engine.workers.RolloutWorkers`, local worker processes, and
  :class:`~tokengym.agents.engine.remote.RemoteWorkers`, ``tokengym worker`` servers anywhere): rollouts sampled by
  older versions while the learner updates (async modes), with the version schedule, the staleness check, the
  weight publication and the checkpointed queue.
* :class:`DataParallelSource`: a torchrun learner's view of a pool that rank 0 holds; every rank gets its share of
  each global rollout, and every rank takes part in gathering its weight shards for a sync.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Protocol

import torch

from tokengym.agents.engine.messages import MessageError, check_rollout, decode_rollout
from tokengym.agents.engine.rollout import Rollout, collect
from tokengym.agents.runtime.weight_sync import WeightSyncError

__all__ = ["RolloutSource", "InProcess", "WorkerPool", "WorkerError", "DataParallelSource", "full_named",
           "make_source", "check_source"]


class WorkerError(RuntimeError):
    """A rollout worker died, failed, was lost or refused; the message names it."""


class RolloutSource(Protocol):
    """What :class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent` needs from a rollout source."""

    def take(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Rollout ``step`` (the ``step``-th the learner trains on) and its metrics."""

    def publish(self, version: int, wait: bool = True) -> None:
        """The policy's weights after ``version`` updates (``wait=False``: may finish during the next update)."""

    def settle(self) -> None:
        """Wait for a publication started with ``wait=False`` (before the weights change again)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps to continue this source exactly."""

    def close(self) -> None:
        """Release processes, engines and connections (idempotent)."""


class InProcess:
    """Rollouts of the current policy, sampled in the learner's process by ``sampler(env)`` when asked."""

    def __init__(self, env: Any, sampler: Callable[[Any], Any], seed: int | None):
        self.env, self.sampler, self.seed = env, sampler, seed

    def take(self, step: int) -> tuple[Rollout, dict[str, float]]:
        seed, self.seed = self.seed if step == 0 else None, None
        return collect(self.env, self.sampler(self.env), seed=seed), {}

    def publish(self, version: int, wait: bool = True) -> None:
        pass

    def settle(self) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def close(self) -> None:
        pass


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
        self.streams: list[Any] = [_stream_from_state(s) for s in state["streams"]]  # each slot's stream after its
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
        """Stop the workers (or end their sessions) and release what the pool holds."""
        raise NotImplementedError

    def close(self) -> None:
        """Let a sync in flight end, then :meth:`_shutdown`; idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.settle()
        self._shutdown()

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
            self._check_alive()
            raise WorkerError(str(failed)) from None

    def _check_alive(self) -> None:
        """Raise a :class:`WorkerError` naming a worker known to be gone."""

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
        return {"next": self.next, "queue": queue, "streams": [_stream_state(s) for s in streams]}


def _as_bytes(data: Any) -> bytes:
    """A checkpoint's rollout message (a uint8 tensor) as bytes."""
    if isinstance(data, dict):
        raise ValueError("the checkpoint's async queue was written by an older tokengym (pickled rollouts); resume it "
                         "with async_mode='off' once, or with that version")
    return data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)


def _stream_state(stream: dict[str, Any] | None) -> dict[str, Any] | None:
    """A worker's stream as a checkpoint (and a JSON message) holds it: the env's state, the generator's bytes."""
    return None if stream is None else {"env": stream["env"], "rng": [int(b) for b in stream["rng"].tolist()]}


def _stream_from_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    if state is None:
        return None
    rng = state["rng"]
    return {"env": state["env"], "rng": rng if isinstance(rng, torch.Tensor) else torch.tensor(rng, dtype=torch.uint8)}


# ---------------------------------------------------------------------------------------------- torchrun learners
class DataParallelSource:
    """A data-parallel (torchrun) learner's rollout source over a pool that rank 0 holds (``pool``; None on the
    other ranks). Each global rollout goes from rank 0 to every rank as one typed message over the learner's group,
    and each rank keeps the rows a synchronous data-parallel rank would have sampled (``rows`` per rank, contiguous).
    A sync gathers the weights tensor by tensor on every rank (FSDP2 shards) as rank 0 fills each bucket."""

    def __init__(self, pool: WorkerPool | None, dp: Any, rows: int, device: Any, named: Callable[[], Any]):
        self.pool, self.dp, self.rows, self.device, self.named = pool, dp, rows, torch.device(device), named

    def take(self, step: int) -> tuple[Rollout, dict[str, float]]:
        import torch.distributed as dist

        from tokengym.agents.runtime.distributed import comm_device

        failure, ro, data, metrics = None, None, b"", {}
        if self.pool is not None:
            try:
                ro, metrics = self.pool.take(step)
                data = self.pool.taken  # the worker's message as it came: no second encoding
            except Exception as e:
                failure = e
        word, metrics = self.dp.broadcast_object((str(failure) if failure is not None else None, metrics))
        if word is not None:
            if failure is not None:
                raise failure
            raise WorkerError(word)
        dev = comm_device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        dist.broadcast(size, 0)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if data else \
            torch.empty(int(size), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, 0)
        if ro is None:  # (rank 0 has it decoded already)
            ro, _, _ = decode_rollout(buf.cpu().numpy().tobytes(), self.device)
        r = self.dp.rank
        return ro.select(range(r * self.rows, (r + 1) * self.rows)), metrics

    def publish(self, version: int, wait: bool = True) -> None:
        """Every rank runs it: the gathers are collectives. A failure on rank 0 is raised on every rank."""
        failure, tensors = None, self.named()  # one pass over the weights on every rank, in the same order
        if self.pool is not None:
            self.pool.named = lambda: tensors
            try:
                self.pool.publish(version, wait=True)
            except Exception as e:
                failure = e
        for _ in tensors:  # what rank 0 did not send (it failed), and the other ranks' part in every gather
            pass
        word = self.dp.broadcast_object(str(failure) if failure is not None else None)
        if failure is not None:
            raise failure
        if word is not None:
            raise WorkerError(word)

    def settle(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any] | None:
        """Rank 0's (it alone writes checkpoints); None on the other ranks."""
        return self.pool.state_dict() if self.pool is not None else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None else []


def full_named(model: torch.nn.Module):
    """``(name, tensor)`` of ``model``'s parameters, each whole when it is asked for (an FSDP2 shard is gathered
    then, a collective every rank runs in the same order); what a weight sync sends."""
    for name, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        yield name, (full() if full is not None else p)


# ---------------------------------------------------------------------------------------------- choosing one
def check_source(cfg: Any, env: Any, policy: Any, dp: Any) -> None:
    """``ValueError`` (one line) when the source ``cfg`` asks for cannot serve ``env``, before anything starts:
    remote workers that do not answer or refuse the secret, an env they cannot rebuild; local workers that the env
    cannot reach (pickling) or the machine cannot hold."""
    if cfg.async_mode == "off" or not dp.is_main:
        return
    if cfg.remote_workers:
        from tokengym.agents.engine.remote import check_workers_reachable, read_secret, worker_env_spec

        worker_env_spec(env, env.num_envs * dp.world_size)
        check_workers_reachable(cfg.worker_addresses, read_secret(cfg.worker_secret_file or None))
        return
    from tokengym.agents.engine.workers import check_crosses, check_workers

    if not dp.distributed:  # (a data-parallel learner's workers get an env rebuilt from its record)
        check_crosses(env)
    check_workers(policy, env, cfg.rollout_workers, cfg.worker_threads)


def make_source(cfg: Any, env: Any, policy: Any, *, dp: Any, version: int, total: int, state: dict[str, Any] | None,
                sampler: Callable[[Any], Any]) -> RolloutSource:
    """The rollout source of an :class:`~tokengym.agents.algorithms.onpolicy_config.OnPolicyConfig`: ``sampler(env)``
    in process (``async_mode="off"``), else local worker processes or remote ``tokengym worker`` servers sampling the
    global batch, from the checkpointed ``state``, published ``version`` at once; under torchrun rank 0 holds them
    (:class:`DataParallelSource`). ``total``: the run's rollouts (a staleness bound beyond it is capped there)."""
    if cfg.async_mode == "off":
        return InProcess(env, sampler, cfg.seed if version == 0 else None)
    pool, failure = None, None
    if dp.is_main:
        try:
            pool = _worker_pool(cfg, env, policy, dp, version, total, state, publish=not dp.distributed)
        except (WorkerError, ValueError) as e:
            failure = e
    if not dp.distributed:
        if failure is not None:
            raise failure
        return pool
    word = dp.broadcast_object(str(failure) if failure is not None else None)  # every rank stops alike
    if word is not None:
        if failure is not None:
            raise failure
        raise WorkerError(word)
    source = DataParallelSource(pool, dp, env.num_envs, env.device, lambda: full_named(policy.model))
    try:
        source.publish(version)
    except BaseException:
        source.close()
        raise
    return source


def _worker_pool(cfg: Any, env: Any, policy: Any, dp: Any, version: int, total: int, state: Any, publish: bool):
    from tokengym.agents.engine.remote import RemoteWorkers, build_env, read_secret, worker_env_spec
    from tokengym.agents.engine.workers import RolloutWorkers

    rows = env.num_envs * dp.world_size
    common = dict(max_staleness=min(cfg.max_staleness, total), exact=cfg.async_mode == "one-step" or cfg.max_staleness == 0,
                  version=version, state=state, seed=cfg.seed, bf16=cfg.bf16, timeout=cfg.sync_timeout,
                  sampler=cfg.sampler, total=total, rollout_timeout=cfg.rollout_timeout,
                  bucket=int(cfg.sync_bucket_mb * 2**20), publish=publish)
    if cfg.remote_workers:
        return RemoteWorkers(cfg.worker_addresses, read_secret(cfg.worker_secret_file or None), env, policy, rows=rows,
                             min_workers=cfg.min_workers, sync_host=cfg.sync_host, sync_port=cfg.sync_port,
                             sync_dir=cfg.sync_dir, **common)
    if dp.distributed:  # the workers sample the global batch: an env of every row, rebuilt from the env's record
        env = build_env(worker_env_spec(env, rows), policy.tokenizer)
    return RolloutWorkers(env, policy, workers=cfg.rollout_workers, threads=cfg.worker_threads, rebuild=dp.distributed,
                          **common)

"""Where an on-policy agent's rollouts come from: the agent asks its source for rollout ``j`` and tells it each new
policy version; it does not know which source it has.

* :class:`InProcess`: the agent's own rollout backend (the policy, or an in-process engine), synchronous training.
* :class:`~tokengym.agents.engine.worker_pool.WorkerPool` (re-exported here; shared by
  :class:`~tokengym.agents.engine.workers.RolloutWorkers`, local worker processes, and
  :class:`~tokengym.agents.engine.remote.RemoteWorkers`, ``tokengym worker`` servers anywhere): rollouts sampled by
  older versions while the learner updates (async modes), with the version schedule, the staleness check, the
  weight publication and the checkpointed queue.
* :class:`DataParallelSource`: a torchrun learner's view of a pool that rank 0 holds; every rank gets its share of
  each global rollout, and every rank takes part in gathering its weight shards for a sync.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from tokengym.agents.engine.config import EngineConfig
from tokengym.agents.engine.messages import decode_rollout
from tokengym.agents.engine.rollout import Rollout, collect
from tokengym.agents.engine.worker_pool import WorkerError, WorkerPool, full_named


__all__ = ["RolloutSource", "InProcess", "WorkerPool", "WorkerError", "DataParallelSource", "full_named",
           "make_source", "check_source", "client_tls", "check_unused", "REMOTE_ONLY", "ASYNC_ONLY"]


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

    def close(self, interrupted: bool = False) -> None:
        """Release processes, engines and connections (idempotent); ``interrupted`` (Ctrl-C): without waiting for
        a weight sync in flight."""


class InProcess:
    """Rollouts of the current policy, sampled in the learner's process by the rollout backend ``backend(env)``
    returns, when asked."""

    def __init__(self, env: Any, backend: Callable[[Any], Any], seed: int | None):
        self.env, self.backend, self.seed = env, backend, seed

    def take(self, step: int) -> tuple[Rollout, dict[str, float]]:
        seed, self.seed = self.seed if step == 0 else None, None
        return collect(self.env, self.backend(self.env), seed=seed), {}

    def publish(self, version: int, wait: bool = True) -> None:
        pass

    def settle(self) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def close(self, interrupted: bool = False) -> None:
        pass


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

    def close(self, interrupted: bool = False) -> None:
        if self.pool is not None:
            self.pool.close(interrupted)

    def pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None else []


# ---------------------------------------------------------------------------------------------- choosing one
def client_tls(cfg: EngineConfig) -> Any:
    """The learner's TLS to its remote workers (``worker_ca``/``worker_fingerprint``), or None: plain HTTP."""
    if not (cfg.worker_ca or cfg.worker_fingerprint):
        return None
    from tokengym.agents.engine.tls import ClientTLS

    return ClientTLS(cfg.worker_ca, cfg.worker_fingerprint)


def check_source(cfg: EngineConfig, env: Any, policy: Any, dp: Any) -> None:
    """``ValueError`` (one line) when the source the engine settings ``cfg`` ask for cannot serve ``env``, before
    anything starts: workers without an async mode, remote workers that do not answer or refuse the secret, an env
    they cannot rebuild, a sync folder or host that cannot serve; local workers that the env cannot reach (pickling)
    or the machine cannot hold."""
    if cfg.async_mode == "off" and (cfg.remote_workers or cfg.rollout_workers != 1):
        given = f"remote_workers={cfg.remote_workers!r}" if cfg.remote_workers else f"rollout_workers={cfg.rollout_workers}"
        raise ValueError(f"{given} (--rollout-workers) samples in worker processes while the learner updates, which "
                         "needs an async mode: add --async-mode one-step (or bounded); async_mode='off' samples in the "
                         "learner's own process")
    check_unused(cfg)
    if cfg.async_mode == "off" or not dp.is_main:
        return
    if cfg.remote_workers:
        from tokengym.agents.engine.remote import (check_sync_dir, check_sync_host, check_workers_reachable,
                                                   model_name, read_secret, worker_env_spec)

        if cfg.sync_dir:
            check_sync_dir(cfg.sync_dir)
        if cfg.sync_host:
            check_sync_host(cfg.sync_host)
        spec = worker_env_spec(env, env.num_envs * dp.world_size)
        check_workers_reachable(cfg.worker_addresses, read_secret(cfg.worker_secret_file or None), spec,
                                model_name(policy), client_tls(cfg))
        return
    from tokengym.agents.engine.workers import check_crosses, check_workers

    if not dp.distributed:  # (a data-parallel learner's workers get an env rebuilt from its record)
        check_crosses(env)
    check_workers(policy, env, cfg.rollout_workers, cfg.worker_threads)


REMOTE_ONLY = ("min_workers", "worker_secret_file", "sync_host", "sync_port", "sync_dir", "worker_ca",
               "worker_fingerprint")
"""Settings only remote workers read (``--rollout-workers host:port,...``)."""
ASYNC_ONLY = ("sync_timeout", "sync_bucket_mb", "rollout_timeout", "worker_threads", "max_staleness")
"""Settings only rollout workers (an async mode) read."""


def check_unused(cfg: EngineConfig) -> None:
    """``ValueError`` (one line naming the flag) for a setting the run would ignore: one of :data:`REMOTE_ONLY`
    without remote workers, or of :data:`ASYNC_ONLY` without an async mode. A value equal to the default (as a
    resumed run's ``config.json`` holds) is no setting."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(cfg)}
    for names, given, needs in ((REMOTE_ONLY, bool(cfg.remote_workers), "remote workers: --rollout-workers "
                                 "host:port,... of `tokengym worker` servers (and an async mode)"),
                                (ASYNC_ONLY, cfg.async_mode != "off", "rollout workers, which need an async mode: add "
                                 "--async-mode one-step (or bounded)")):
        bad = next((k for k in names if getattr(cfg, k) != defaults[k]), None)
        if bad is not None and not given:
            raise ValueError(f"{bad}={getattr(cfg, bad)!r} (--{bad.replace('_', '-')}) is only read by {needs}; this "
                             f"run has none, so it would be ignored: drop it or add them")


def make_source(cfg: EngineConfig, env: Any, policy: Any, *, dp: Any, version: int, total: int,
                state: dict[str, Any] | None, backend: Callable[[Any], Any]) -> RolloutSource:
    """The rollout source of the engine settings ``cfg`` (an on-policy agent's config extends them): ``backend(env)``
    in process (``async_mode="off"``), else local worker processes or remote ``tokengym worker`` servers sampling the
    global batch, from the checkpointed ``state``, published ``version`` at once; under torchrun rank 0 holds them
    (:class:`DataParallelSource`). ``total``: the run's rollouts (a staleness bound beyond it is capped there)."""
    if cfg.async_mode == "off":
        return InProcess(env, backend, cfg.seed if version == 0 else None)
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
                             sync_dir=cfg.sync_dir, tls=client_tls(cfg), **common)
    if dp.distributed:  # the workers sample the global batch: an env of every row, rebuilt from the env's record
        env = build_env(worker_env_spec(env, rows), policy.tokenizer)
    return RolloutWorkers(env, policy, workers=cfg.rollout_workers, threads=cfg.worker_threads, rebuild=dp.distributed,
                          **common)

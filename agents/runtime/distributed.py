"""Data-parallel training on ``torch.distributed``: one process per device, launched with ``torchrun``.

``torchrun --nproc_per_node=K -m tokengym.agents.cli train grpo|ppo|dpo|sft ...`` runs K processes (ranks).
The global batch stays what the config says; each rank owns a slice of it, and a K-process run takes
the same optimiser steps as a 1-process one with the same global batch (up to float rounding):

* **Rollouts.** Every rank's env is seeded alike and draws the *global* batch of prompts, keeping its own
  ``1/K`` of the groups (:class:`ShardedTask`; whole GRPO groups stay on one rank). Each episode samples from
  the per-row stream of :func:`~tokengym.agents.engine.policy.row_uniforms`, keyed by the rollout's key (drawn from the
  policy's generator, which every rank holds alike) and the row's index in the *global* batch
  (``policy.row_offset``), so rank r samples exactly what rows r of a 1-process rollout would, and drops its
  finished rows from its cache as a 1-process rollout does.
* **Statistics.** After the rollout every rank gathers the global batch (:meth:`DataParallel.gather`:
  a few ``[N, P + M]`` tensors, with PPO's critic values and reference log-probs, each computed by the
  rank that owns the rows), so advantages (``scale_rewards="batch"``, PPO's GAE and whitening), PPO's
  adaptive KL controller (it measures the global batch's KL, so beta stays the same on every rank) and
  the logged rollout metrics are those of the global batch, not of a shard.
* **Updates.** Each minibatch of the global batch (same shuffle on every rank) is split into K
  contiguous shares (:meth:`DataParallel.shard`); a rank's loss is weighted by its share of the
  minibatch's loss denominator (rows, or tokens for ``token-mean``; PPO's value loss, a token mean,
  by its share of the tokens), gradients are summed with one flat all-reduce before clipping
  (:meth:`DataParallel.sync_gradients`; PPO's policy and critic gradients go in the same buffer), so
  clipping and AdamW see the global gradient and every rank takes the same step (for PPO: both
  optimisers). Logged training metrics are share-weighted sums over ranks, i.e. global means (PPO's
  explained variance from the summed moments of the minibatch's returns and residuals).
* **Runs.** Rank 0 alone writes logs, checkpoints and the config; every rank loads the checkpoint on
  resume; each rank's global RNGs start from a per-rank seed (:func:`seed_rank`) and are saved per rank.

Why not ``DistributedDataParallel``: the policy calls its ``transformers`` model directly and the loss
weights differ per rank; one all-reduce after ``backward`` is the same arithmetic. DDP's overlap of
communication with the backward pass (buckets) would be the next step for large models. Sharding the model
itself is ``prepare(..., sharding="fsdp2")``: :mod:`~tokengym.agents.runtime.sharding`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import signal
import sys
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

import torch.distributed as dist

from tokengym.envs.masks import TokenMasks

__all__ = ["DataParallel", "LOCAL", "init", "shutdown", "prepare", "ShardedTask", "seed_rank",
           "aggregation_weights", "die_with_parent", "exit_process"]


@dataclass(frozen=True)
class DataParallel:
    """Where this process stands in a data-parallel run, and the collectives the agents need.

    ``LOCAL`` (``distributed=False``) is a plain single-process run: every method is the identity, so
    agents call them unconditionally at no cost. ``distributed=True`` with ``world_size=1`` (a
    1-process ``torchrun``) needs no communication but uses the shared-stream sampling, so it is the
    reference a K-process run reproduces.
    """

    rank: int = 0
    """This process's rank in [0, world_size)."""
    world_size: int = 1
    """Number of processes (K)."""
    distributed: bool = False
    """Launched under torch.distributed (shared prompt and sampling streams); False = a plain run."""
    sharding: str = "none"
    """``fsdp2``: the modules are sharded (:mod:`~tokengym.agents.runtime.sharding`), FSDP2 reduces the gradients."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes logs, checkpoints and the config."""
        return self.rank == 0

    @property
    def _comm(self) -> bool:
        return self.distributed and self.world_size > 1

    @classmethod
    def current(cls) -> "DataParallel":
        """The running process group's rank and size, or :data:`LOCAL` when none is initialised (or the one there is
        belongs to an in-process inference engine: :func:`engine_owns_default_group`)."""
        if dist.is_available() and dist.is_initialized() and not default_group_is_engine():
            return cls(dist.get_rank(), dist.get_world_size(), True)
        return LOCAL

    # ------------------------------------------------------------------ data
    def shard(self, idx: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """This rank's contiguous share of a global minibatch ``idx`` and the share's loss weight.

        The weight is ``weights[share].sum() / weights[idx].sum()`` (``weights[i]``: row i's part of the
        loss's denominator, default 1 per row), so the ranks' weighted losses add up to the global one.

        Raises:
            ValueError: when the minibatch has fewer rows than there are ranks.
        """
        if not self.distributed:
            return idx, 1.0
        if len(idx) < self.world_size:
            raise ValueError(f"a minibatch of {len(idx)} rows cannot be split over {self.world_size} processes: "
                             "use a larger batch or fewer minibatches (each needs at least one row per process)")
        share = idx.tensor_split(self.world_size)[self.rank]
        if weights is None:
            return share, len(share) / len(idx)
        w = weights.to(torch.float64)
        total = float(w[idx.to(w.device)].sum())
        return share, float(w[share.to(w.device)].sum()) / total if total > 0 else 0.0

    def gather(self, *items: Any) -> Any:
        """Every rank's shard concatenated along dim 0 (rank order), for tensors, Rollouts (tensor and list
        fields) and None; returns the items unchanged in a plain run."""
        if not self._comm:
            return items if len(items) != 1 else items[0]
        out = tuple(self._gather_one(x) for x in items)
        return out if len(out) != 1 else out[0]

    def _gather_one(self, x: Any) -> Any:
        if x is None:
            return None
        if isinstance(x, torch.Tensor):
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous())
            return torch.cat(parts)
        if isinstance(x, list):
            return [v for part in self.all_gather_object(x) for v in part]
        if dataclasses.is_dataclass(x):  # a Rollout: its tensors, lists and dicts of [N] tensors
            out = {f.name: self._gather_one(getattr(x, f.name)) for f in dataclasses.fields(x)
                   if isinstance(getattr(x, f.name), (torch.Tensor, list))}
            for f in dataclasses.fields(x):
                d = getattr(x, f.name)
                if isinstance(d, TokenMasks):  # every rank's (the same env masks on each), their sets offset
                    out[f.name] = TokenMasks.cat(self.all_gather_object(d))
                if isinstance(d, dict):  # a name some rank lacks counts 0 on that rank's rows
                    names = sorted({k for part in self.all_gather_object(sorted(d)) for k in part})
                    zero = x.tokens.new_zeros(x.tokens.shape[0], dtype=torch.float32)
                    out[f.name] = {k: self._gather_one(d.get(k, zero)) for k in names}
            return dataclasses.replace(x, **out)
        raise TypeError(f"cannot gather {type(x).__name__}")

    # ------------------------------------------------------------------ gradients and statistics
    def sync_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients over ranks in place (each rank's loss is already weighted by its share). Sharded
        modules' gradients are summed by FSDP2's reduce-scatter in backward already."""
        if not self._comm or self.sharding != "none":
            return
        grads = [p.grad for p in params if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):  # one flat buffer per dtype
            group = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group])
            dist.all_reduce(flat)
            for g, v in zip(group, flat.split([g.numel() for g in group])):
                g.copy_(v.view_as(g))

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum each number over ranks (every rank passes the same keys)."""
        if not self._comm:
            return values
        t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=comm_device())
        dist.all_reduce(t)
        return dict(zip(values, t.tolist()))

    def weighted(self, stats: dict[str, Any], weight: float) -> dict[str, Any]:
        """Global statistics of a minibatch from each rank's statistics of its share: ``sum over ranks of
        weight * stat`` (the global mean, with :meth:`shard`'s weights), the maximum for ``*_max`` keys."""
        if not self.distributed:
            return stats
        out = self.sum({k: float(v) * weight for k, v in stats.items() if not k.endswith("_max")})
        maxima = {k: float(v) for k, v in stats.items() if k.endswith("_max")}
        if maxima and self._comm:
            t = torch.tensor(list(maxima.values()), dtype=torch.float64, device=comm_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            maxima = dict(zip(maxima, t.tolist()))
        return {k: out[k] if k in out else maxima[k] for k in stats}

    def all_same(self, modules: dict[str, torch.nn.Module]) -> str | None:
        """None when every rank holds bit-identical weights, else the name of the first tensor that differs
        (sharded modules: None, each rank holds its own shard)."""
        if not self._comm or self.sharding != "none":
            return None
        for name, module in modules.items():
            tensors = module.state_dict()
            mine = torch.cat([t.detach().reshape(-1).float() for t in tensors.values()])
            ref = mine.clone()
            dist.broadcast(ref, 0)  # rank 0's weights
            bad = torch.stack([(m != r).any() for m, r in zip(mine.split([t.numel() for t in tensors.values()]),
                                                                ref.split([t.numel() for t in tensors.values()]))]).float()
            dist.all_reduce(bad)  # which tensors differ on some rank
            if bool(bad.any()):
                return f"{name}.{list(tensors)[int(bad.nonzero()[0, 0])]}"
        return None

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers to every rank."""
        if not self._comm:
            return
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, 0)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's value of ``obj`` on every rank."""
        if not self._comm:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, 0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self._comm:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self._comm:
            dist.barrier()


LOCAL = DataParallel()
"""A plain single-process run."""


def comm_device() -> torch.device:
    """Where small host values go for a collective: the current GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def aggregation_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Row i's part of the loss denominator of :func:`~tokengym.agents.functional.masked_aggregate`: its
    valid tokens (``token-mean``), 1 if it has any (``seq-mean-token-mean``), or 1 (``seq-mean-token-sum``)."""
    n_tok = (mask != 0).sum(1)
    if aggregation == "token-mean":
        return n_tok
    if aggregation == "seq-mean-token-mean":
        return (n_tok > 0).long()
    if aggregation == "seq-mean-token-sum":
        return torch.ones_like(n_tok)
    raise ValueError(f"unknown aggregation {aggregation!r}")


# ---------------------------------------------------------------------------------------------- process group
_OWNED = False  # whether init() created the process group (then shutdown() destroys it)
_LAUNCHED = False  # whether this process joined a torchrun launch in init() (then exit_process() ends it hard)


class RankTimeout(RuntimeError):
    """A collective waited longer than the run's ``dist_timeout`` for another rank; the message says so."""


def is_timeout(e: BaseException) -> bool:
    """Whether ``e`` is a collective that timed out waiting for a peer (gloo and nccl word it differently)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and "timed out" in text and any(w in text for w in ("gloo", "nccl", "waiting"))


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op).

    For processes whose parent is their only supervisor: a rollout worker (its learner) and a rank under ``torchrun``
    (the agent starts each rank in a session of its own, so a SIGKILLed torchrun would leave its ranks training).
    SIGKILL also ends a stopped process. A parent that dies while the signal is being set up ends it at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died in between: re-parented, no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def init(device: str = "cpu", timeout: float | None = None) -> tuple[DataParallel, str]:
    """Join the ``torchrun`` process group when ``WORLD_SIZE`` is set; return ``(dp, device)``.

    The backend is nccl for a CUDA device and gloo otherwise; ``device="cuda"`` becomes
    ``cuda:<LOCAL_RANK>``. Without ``WORLD_SIZE`` (a plain run) returns ``(LOCAL, device)``. A rank that
    ``torchrun`` started (``TORCHELASTIC_RUN_ID`` set) dies with it (:func:`die_with_parent`).
    """
    global _OWNED, _LAUNCHED
    if "WORLD_SIZE" not in os.environ:
        return DataParallel.current(), device
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
        _LAUNCHED = True
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if not dist.is_initialized():
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(device))
        kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}  # a collective's wait for a peer
        dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
        _OWNED = True
    return DataParallel.current(), device


def shutdown(done: bool = False) -> None:
    """Destroy the process group if :func:`init` created it. ``done`` (every rank finished the run): first wait for
    all of them, so that no rank leaves (and has torchrun stop the others) while rank 0 still writes the model."""
    global _OWNED
    if _OWNED and dist.is_initialized():
        if done:
            dist.barrier()
        dist.destroy_process_group()
    _OWNED = False


def exit_process(code: int) -> None:
    """End the ``python -m tokengym.agents.cli`` process with ``code``: ``sys.exit`` in a plain run or on an error; in
    a rank that joined a ``torchrun`` launch and finished (code 0), the Python exit handlers (trackers, child
    processes), then ``os._exit`` with flushed stdout and stderr.

    Why: what a rank leaves to interpreter teardown are the C++ objects of its process group and FSDP2 mesh, whose
    destructors run at exit in no set order; one that still owns a joinable ``std::thread`` (gloo's) calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT, and torchrun reports a finished run
    as failed. Everything a run writes is durable before this point (checkpoints and the model are fsynced, the
    logger is closed), so nothing is lost by skipping that teardown."""
    if not _LAUNCHED or code != 0:  # (an error may leave files to the teardown; its exit is a failure anyway)
        sys.exit(code)
    import atexit

    try:
        atexit._run_exitfuncs()  # (what a normal exit runs first; _exit skips it)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


_ENGINE_GROUP: list[Any] = []  # the default process group an in-process inference engine made for itself


def engine_owns_default_group() -> None:
    """Record that the default process group was made by an in-process inference engine (vLLM makes a 1-process one
    for its worker), so that this process still counts as a plain run, not a data-parallel rank."""
    _ENGINE_GROUP[:] = [dist.group.WORLD]


def default_group_is_engine() -> bool:
    """Whether the default process group is the one an in-process inference engine made (see above)."""
    return bool(_ENGINE_GROUP) and _ENGINE_GROUP[0] is dist.group.WORLD


def seed_rank(seed: int, dp: DataParallel) -> None:
    """Seed Python, numpy and torch's global generators from ``(seed, rank)``: different per rank, reproducible.

    (What must be identical on every rank, prompts and sampling, uses the agents' own shared-seed generators.)
    """
    s = int(np.random.SeedSequence([seed, dp.rank]).generate_state(1)[0])
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


# ---------------------------------------------------------------------------------------------- shared streams
class ShardedTask:
    """A task whose ``batch(rng, n)`` draws the global batch of ``n * world_size`` prompts and keeps rows
    ``rank * n .. (rank + 1) * n``; everything else is the wrapped task's."""

    def __init__(self, task: Any, rank: int, world_size: int):
        self.task, self.rank, self.world_size = task, rank, world_size

    def batch(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        rows = self.task.batch(rng, n * self.world_size)
        return rows[self.rank * n:(self.rank + 1) * n]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)


def prepare(agent: Any, env: Any = None, dp: DataParallel | None = None, sharding: str = "none",
            bf16: bool = False) -> DataParallel:
    """Make ``agent`` (and its rollout ``env``) data-parallel under the current process group.

    Sets ``agent.dp``, copies rank 0's weights of ``agent.checkpoint_modules()`` to every rank, and for
    an env shards its prompt stream (:class:`ShardedTask`) and numbers the policy's rows globally (``row_offset``).
    ``sharding="fsdp2"`` then shards those modules and points the agent's optimiser step at the shards
    (:func:`~tokengym.agents.runtime.sharding.shard`; ``bf16``: FSDP2's bfloat16 mixed precision).
    A plain run (no process group) is left as it is.
    """
    dp = dp or DataParallel.current()
    if not dp.distributed:
        return dp
    dp = dataclasses.replace(dp, sharding=sharding)
    agent.dp = dp
    modules = agent.checkpoint_modules()
    for module in modules.values():
        dp.broadcast_module(module)
    if sharding == "fsdp2":
        from tokengym.agents.runtime.sharding import shard

        shard(modules, [agent.optim], device=agent.policy.device, bf16=bf16)
    if env is not None:
        env.task = ShardedTask(env.task, dp.rank, dp.world_size)
        agent.policy.row_offset = dp.rank * env.num_envs  # this rank's rows in the global batch
    return dp

"""Sharded training with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): ``--sharding fsdp2``.

Each module a run trains or keeps (policy, PPO's critic, the frozen reference) is wrapped per transformer block
and at its root, so every rank holds ``1/K`` of each parameter, gradient and AdamW moment as a DTensor shard.
What tokengym adds around ``fully_shard`` (no sharding of its own):

* **Gradients are summed, not averaged** (``set_gradient_divide_factor(1)`` with sum-only collectives, which
  gloo supports): each rank's loss is already weighted by its share of the global minibatch, as under
  replicated data parallel, so the reduce-scatter leaves each rank the global gradient's shard.
* **Optimisers** were built on the unsharded parameters; :func:`shard` points them (and their state, on resume)
  at the sharded ones. Clipping then measures the sharded total norm (``clip_grad_norm_`` on DTensors).
* **Rollouts** run on full weights: :func:`full_weights` all-gathers every block once for the whole rollout (the
  fast decoder reads them as plain tensors), then frees them. Peak memory during a rollout is therefore one full
  copy of the policy's parameters, as under replicated data parallel; the update holds ``1/K`` of them plus one
  block gathered at a time.
* **Checkpoints** are gathered: :func:`full_state` turns every DTensor of a state into the full tensor (each
  rank takes part), rank 0 writes the same checkpoint format as an unsharded run, and every rank loads it before
  sharding. So a run saved with K ranks resumes with any number of ranks, sharded or not, and keeps every
  promise of :mod:`~tokengym.agents.runtime.runs` (atomic, checksummed, locked, falls back to an intact
  checkpoint). The cost is one full copy of the state in rank 0's CPU memory while saving.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable, Iterator

import torch
from torch import nn

__all__ = ["SHARDINGS", "unsupported_reason", "shard", "full_weights", "full_state", "is_sharded", "FullStateModule",
           "unwrapped_class", "unwrapped"]

SHARDINGS = ("none", "fsdp2")
"""``--sharding`` values: ``none`` (every rank holds the whole model) or ``fsdp2``."""


def unsupported_reason() -> str | None:
    """None when this torch has FSDP2 and DTensor, else why not (one line)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)"
    return None


def _fsdp_modules(module: Any) -> list[nn.Module]:
    """The FSDP2 units in ``module`` (a model, or a Policy holding one); none for an unsharded module or torch."""
    # a module was sharded only if FSDP was imported: an unsharded run never imports it, here either
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is None or not isinstance(module, nn.Module):
        return []
    return [m for m in module.modules() if isinstance(m, fsdp)]


def is_sharded(module: Any) -> bool:
    """Whether ``module`` (a model, or a Policy holding one) is wrapped by :func:`shard`."""
    return bool(_fsdp_modules(module))


def unwrapped_class(module: nn.Module) -> type:
    """``module``'s own class, seen through FSDP2's wrapper class (``FSDP<Class>``, a subclass of ``FSDPModule``
    and ``<Class>``)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and any(c.__name__ == "FSDPModule" for c in cls.__mro__[1:]):
        return next((c for c in cls.__mro__[1:] if c.__name__ == cls.__name__[4:]), cls)
    return cls


@contextlib.contextmanager
def unwrapped(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` showing its own class inside the block (``save_pretrained`` records the class name as the
    model's architecture; an ``FSDPLlamaForCausalLM`` folder would not say what it holds)."""
    cls = type(module)
    module.__class__ = unwrapped_class(module)
    try:
        yield module
    finally:
        module.__class__ = cls


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the items of its ``nn.ModuleList`` s (a transformer's layers)."""
    return [block for m in module.modules() if isinstance(m, nn.ModuleList) for block in m]


def shard(modules: dict[str, nn.Module], optimizers: Iterable[Any] = (), *, device: str | torch.device = "cpu",
          bf16: bool = False) -> None:
    """Wrap each module with ``fully_shard`` (every block, then the root) on a 1-D mesh of all ranks, and point
    ``optimizers`` (:class:`~tokengym.rewards.training.OptimizerStep` s) at the sharded parameters.

    ``bf16``: all-gather and compute in bfloat16, reduce gradients in float32 (FSDP2's mixed precision; the
    sharded master weights stay float32). An optimiser's state (a resumed run's) is sharded like its parameter.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed as dist

    device = torch.device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    before = {id(p): (key, name) for key, m in modules.items() for name, p in m.named_parameters()}
    for module in modules.values():
        for block in _blocks(module):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
        for m in _fsdp_modules(module):  # (each block reduces its own gradients)
            m.set_gradient_divide_factor(1.0)  # each rank's loss carries its share: the gradients add up
            m.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)
    after = {(key, name): p for key, m in modules.items() for name, p in m.named_parameters()}
    new = {old: after[where] for old, where in before.items()}
    for step in optimizers:
        step.clip_params = [[new.get(id(p), p) for p in ps] for ps in step.clip_params]
        for opt in step.optimizers:
            state = {}
            for group in opt.param_groups:
                group["params"] = [new.get(id(p), p) for p in group["params"]]
            for p, s in opt.state.items():
                q = new.get(id(p), p)
                state[q] = {k: _like(v, q) for k, v in s.items()}
            opt.state.clear()
            opt.state.update(state)


def _like(value: Any, param: Any) -> Any:
    """An optimiser state tensor of an unsharded parameter, sharded like ``param`` (scalars stay as they are)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


@contextlib.contextmanager
def full_weights(module: Any) -> Iterator[None]:
    """All-gather a sharded module's parameters once and keep them whole inside the block (a rollout decodes many
    steps, with any number of forwards per rank); free them after. A no-op for an unsharded module.

    Every rank must enter it (it all-gathers), and the same number of times.
    """
    mods = _fsdp_modules(module)  # (one walk over the modules per rollout)
    if not mods:
        yield
        return
    with torch.inference_mode(False):  # FSDP2 reuses the gathered buffers in training: no inference tensors
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
    try:
        yield
    finally:
        with torch.inference_mode(False):
            for m in mods:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)


def full_state(obj: Any, _memo: dict[int, Any] | None = None) -> Any:
    """``obj`` (a state dict, an optimiser state, nested dicts/lists) with every DTensor replaced by its full
    tensor on the CPU. The same object seen twice (tied weights in ``state_dict(keep_vars=True)``) stays one
    tensor. Every rank must call it alike (each DTensor is gathered from all ranks)."""
    from torch.distributed.tensor import DTensor

    memo = {} if _memo is None else _memo
    if isinstance(obj, DTensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.full_tensor().detach().to("cpu", copy=True)  # its own storage (safetensors needs it)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return type(obj)((k, full_state(v, memo)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(full_state(v, memo) for v in obj)
    return obj


class FullStateModule(nn.Module):
    """A stand-in for a sharded module in a checkpoint: its :meth:`state_dict` is the gathered full state
    (what the checkpoint writer serialises). Build it on every rank (gathering is collective)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._full = full_state(dict(module.state_dict(keep_vars=True)))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # noqa: D102
        return dict(self._full)

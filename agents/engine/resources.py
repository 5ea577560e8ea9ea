"""Checks that a run fits what it runs on: the device exists, sequences fit the model's positions, a batch
fits in memory. Each raises ``ValueError`` with one line naming both numbers, before anything is allocated."""

from __future__ import annotations

import os
from typing import Any

import torch

from tokengym.rewards.common import max_positions

__all__ = ["check_device", "check_fits", "batch_memory_bytes", "available_memory_bytes", "check_memory"]


def check_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)`` if this machine has it; a clear ``ValueError`` otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} is not available: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device {device!r} is not available on this machine; use --device cpu")
    return dev


def check_fits(policy: Any, env: Any) -> None:
    """Refuse an env whose token ids exceed the model's vocabulary, or whose rows (prompt buffer ``P`` + budget ``M``)
    exceed the model's position limit.

    Past ``max_position_embeddings`` a model's outputs are garbage (or an index error), silently.
    """
    model = getattr(policy, "model", policy)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and env.vocab_size > vocab:  # an id past the embedding: an IndexError mid-rollout
        raise ValueError(f"the env's tokenizer has {env.vocab_size} token ids but the model's vocabulary has {vocab}: "
                         "give the env the policy's own tokenizer (tokenizer=policy.tokenizer)")
    limit = max_positions(model)
    need = env.max_prompt_len + env.max_new_tokens
    if limit is not None and need > limit:
        raise ValueError(
            f"prompts of up to max_prompt_len={env.max_prompt_len} tokens plus max_new_tokens={env.max_new_tokens} need "
            f"{need} positions, but the model has {limit} (max_position_embeddings); shorten the prompts or pass a "
            f"smaller max_prompt_len / max_new_tokens")


def batch_memory_bytes(model: Any, rows: int, seq_len: int, update_rows: int) -> int:
    """A lower bound on what one rollout + update holds at once: the fp32 KV cache and token buffers of
    ``rows`` sequences of ``seq_len``, plus the activations autograd keeps for ``update_rows`` of them
    (a few hidden-size tensors per layer and token). Real use is higher; a batch over this never fits."""
    cfg = model.config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    kv_cache = rows * seq_len * layers * 2 * kv * head_dim * 4
    buffers = rows * seq_len * 32  # tokens, masks, rewards, log-probs, values in the env and the rollout
    activations = update_rows * seq_len * layers * (6 * hidden + 2 * inter) * 4
    return int(kv_cache + buffers + activations)


def available_memory_bytes(device: str | torch.device) -> int | None:
    """Free memory of ``device``: ``MemAvailable`` for the CPU, the CUDA allocator's free bytes; None if unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu" or not os.path.exists("/proc/meminfo"):
        return None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_memory(model: Any, rows: int, seq_len: int, update_rows: int, device: str | torch.device, what: str) -> None:
    """Refuse a batch whose :func:`batch_memory_bytes` exceeds the device's free memory, naming both."""
    need = batch_memory_bytes(model, rows, seq_len, update_rows)
    free = available_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"{what} needs at least {need / 2**30:.1f} GiB ({rows} sequences of {seq_len} tokens), but "
                         f"{torch.device(device)} has {free / 2**30:.1f} GiB free; use fewer prompts or more minibatches")

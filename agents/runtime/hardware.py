"""What the hardware computes fast: whether a half-precision dtype runs natively on a device or is emulated.

On a CPU without AVX512-BF16 or AMX, bf16 kernels convert to fp32 and back around fp32 arithmetic, so keeping a
tensor in bf16 there saves memory but costs time; where bf16 is native (and on CUDA) it halves the bytes a
bandwidth-bound kernel reads. The fast decoder uses :func:`half_is_fast` to pick its KV cache's dtype.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["cpu_has_native_bf16", "half_is_fast"]


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), checked once: PyTorch's own CPU probe where it
    has one, else the ``avx512_bf16`` / ``amx_bf16`` flags of ``/proc/cpuinfo`` (Linux)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    probes = [p for p in probes if p is not None]
    if probes:
        try:
            return any(bool(p()) for p in probes)
        except RuntimeError:
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def half_is_fast(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` (bf16 or fp16) is native on ``device``: CUDA (bf16 where the GPU supports it without
    emulation), or a CPU with native bf16 (:func:`cpu_has_native_bf16`; fp16 counts as emulated on CPUs)."""
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if device.type == "cuda":
        if dtype == torch.float16:
            return True
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # an older torch without the argument
            return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return dtype == torch.bfloat16 and cpu_has_native_bf16()
    return False

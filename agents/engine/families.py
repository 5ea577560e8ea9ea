"""The model families :class:`~tokengym.agents.engine.fast_decode.StaticDecoder` runs, each as a small description.

A decoder layer of every supported family is the same skeleton: ``x += [norm](o_proj(attention(qkv)))`` then
``x += [norm](down(act(gate) * up))``, with an optional RMSNorm before each half (Llama's input and post-attention
norms), after each half (Gemma 3's post-attention and post-feed-forward norms, OLMo 2's only norms), and on the queries
and keys before RoPE (per head: Qwen3, Gemma 3; over the whole projection: OLMo 2). A :class:`Family` names which
modules hold those weights; :func:`layer_weights` reads one layer's weights (LoRA deltas added) into that shape, so the
decoder holds no per-family branches beyond "is this norm there". Per layer, :func:`layer_rope` says which rotary table
a layer uses (``None``: a NoPE layer) and :func:`layer_window` its sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "Family", "LayerWeights", "layer_reason", "layer_rope", "layer_weights", "layer_window",
           "linear_bias", "linear_weight"]


@dataclass(frozen=True)
class Family:
    """Where one family keeps a layer's weights. ``None`` for a norm: the family has none there."""

    norms: tuple[str, ...]  # RMSNorm class names accepted for this family
    pre_attn: str | None = "input_layernorm"
    attn_out: str | None = None  # norm of the attention output before the residual add (Gemma 3, OLMo 2)
    pre_mlp: str | None = "post_attention_layernorm"
    mlp_out: str | None = None  # norm of the MLP output before the residual add
    qk_norm: str | None = None  # "head": RMSNorm over each head's hd values; "proj": over the whole q (k) projection
    fused_qkv: bool = False  # one qkv_proj (Phi-3) instead of q_proj/k_proj/v_proj
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3) instead of gate_proj/up_proj
    norm_offset: bool = False  # Gemma's RMSNorm scales by (1 + w)
    extra: tuple[str, ...] = ()  # further layer children that are identities in eval mode (Phi-3's dropouts)
    plain: bool = False  # Llama's layout exactly: the decoder's specialised loop

    @property
    def layer_modules(self) -> tuple[str, ...]:
        norms = (self.pre_attn, self.attn_out, self.pre_mlp, self.mlp_out)
        return ("self_attn", "mlp", *(n for n in norms if n is not None), *self.extra)

    @property
    def attn_modules(self) -> tuple[str, ...]:
        proj = ("qkv_proj",) if self.fused_qkv else ("q_proj", "k_proj", "v_proj")
        return (*proj, "o_proj", *(("q_norm", "k_norm") if self.qk_norm else ()))

    @property
    def mlp_modules(self) -> tuple[str, ...]:
        return (("gate_up_proj",) if self.fused_gate_up else ("gate_proj", "up_proj")) + ("down_proj",)


_LLAMA = Family(norms=("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"), plain=True)
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": Family(norms=("Qwen3RMSNorm",), qk_norm="head"),
    "Gemma3ForCausalLM": Family(norms=("Gemma3RMSNorm",), attn_out="post_attention_layernorm",
                                pre_mlp="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm",
                                qk_norm="head", norm_offset=True),
    "SmolLM3ForCausalLM": Family(norms=("SmolLM3RMSNorm",)),
    "Phi3ForCausalLM": Family(norms=("Phi3RMSNorm",), fused_qkv=True, fused_gate_up=True,
                              extra=("resid_attn_dropout", "resid_mlp_dropout")),
    "Olmo2ForCausalLM": Family(norms=("Olmo2RMSNorm",), pre_attn=None, attn_out="post_attention_layernorm",
                               pre_mlp=None, mlp_out="post_feedforward_layernorm", qk_norm="proj"),
}
"""Supported ``transformers`` classes. Llama, Mistral and Qwen2 share Llama's layout (``plain``)."""


def layer_reason(fam: Family, layer: nn.Module, i: int) -> str | None:
    """``None`` if decoder layer ``i`` has exactly ``fam``'s modules, else what differs (one line)."""
    children = {n for n, _ in layer.named_children()}
    if children != set(fam.layer_modules):
        missing, extra = set(fam.layer_modules) - children, children - set(fam.layer_modules)
        return f"layer {i} lacks {sorted(missing)}" if missing else f"layer {i} has extra modules {sorted(extra)}"
    attn = {n for n, _ in layer.self_attn.named_children()}
    if attn != set(fam.attn_modules):
        return f"layer {i} attention has modules {sorted(attn)}"
    if not all(hasattr(layer.mlp, a) for a in fam.mlp_modules):
        return f"layer {i} MLP lacks one of {fam.mlp_modules}"
    norms = [getattr(layer, n) for n in fam.layer_modules if n.endswith("norm")]
    norms += [layer.self_attn.q_norm, layer.self_attn.k_norm] if fam.qk_norm else []
    for mod in norms:
        if type(mod).__name__ not in fam.norms:
            return f"layer {i} norm is {type(mod).__name__}"
    for name in fam.extra:
        if layer.training and float(getattr(getattr(layer, name), "p", 0.0)) > 0:
            return f"layer {i} {name} is active (model in training mode)"
    return None


def linear_weight(mod: nn.Module) -> torch.Tensor:
    """A linear layer's weight as its forward applies it: with ``peft``, the base weight plus the deltas of the
    active LoRA adapters (unless disabled or already merged)."""
    base = getattr(mod, "base_layer", None)
    if base is None:
        return mod.weight
    w = base.weight
    if getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False):
        return w
    for name in mod.active_adapters:
        if name in mod.lora_A:
            w = w + mod.get_delta_weight(name).to(w.dtype)
    return w


def linear_bias(mod: nn.Module) -> torch.Tensor | None:
    """A linear layer's bias (``peft``: its base layer's), or ``None``."""
    return getattr(getattr(mod, "base_layer", mod), "bias", None)


def norm_weight(fam: Family, mod: nn.Module | None) -> tuple[torch.Tensor, float] | None:
    """``(scale, eps)`` of an RMSNorm as ``F.rms_norm`` takes them (Gemma's ``1 + w`` in fp32, as its forward computes
    it), or ``None`` for no norm."""
    if mod is None:
        return None
    eps = getattr(mod, "variance_epsilon", None)
    eps = float(mod.eps if eps is None else eps)
    w = mod.weight.detach()
    return (1.0 + w.float() if fam.norm_offset else w), eps


@dataclass
class LayerWeights:
    """One layer's weights, unfused (``[out, in]``, LoRA deltas added); norms as ``(scale, eps)`` or ``None``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qkv_bias: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate: torch.Tensor
    up: torch.Tensor
    gate_up_bias: tuple[torch.Tensor | None, torch.Tensor | None]
    down: torch.Tensor
    down_bias: torch.Tensor | None
    pre_attn: Any
    attn_out: Any
    pre_mlp: Any
    mlp_out: Any
    q_norm: Any
    k_norm: Any


def layer_weights(fam: Family, layer: nn.Module, n_heads: int, n_kv: int, head_dim: int) -> LayerWeights:
    """Read decoder layer ``layer``'s weights as ``fam`` lays them out (fused projections split into their parts)."""
    a, p = layer.self_attn, layer.mlp
    if fam.fused_qkv:
        q, k, v = linear_weight(a.qkv_proj).split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], 0)
        b = linear_bias(a.qkv_proj)
        qkv_bias = (None, None, None) if b is None else tuple(b.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim]))
    else:
        q, k, v = linear_weight(a.q_proj), linear_weight(a.k_proj), linear_weight(a.v_proj)
        qkv_bias = (linear_bias(a.q_proj), linear_bias(a.k_proj), linear_bias(a.v_proj))
    if fam.fused_gate_up:
        gate, up = linear_weight(p.gate_up_proj).chunk(2, 0)
        b = linear_bias(p.gate_up_proj)
        gate_up_bias = (None, None) if b is None else tuple(b.chunk(2))
    else:
        gate, up = linear_weight(p.gate_proj), linear_weight(p.up_proj)
        gate_up_bias = (linear_bias(p.gate_proj), linear_bias(p.up_proj))
    norm = lambda name: norm_weight(fam, None if name is None else getattr(layer, name))  # noqa: E731
    return LayerWeights(
        q=q, k=k, v=v, qkv_bias=qkv_bias, o=linear_weight(a.o_proj), o_bias=linear_bias(a.o_proj),
        gate=gate, up=up, gate_up_bias=gate_up_bias, down=linear_weight(p.down_proj), down_bias=linear_bias(p.down_proj),
        pre_attn=norm(fam.pre_attn), attn_out=norm(fam.attn_out), pre_mlp=norm(fam.pre_mlp), mlp_out=norm(fam.mlp_out),
        q_norm=norm_weight(fam, getattr(a, "q_norm", None) if fam.qk_norm else None),
        k_norm=norm_weight(fam, getattr(a, "k_norm", None) if fam.qk_norm else None),
    )


def layer_rope(cfg: Any, i: int) -> str | None:
    """Which rotary table layer ``i`` uses: ``"default"``, a Gemma 3 layer type (its own RoPE base), or ``None`` for a
    layer without rotary embedding (SmolLM3's NoPE layers)."""
    no_rope = getattr(cfg, "no_rope_layers", None)
    if no_rope is not None and not no_rope[i]:
        return None
    rope = getattr(cfg, "rope_parameters", None) or {}
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and isinstance(rope, dict) and isinstance(rope.get(layer_types[i]), dict):
        return layer_types[i]
    return "default"


def layer_window(cfg: Any, i: int) -> int | None:
    """Layer ``i``'s sliding window (a key more than ``window - 1`` columns behind the query is masked), or ``None``.

    ``layer_types`` (Gemma 3, Qwen3, SmolLM3) says which layers slide; Phi-3 and Mistral slide every layer when the
    config sets ``sliding_window``."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if window is None:
        return None
    if layer_types:
        return int(window) if layer_types[i] == "sliding_attention" else None
    return int(window) if type(cfg).__name__ in ("Phi3Config", "MistralConfig") else None

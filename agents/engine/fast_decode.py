"""A lean, static-KV-cache decode step for Llama-like causal LMs (``Policy``'s rollout fast path).

A ``transformers`` forward call costs far more than its arithmetic for a small model: building masks
and position embeddings, growing the cache with ``torch.cat``, module hooks and output objects dominate
a decode step (figures in ``bench/RESULTS.md``). :class:`StaticDecoder` runs the same maths directly against the
model's own weights, with everything that does not change from step to step prepared once:

* **Static KV cache laid out like the env buffer.** Per layer, keys ``[N * Hkv, hd, P + M]`` (stored
  transposed: the score GEMM reads them in place) and values ``[N * Hkv, P + M, hd]``, so cache
  column ``j`` holds env column ``j``: the prompts are
  prefilled into columns ``[0, P)`` and the token of decode step ``t`` is written at column ``P + t``.
  A step attends to columns ``[0, P + t]`` (a view, no copy); the additive mask is ``-inf`` on prompt
  padding and ``0`` elsewhere, allocated once per batch. Columns past ``P + t`` are never read, so a
  reused cache cannot leak an earlier batch.
* **Positions and RoPE up front.** Positions are ``cumsum(mask) - 1`` (as in ``policy.py``), so
  decode step ``t`` of a slot with ``n`` real prompt tokens is at position ``n + t``. ``cos``/``sin``
  come from the model's own rotary-embedding module, computed once for every position.
* **Fused projections.** q/k/v (and gate/up) are multiplied in one GEMM each, with the q/k/v rows
  permuted per key-value group (``[q_1..q_rep, k, v]``) so that queries, new keys and new values are
  views of one tensor (grouped-query attention needs no ``repeat_kv``). Norms, residual adds (fused
  into ``addmm``), RoPE (``rotate_half`` as a swap of halves with the sign folded into ``sin``, one
  ``addcmul``) and attention (``baddbmm``, softmax, ``bmm``) are a handful of kernels per layer. The fused weights are a copy, rebuilt
  at every prefill (once per rollout batch), so any optimiser step between rollouts is picked up,
  fused optimisers included (they update parameters without bumping their version counters).
* **Prepacked GEMMs on CPU.** Where PyTorch's oneDNN linear kernels are available (and pass a
  one-time check against ``torch.mm``), the fused matrices are reordered once per prefill into
  oneDNN's blocked layout and multiplied with ``torch.ops.mkldnn._linear_pointwise`` (the residual
  add fused in): for the few-row GEMMs of a decode step that beats ``torch.mm`` (MKL) on matrices of
  at least ``_PACK_MIN_NUMEL`` entries; smaller ones (e.g. all of the ``tiny`` preset's) stay on
  ``torch.mm`` (measurements in ``bench/RESULTS.md``). Elsewhere (GPU, other builds) the matrices are plain
  ``[in, out]`` tensors for ``torch.mm``.
* **bf16 weights, KV cache and attention under autocast.** A prefill inside ``torch.autocast(device,
  dtype=torch.bfloat16)`` (what ``GRPOConfig(bf16=True)`` wraps its rollout in) keeps the fused matrices in bf16 and
  multiplies in bf16, as autocast would. Where bf16 is native (CUDA; CPUs with AVX512-BF16 or AMX, detected once by
  :mod:`~tokengym.agents.runtime.hardware`) the KV cache is bf16 too, and so is attention in prefill, decode, refill
  and extend: scores and probabilities in bf16, the softmax computed in fp32 by its kernel (as an eager autocast
  forward does), the output back in the residual dtype. That halves the cache and the bytes a decode step reads from
  it. Where bf16 is emulated the cache and attention stay fp32, where they are faster (``kv_dtype``: :data:`KV_DTYPES`).
  The residual stream, norms and RoPE stay fp32 either way; the MLP's hidden activations stay in bf16 between its
  matrices, as autocast's forward keeps them. Outside autocast nothing changes.
* **Rows come and go.** :meth:`StaticDecoder.compact` keeps only the live rows (moved to the front of the same
  storage), :meth:`StaticDecoder.refill` encodes a new prompt into a row while the others go on (continuous
  batching), and ``prefill(copies=G)`` encodes a group's shared prompt once for its G rows.
* **No host sync** and no Python-side work that depends on the data.

Numerics follow the ``transformers`` implementation (fp32 maths agrees with a full forward to float
rounding; under bf16 autocast it agrees with an autocast forward to bf16 rounding).
Supported: ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (q/k/v biases,
grouped-query attention, explicit ``head_dim``, tied embeddings, static RoPE variants; sliding windows
only when wider than the cache), and ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``, ``SmolLM3ForCausalLM``,
``Phi3ForCausalLM`` and ``Olmo2ForCausalLM``, each described in :mod:`~tokengym.agents.engine.families` (which norms
where, q/k norms, fused projections): their layers run :meth:`StaticDecoder._run_general`, per-layer RoPE tables
(Gemma 3's local base, SmolLM3's NoPE layers, Phi-3's partial rotary) and per-layer band masks for sliding windows of
any width; Gemma's scaled embeddings and final logit soft-capping are applied as its forward does. Llama's layout keeps
its own loop, so its decode step does no per-family work. :func:`unsupported_reason` says why a model is not
supported (MoE models, attention soft-capping, other classes); ``Policy`` then uses the generic ``transformers`` path
and warns once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokengym.agents.engine.families import (FAMILIES, Family, layer_reason, layer_rope, layer_weights, layer_window,
                                              linear_bias, linear_weight, norm_weight)
from tokengym.agents.runtime.hardware import half_is_fast
from tokengym.agents.runtime.sharding import unwrapped_class

__all__ = ["KV_DTYPES", "StaticDecoder", "check_kv_dtype", "kv_cache_dtype", "plain_weights", "unsupported_reason"]

KV_DTYPES = ("auto", "model", "autocast")
"""``kv_dtype`` choices: ``"auto"`` keeps the KV cache and attention in the autocast dtype where that dtype is native
(:func:`~tokengym.agents.runtime.hardware.half_is_fast`), else in the model's dtype; ``"model"``: always the model's
dtype (the residual stream's); ``"autocast"``: the autocast dtype even where it is emulated."""

_PACK_MIN_NUMEL = 1 << 17
"""Smaller matrices stay on ``torch.mm``: below 2^17 entries oneDNN's per-call cost outweighs its faster GEMM."""
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inverse frequencies do not depend on the length


def _unwrap_lora(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``(the transformers model, None)`` of a plain model or a ``peft`` LoRA model whose adapters sit on the
    attention and MLP projections only; ``(model, why not)`` for other ``peft`` models."""
    if not getattr(model, "peft_config", None) or not hasattr(model, "get_base_model"):
        return model, None
    why = _lora_reason(model)
    if why is not None:
        return model, why
    base = model.get_base_model()
    if model.training and any(getattr(m, "lora_dropout", None) and any(not isinstance(d, nn.Identity) for d in m.lora_dropout.values())
                              for m in base.modules()):
        return model, "LoRA dropout is active (model in training mode)"
    return base, None


def _lora_reason(model: nn.Module) -> str | None:
    """``None`` for a ``peft`` model whose adapters are plain LoRA on linear projections, else why not."""
    for name, cfg in model.peft_config.items():
        if str(getattr(cfg, "peft_type", "")).split(".")[-1] != "LORA" or getattr(cfg, "use_dora", False) \
                or getattr(cfg, "lora_bias", False) or getattr(cfg, "modules_to_save", None):
            return f"peft adapter {name!r} is not a plain LoRA adapter on linear layers"
    base = model.get_base_model()
    for mod in (getattr(base, "lm_head", None), getattr(getattr(base, "model", None), "embed_tokens", None)):
        if mod is not None and hasattr(mod, "base_layer"):
            return "LoRA on the embeddings or the LM head"
    return None


def plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under the names of the plain ``transformers`` model: a ``peft`` LoRA model's adapter deltas
    merged into their base weights (what an inference engine that knows nothing of adapters loads). Tied weights
    appear under each of their names."""
    if not getattr(model, "peft_config", None) or not hasattr(model, "get_base_model"):
        return dict(model.state_dict())
    why = _lora_reason(model)
    if why is not None:
        raise ValueError(f"cannot merge the adapters into plain weights: {why}")
    base, out = model.get_base_model(), {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
                out[f"{name}.weight"] = _weight(mod).detach()
                if _bias(mod) is not None:
                    out[f"{name}.bias"] = _bias(mod).detach()
    for k, v in base.state_dict().items():
        if ".lora_" not in k and ".base_layer." not in k:
            out.setdefault(k, v)
    return out


_weight, _bias = linear_weight, linear_bias


def unsupported_reason(model: nn.Module, width: int | None = None) -> str | None:
    """``None`` if :class:`StaticDecoder` can run ``model`` (for a cache of ``width`` columns), else why not.

    Without ``width`` the sliding-window check (which depends on the cache width) is skipped. A ``peft`` LoRA
    model is judged by its base model (its adapters are added to the fused weights).
    """
    model, why = _unwrap_lora(model)
    if why is not None:
        return why
    name = unwrapped_class(model).__name__  # an FSDP2-wrapped model decodes from its gathered weights
    fam = FAMILIES.get(name)
    if fam is None:
        return f"{name} is not one of {sorted(FAMILIES)}"
    cfg = model.config
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "unexpected module layout (needs model.embed_tokens/layers/norm/rotary_emb)"
    if not hasattr(model, "lm_head") or getattr(model.lm_head, "bias", None) is not None:
        return "needs a bias-free lm_head"
    for i, layer in enumerate(base.layers):
        why = layer_reason(fam, layer, i)
        if why is not None:
            return why
    rope = getattr(cfg, "rope_parameters", None) or {}
    ropes = ([r for r in rope.values() if isinstance(r, dict)] or [rope]) if isinstance(rope, dict) else []  # per layer type
    for r in ropes:
        if r.get("rope_type", "default") not in _STATIC_ROPE:
            return f"rope_type {r['rope_type']!r} recomputes frequencies from the sequence length"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if model.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout is active (model in training mode)"
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(cfg, flag, None):
            return f"{flag}={getattr(cfg, flag)} is not supported"
    if fam.plain:  # Llama's layout: no band masks, so a window must cover the whole cache
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None) or ()
        windowed = (name == "MistralForCausalLM" and window is not None) or "sliding_attention" in layer_types
        if windowed and width is not None and (window is None or width > int(window)):
            return f"sliding_window={window} is narrower than the cache ({width} columns)"
    return None


def _act_fn(cfg: Any, mlp: nn.Module):
    if getattr(cfg, "hidden_act", None) == "silu":
        return F.silu
    return getattr(mlp, "act_fn", None) or mlp.activation_fn


class StaticDecoder:
    """Prefill + one-token decode steps of a supported model with a static, env-shaped KV cache.

    Args:
        model: a supported ``transformers`` causal LM (see :func:`unsupported_reason`).
        kv_dtype: the KV cache's and attention's dtype under autocast, one of :data:`KV_DTYPES` (see
            :func:`kv_cache_dtype`); outside autocast they are in the model's dtype.

    Usage (what ``Policy.prefill(..., max_new_tokens=M)`` / ``Policy.decode`` do)::

        dec = StaticDecoder(model)
        logits = dec.prefill(tokens[:, :P], mask[:, :P], M)   # [N, V] float32
        logits = dec.decode(next_tokens)                      # token written at column P + t
    """

    def __init__(self, model: nn.Module, kv_dtype: str = "auto"):
        check_kv_dtype(kv_dtype)
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"StaticDecoder cannot run this model: {reason}")
        self.kv_dtype = kv_dtype
        self._kv = torch.float32  # the KV cache's and attention's dtype, fixed at each prefill (kv_cache_dtype)
        self.source = model  # what the Policy holds (a peft model for LoRA)
        model = _unwrap_lora(model)[0]  # LoRA adapters are added to the fused weights in _refresh
        cfg = model.config
        self.model = model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        attn0 = model.model.layers[0].self_attn
        self.head_dim = int(getattr(attn0, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        if self.n_heads % self.n_kv or self.head_dim % 2:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads and head_dim even")
        self.rep = self.n_heads // self.n_kv
        self.scaling = float(getattr(attn0, "scaling", self.head_dim**-0.5))
        self.act = _act_fn(cfg, model.model.layers[0].mlp)
        self.family: Family = FAMILIES[unwrapped_class(model).__name__]
        n_layers = len(model.model.layers)
        kinds = [layer_rope(cfg, i) for i in range(n_layers)]
        self._rope_names = sorted({k for k in kinds if k is not None})  # one rotary table each, built at prefill
        self._rope_of = [None if k is None else self._rope_names.index(k) for k in kinds]  # None: a NoPE layer
        # per-layer sliding windows, applied as band masks (Llama's layout runs only windows wider than the cache)
        self._windows = [None if self.family.plain else layer_window(cfg, i) for i in range(n_layers)]
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._run_layers = self._run_plain if self.family.plain else self._run_general
        self._key: tuple | None = None
        self._layers: list[tuple] = []
        self._extra: list[tuple] = []  # per layer (q/k norm scale, eps, attention-output norm, MLP-output norm)
        self._rope_key: tuple | None = None
        self._ropes: list[torch.Tensor] = []
        self._swap = _swap_halves
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._store: list[tuple[torch.Tensor, torch.Tensor]] = []  # the allocated cache (_cache may view a prefix)
        self._step = 0
        self._capacity = 0
        self._N = self._P = 0

    # ------------------------------------------------------------------ weights
    def _sources(self) -> list[torch.Tensor]:
        return list(self.model.parameters())  # with LoRA: base weights, A and B

    def _refresh(self, mm_dtype: torch.dtype | None = None, rows: int = 1) -> None:
        """(Re)build the fused weights from the model's current parameters (matrices in ``mm_dtype``,
        oneDNN-packed for GEMMs of about ``rows`` rows where :func:`_packed_ok`).

        Called at every prefill (once per rollout batch): version counters alone cannot tell whether
        weights changed (a fused optimizer step, for one, updates parameters without bumping them), and
        one copy of the weights per batch is cheap next to the batch's decode steps.
        """
        key = tuple((t.data_ptr(), _version(t), t.dtype, t.device) for t in self._sources())
        G, rep, hd = self.n_kv, self.rep, self.head_dim
        mm_dtype = mm_dtype or self.model.model.embed_tokens.weight.dtype
        pack = _packed_ok(self.model.model.embed_tokens.weight.device, mm_dtype)

        def mat(w: torch.Tensor) -> torch.Tensor:  # [out, in] -> packed, or contiguous [in, out], in mm_dtype
            if pack and w.numel() >= _PACK_MIN_NUMEL:
                return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(mm_dtype).contiguous(), rows)
            return w.detach().t().to(mm_dtype, memory_format=torch.contiguous_format)

        def vec(b: torch.Tensor | None) -> torch.Tensor | None:  # biases are added in the matrices' dtype (as autocast does)
            return None if b is None else b.detach().to(mm_dtype).contiguous()

        layers, extra = [], []
        with torch.no_grad():
            for layer in self.model.model.layers:
                lw = layer_weights(self.family, layer, self.n_heads, G, hd)
                Wq, Wk, Wv = lw.q, lw.k, lw.v
                D = Wq.shape[1]
                # rows grouped per key-value head: [q_(g*rep) .. q_(g*rep+rep-1), k_g, v_g]
                w = torch.cat([Wq.view(G, rep, hd, D), Wk.view(G, 1, hd, D),
                               Wv.view(G, 1, hd, D)], 1)
                w_qkv = mat(w.reshape(-1, D))
                b_qkv = None
                if any(b is not None for b in lw.qkv_bias):
                    bq, bk, bv = (Wq.new_zeros(n) if b is None else b for b, n in zip(lw.qkv_bias, (G * rep * hd, G * hd, G * hd)))
                    b = torch.cat([bq.view(G, rep, hd), bk.view(G, 1, hd), bv.view(G, 1, hd)], 1)
                    b_qkv = vec(b.reshape(-1))
                Wg, Wu = lw.gate, lw.up
                I = Wg.shape[0]
                w_gu = mat(torch.cat([Wg, Wu], 0))
                b_gu = None
                if any(b is not None for b in lw.gate_up_bias):
                    b_gu = vec(torch.cat([Wg.new_zeros(I) if b is None else b for b in lw.gate_up_bias]))
                pre, post = lw.pre_attn or (None, 0.0), lw.pre_mlp or (None, 0.0)
                layers.append((
                    pre[0], pre[1],
                    w_qkv, b_qkv,
                    mat(lw.o), vec(lw.o_bias),
                    post[0], post[1],
                    w_gu, b_gu, I,
                    mat(lw.down), vec(lw.down_bias),
                ))
                extra.append((_qk_scale(self.family.qk_norm, lw, G, rep, hd), lw.q_norm and lw.q_norm[1], lw.attn_out, lw.mlp_out))
            emb = self.model.model.embed_tokens
            scale = getattr(emb, "embed_scale", None)  # Gemma: embeddings times sqrt(hidden), in their dtype
            self._embed = emb.weight.detach() if scale is None else emb.weight.detach() * scale.to(emb.weight.dtype)
            self._norm_w, self._norm_eps = norm_weight(self.family, self.model.model.norm)
            self._head_t = mat(self.model.lm_head.weight)
        self._layers, self._extra = layers, extra
        self._key = key

    def release(self) -> None:
        """Free the fused weights and the KV cache (a copy of every linear layer, and more): they are rebuilt at the
        next prefill anyway, and held between rollouts they would add to the update's peak memory."""
        self._layers, self._cache, self._store, self._key = [], [], [], None
        self._embed = self._norm_w = self._head_t = None
        self._step = self._capacity = 0

    def _rope_tables(self, length: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Per rotary kind (``self._rope_names``) ``[length, 2, hd]``: cos and sin of every position from the model's
        rotary module, the sign of ``rotate_half`` folded into sin (``rotate_half(x) * sin == swap(x) * signed``).
        A partial rotary embedding (Phi-3) is padded with cos 1, sin 0 over the dimensions it leaves alone."""
        rot, hd = self.model.model.rotary_emb, self.head_dim
        key = (length, dtype, device, tuple((b.data_ptr(), _version(b)) for b in rot.buffers()))
        if key != self._rope_key or any(v is None for _, v in key[-1]):
            pos = torch.arange(length, device=device)[None]
            tables = []
            for name in self._rope_names:
                kw = {} if name == "default" else {"layer_type": name}
                cos, sin = rot(torch.empty(0, device=device, dtype=dtype), position_ids=pos, **kw)
                cos, sin, rd = cos[0], sin[0], cos.shape[-1]
                sign = torch.ones(rd, dtype=dtype, device=device)
                sign[: rd // 2] = -1
                sin = sin * sign
                if rd < hd:
                    cos = torch.cat([cos, cos.new_ones(length, hd - rd)], -1)
                    sin = torch.cat([sin, sin.new_zeros(length, hd - rd)], -1)
                    perm = torch.cat([torch.arange(rd // 2, rd), torch.arange(rd // 2), torch.arange(rd, hd)]).to(device)
                    self._swap = functools.partial(_swap_by, perm)
                tables.append(torch.stack([cos, sin], 1).contiguous())
            self._ropes, self._rope_key = tables, key
        return self._ropes

    def _per_layer(self, base: torch.Tensor, band) -> list[torch.Tensor]:
        """``base`` for each layer without a sliding window, ``band(window)`` (made once per window) for the others."""
        made: dict = {None: base}
        return [made[w] if w in made else made.setdefault(w, band(w)) for w in self._windows]

    # ------------------------------------------------------------------ rollout API
    @property
    def step(self) -> int:
        """Decode steps taken since the last prefill (the next token goes to column ``P + step``)."""
        return self._step

    @property
    def capacity(self) -> int:
        """Decode steps the current cache has room for (``max_new_tokens`` of the last prefill)."""
        return self._capacity

    def _alloc(self, N: int, W: int, dtype: torch.dtype, device: torch.device) -> None:
        """Per layer ``(keys^T [N*G, hd, W], values [N*G, W, hd])``; reused while the shape stays the same."""
        B, hd = N * self.n_kv, self.head_dim
        c = self._store[0][0] if self._store else None
        if c is None or len(self._store) != len(self._layers) or c.shape != (B, hd, W) or c.dtype != dtype or c.device != device:
            self._store = [(torch.zeros(B, hd, W, dtype=dtype, device=device), torch.zeros(B, W, hd, dtype=dtype, device=device))
                           for _ in self._layers]
        self._cache = list(self._store)  # compact() narrows these to prefixes of the stored tensors

    def prefill(self, tokens: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, copies: int = 1) -> torch.Tensor:
        """Encode left-padded prompts ``tokens[N, P]`` into cache columns ``[0, P)``; return logits ``[N, V]`` (fp32).

        Reserves room for ``max_new_tokens`` decode steps. Must run under ``torch.no_grad`` or
        ``torch.inference_mode`` (``Policy`` does). Under an enabled ``torch.autocast`` for the model's
        device, the weight matrices of this batch (prefill and its decode steps) are kept and multiplied
        in the autocast dtype. ``copies=G``: the rows are ``N / G`` groups of ``G`` identical prompts (a GRPO
        batch): each distinct prompt is encoded once and its keys and values are copied to its group's rows.
        """
        if tokens.dim() != 2 or mask.shape != tokens.shape:
            raise ValueError(f"tokens and mask must both be [N, P], got {tuple(tokens.shape)} and {tuple(mask.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        width = tokens.shape[1] + int(max_new_tokens)
        reason = unsupported_reason(self.model, width)
        if reason is not None:
            raise ValueError(f"StaticDecoder cannot run this model: {reason}")
        dev_type = self.model.model.embed_tokens.weight.device.type
        amp = torch.get_autocast_dtype(dev_type) if torch.is_autocast_enabled(dev_type) else None
        if copies < 1 or tokens.shape[0] % copies:
            raise ValueError(f"copies={copies} must divide the {tokens.shape[0]} rows")
        self._refresh(amp, rows=tokens.shape[0])
        self._kv = kv_cache_dtype(self.kv_dtype, amp, self._embed.dtype, self._embed.device)
        with torch.autocast(dev_type, enabled=False):  # dtypes are explicit below
            return self._prefill(tokens, mask, int(max_new_tokens), width, int(copies))

    def _prefill(self, tokens: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, width: int, copies: int = 1) -> torch.Tensor:
        full_mask = mask.to(self._embed.device).bool()
        N, P = tokens.shape[0] // copies, tokens.shape[1]
        G, hd = self.n_kv, self.head_dim
        dtype, device = self._embed.dtype, self._embed.device
        self._alloc(N * copies, width, self._kv, device)
        ropes = self._rope_tables(width, dtype, device)

        def write(li: int, k: torch.Tensor, v: torch.Tensor) -> None:  # row r * copies + c holds prompt r
            k_t, v_c = self._cache[li]
            k_t.view(N, copies, G, hd, -1)[..., :P] = k.permute(0, 2, 3, 1)[:, None]
            v_c.view(N, copies, G, -1, hd)[:, :, :, :P] = v.permute(0, 2, 1, 3)[:, None]

        logits = self._encode(tokens[::copies], mask[::copies], ropes, write).repeat_interleave(copies, 0)
        N, mask = N * copies, full_mask

        # decode state, prepared once: attention bias over cache columns, per-step positions, signed RoPE table
        col_ok = torch.ones(N, width, dtype=torch.bool, device=device)
        col_ok[:, :P] = mask
        self._bias = (torch.zeros(N, width, dtype=self._kv, device=device).masked_fill_(~col_ok, float("-inf"))
                      .repeat_interleave(G, 0)[:, None, :].contiguous())  # [N * G, 1, W]
        # step t of a slot with n real prompt tokens is at position n + t (= cumsum(mask) - 1 at column P + t)
        self._pos = mask.long().sum(1)[None, :] + torch.arange(max_new_tokens, device=device)[:, None]  # [M, N]
        self._N, self._P = N, P
        self._step, self._capacity = 0, int(max_new_tokens)
        self._cur = None  # per-row columns written past P, once rows diverge (until then every row is at step)
        self._n_prompt = mask.long().sum(1)
        self._ragged = False  # rows at different columns (after an extend)
        self._hi = P - 1  # the highest column any row has written (host)
        self._arange_g = torch.arange(G, device=device)
        self._arange_ng = torch.arange(N * G, device=device)
        return logits.float()

    def _encode(self, tokens: torch.Tensor, mask: torch.Tensor, ropes: list[torch.Tensor], write) -> torch.Tensor:
        """Run left-padded prompts ``tokens[N, P]`` through the layers, handing each layer's keys and values
        ``[N, P, G, hd]`` to ``write(layer, k, v)``; return the last column's logits ``[N, V]`` (fp32)."""
        N, P = tokens.shape
        rep, hd, H = self.rep, self.head_dim, self.n_heads
        dtype, device = self._embed.dtype, self._embed.device
        tokens, mask = tokens.to(device), mask.to(device).bool()
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)  # [N, P]
        css = [(cs[:, :, 0, None, None], cs[:, :, 1, None, None]) for cs in (rope[pos] for rope in ropes)]  # [N, P, 1, 1, hd]
        # prefill attention: causal, real keys only (a padding query sees itself, so nothing is NaN)
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        allowed = causal & (mask[:, None, :] | torch.eye(P, dtype=torch.bool, device=device))
        bias = torch.zeros(N, 1, 1, P, P, dtype=dtype, device=device).masked_fill_(~allowed[:, None, None], float("-inf"))
        ar = torch.arange(P, device=device)
        biases = self._per_layer(bias, lambda w: bias.masked_fill((ar[:, None] - ar[None, :]) >= w, float("-inf")))
        rope_of, swap, kv = self._rope_of, self._swap, self._kv

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:  # qkv [N, P, G, rep + 2, hd]
            qk = qkv[:, :, :, : rep + 1]
            if rope_of[li] is not None:
                cos, sin = css[rope_of[li]]
                qk = qk * cos + swap(qk) * sin  # HF's apply_rotary_pos_emb (the sign of rotate_half is in sin)
            q, k, v = qk[:, :, :, :rep].to(kv), qk[:, :, :, rep].to(kv), qkv[:, :, :, rep + 1].to(kv)  # (no-ops in fp32)
            write(li, k, v)
            qh = q.permute(0, 2, 3, 1, 4)  # [N, G, rep, P, hd]
            kh = k.permute(0, 2, 1, 3)[:, :, None]  # [N, G, 1, P, hd]
            vh = v.permute(0, 2, 1, 3)[:, :, None]
            att = torch.softmax((qh @ kh.transpose(-1, -2)) * self.scaling + biases[li], -1, dtype=torch.float32).to(kv)
            return (att @ vh).permute(0, 3, 1, 2, 4).reshape(N, P, H * hd).to(dtype)

        return self._head(self._run_layers(F.embedding(tokens, self._embed), attend)[:, -1])

    def _run_plain(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The decoder layers of Llama's layout on the residual stream ``x[..., D]``: per layer
        ``x += o_proj(attend(layer, qkv))`` with ``qkv[..., G, rep + 2, hd]`` the fused projection of ``norm(x)``, then
        ``x += MLP(norm(x))``. ``attend`` (rotary embedding, cache writes, attention) is where prefill, decode and extend
        differ; this body is shared so that every path computes a layer the same way. (:meth:`_run_general` is the same
        with the other families' norms; this one keeps their checks out of Llama's decode step.)"""
        G, rep, hd, act = self.n_kv, self.rep, self.head_dim, self.act
        D = x.shape[-1]
        for li, (w_in, eps_in, w_qkv, b_qkv, w_o, b_o, w_post, eps_post, w_gu, b_gu, I, w_d, b_d) in enumerate(self._layers):
            h = F.rms_norm(x, (D,), w_in, eps_in)
            qkv = _lin(h, w_qkv, b_qkv).view(*x.shape[:-1], G, rep + 2, hd)
            x = _lin_add(x, attend(li, qkv), w_o, b_o)
            h = F.rms_norm(x, (D,), w_post, eps_post)
            gu = _mm(h, w_gu, b_gu)  # the MLP's inside stays in the matrices' dtype, as under autocast
            a = act(gu[..., :I])
            a.mul_(gu[..., I:])
            x = _lin_add(x, a, w_d, b_d)
        return x

    def _run_general(self, x: torch.Tensor, attend) -> torch.Tensor:
        """:meth:`_run_plain` with every norm a family may have (see :mod:`~tokengym.agents.engine.families`): before
        and after each half of the layer (``None``: not there) and on the queries and keys before ``attend`` rotates them."""
        G, rep, hd, act, qk_mode = self.n_kv, self.rep, self.head_dim, self.act, self.family.qk_norm
        D = x.shape[-1]
        for li, ((w_in, eps_in, w_qkv, b_qkv, w_o, b_o, w_post, eps_post, w_gu, b_gu, I, w_d, b_d),
                 (w_qk, eps_qk, attn_out, mlp_out)) in enumerate(zip(self._layers, self._extra)):
            h = x if w_in is None else F.rms_norm(x, (D,), w_in, eps_in)
            qkv = _lin(h, w_qkv, b_qkv).view(*x.shape[:-1], G, rep + 2, hd)
            if w_qk is not None:
                _qk_norm(qkv, qk_mode, w_qk, eps_qk, rep)
            if attn_out is None:
                x = _lin_add(x, attend(li, qkv), w_o, b_o)
            else:
                x = x + F.rms_norm(_lin(attend(li, qkv), w_o, b_o), (D,), *attn_out)
            h = x if w_post is None else F.rms_norm(x, (D,), w_post, eps_post)
            gu = _mm(h, w_gu, b_gu)  # the MLP's inside stays in the matrices' dtype, as under autocast
            a = act(gu[..., :I])
            a.mul_(gu[..., I:])
            x = _lin_add(x, a, w_d, b_d) if mlp_out is None else x + F.rms_norm(_mm(a, w_d, b_d).to(x.dtype), (D,), *mlp_out)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (in the matrices' dtype) of final hidden states ``x[..., D]``: the final norm, then the LM head (and
        the final soft-capping ``cap * tanh(logits / cap)`` where the config sets one, as Gemma's forward does)."""
        logits = _lin(F.rms_norm(x, (x.shape[-1],), self._norm_w, self._norm_eps), self._head_t)
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def refill(self, rows: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Start new episodes in cache rows ``rows[R]``: encode their left-padded prompts ``tokens[R, P]`` (the width
        of the last prefill) into columns ``[0, P)``, forget everything after, and return their logits ``[R, V]``
        (continuous batching: a finished slot takes the next prompt while the other rows go on)."""
        with torch.autocast(self._embed.device.type, enabled=False):
            G, hd, P = self.n_kv, self.head_dim, self._P
            if tokens.shape[1] != P or mask.shape != tokens.shape:
                raise ValueError(f"refill() takes prompts [R, {P}] (the prefill's width), got {tuple(tokens.shape)}")
            if not self._ragged:
                self._to_ragged()
            device = self._embed.device
            rows, mask = rows.to(device).long(), mask.to(device).bool()
            rg = (rows[:, None] * G + self._arange_g).reshape(-1)

            def write(li: int, k: torch.Tensor, v: torch.Tensor) -> None:
                k_t, v_c = self._cache[li]
                k_t[rg, :, :P] = k.permute(0, 2, 3, 1).reshape(-1, hd, P)
                v_c[rg, :P] = v.permute(0, 2, 1, 3).reshape(-1, P, hd)

            logits = self._encode(tokens, mask, self._rope_tables(self._bias.shape[-1], self._embed.dtype, device), write)
            W = self._bias.shape[-1]
            col_ok = torch.zeros(len(rows), W, dtype=torch.bool, device=device)
            col_ok[:, :P] = mask
            self._bias[rg, 0] = torch.zeros(len(rows), W, dtype=self._bias.dtype, device=device).masked_fill_(
                ~col_ok, float("-inf")).repeat_interleave(G, 0)
            self._n_prompt[rows] = mask.long().sum(1)
            self._cur[rows] = 0
            return logits.float()

    def decode(self, tokens: torch.Tensor, hold: torch.Tensor | None = None) -> torch.Tensor:
        """Append one token per slot (``tokens[N]``, written at column ``P + step``); return logits ``[N, V]`` (fp32).

        ``hold[N]`` (bool): slots that stay where they are (a multi-turn row waiting for a reply): their token is
        computed but not kept, and the next token (or :meth:`extend`) overwrites its column."""
        dev_type = self._embed.device.type
        if hold is not None and not self._ragged:
            self._to_ragged()
        if torch.is_autocast_enabled(dev_type):  # the matrices' dtype was fixed at prefill; the rest stays explicit
            with torch.autocast(dev_type, enabled=False):
                return self._decode(tokens, hold)
        return self._decode(tokens, hold)

    def _decode(self, tokens: torch.Tensor, hold: torch.Tensor | None = None) -> torch.Tensor:
        if self._ragged:  # per-row columns, each row within its budget (finished rows write into the last column)
            return self._decode_ragged(tokens, hold)
        t = self._step
        if t >= self._capacity:
            raise RuntimeError(
                f"decode step {t + 1} exceeds max_new_tokens={self._capacity} given to prefill(); prefill again with a larger budget"
            )
        N = self._N
        if tokens.shape != (N,):
            raise ValueError(f"decode() takes one token per slot, shape ({N},); got {tuple(tokens.shape)}")
        col = self._P + t
        css = [rope.index_select(0, self._pos[t]) for rope in self._ropes]  # this step's [N, 2, hd], broadcast over heads
        bias = self._bias[:, :, : col + 1]
        # a sliding window starts at column col - window + 1 (every row is at the same column)
        los = [0 if w is None else max(0, col + 1 - w) for w in self._windows]
        attend = self._one_token_attention(css, [bias] * len(los), col, los)
        x = self._run_layers(F.embedding(tokens, self._embed), attend)  # [N, D]
        self._step = t + 1
        self._hi = col
        return self._head(x).float()

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (ascending indices into the current rows) in the cache and the per-row decode state:
        later steps take one token per kept row and cost only those rows (finished episodes leave the batch)."""
        G = self.n_kv
        keep = keep.to(self._bias.device).long()
        kg = (keep[:, None] * G + self._arange_g).reshape(-1)
        n = kg.numel()  # kept rows move to the front of the same storage (kg[i] >= i, so no row is overwritten unread)
        self._cache = [(k[:n].copy_(k.index_select(0, kg)), v[:n].copy_(v.index_select(0, kg))) for k, v in self._cache]
        self._bias = self._bias.index_select(0, kg)
        self._pos = self._pos[:, keep]
        self._n_prompt = self._n_prompt[keep]
        if self._cur is not None:
            self._cur = self._cur[keep]
        self._N = int(keep.numel())
        self._arange_ng = torch.arange(self._N * G, device=self._bias.device)

    # ------------------------------------------------------------------ multi-turn: rows at different columns
    def _to_ragged(self) -> None:
        """Switch to per-row columns: mask every generation column a row has not written yet (a row may now be
        ahead of another, and a reused cache holds stale columns)."""
        W = self._bias.shape[-1]
        self._cur = torch.full((self._N,), self._step, dtype=torch.long, device=self._bias.device)
        unwritten = torch.arange(W, device=self._bias.device)[None] >= (self._P + self._cur)[:, None]
        unwritten[:, : self._P] = False
        self._bias.masked_fill_(unwritten.repeat_interleave(self.n_kv, 0)[:, None], float("-inf"))
        self._ragged = True

    def _decode_ragged(self, tokens: torch.Tensor, hold: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`decode` with each row's token at its own column ``P + cur`` (rows past the budget are finished
        episodes whose tokens are never read: they write into the last column)."""
        N, G, P = self._N, self.n_kv, self._P
        if tokens.shape != (N,):
            raise ValueError(f"decode() takes one token per slot, shape ({N},); got {tuple(tokens.shape)}")
        W = self._bias.shape[-1]
        cur = self._cur.clamp(max=W - P - 1)
        colg = (P + cur).repeat_interleave(G)
        rowg = self._arange_ng
        self._bias[rowg, 0, colg] = 0.0
        css = [rope.index_select(0, self._n_prompt + cur) for rope in self._ropes]
        T = min(self._hi + 2, W)  # every row writes at most one column past the highest so far
        bias = self._bias[:, :, :T]
        ar = torch.arange(T, device=bias.device)
        biases = self._per_layer(bias, lambda w: bias.masked_fill(ar <= (colg - w)[:, None, None], float("-inf")))
        attend = self._one_token_attention(css, biases, (rowg, colg), [0] * len(biases))
        x = self._run_layers(F.embedding(tokens, self._embed), attend)
        self._step += 1
        self._cur = cur + 1 if hold is None else cur + (~hold.to(cur.device)).long()
        self._hi = T - 1
        return self._head(x).float()

    def _one_token_attention(self, css: list[torch.Tensor], biases: list[torch.Tensor], col, los: list[int]):
        """``attend`` for :meth:`_run_layers` on one new token per row (``qkv[N, G, rep + 2, hd]``): rotate its
        query and key by the layer's table of ``css`` (``[N, 2, hd]`` each), write key and value at column ``col`` of
        every row (an int), or at ``col = (cache rows, columns)`` (rows at their own columns), and attend over columns
        ``[los[layer], T)`` with the layer's ``biases[layer]`` (``T`` their width)."""
        N, G, rep, hd, scale = self._N, self.n_kv, self.rep, self.head_dim, self.scaling
        T = biases[0].shape[-1] if biases else 0
        rope_of, swap, kv = self._rope_of, self._swap, self._kv
        css = [(cs[:, 0, None, None], cs[:, 1, None, None]) for cs in css]

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:
            k_t, v_c = self._cache[li]
            qk = qkv[:, :, : rep + 1]
            if rope_of[li] is None:
                r = qk
            else:
                cos, sin = css[rope_of[li]]
                r = torch.addcmul(qk * cos, swap(qk), sin)  # [N, G, rep+1, hd]
            if isinstance(col, int):
                k_t[:, :, col].copy_(r[:, :, rep].view(N * G, hd))
                v_c[:, col].copy_(qkv[:, :, rep + 1].view(N * G, hd))
            else:
                k_t[col[0], :, col[1]] = r[:, :, rep].view(N * G, hd).to(kv)
                v_c[col] = qkv[:, :, rep + 1].view(N * G, hd).to(kv)
            lo = los[li]  # in a bf16 cache: scores and probabilities in bf16, the softmax computed in fp32 by its kernel
            s = torch.baddbmm(biases[li][..., lo:], r[:, :, :rep].reshape(N * G, rep, hd).to(kv), k_t[:, :, lo:T], alpha=scale)
            return torch.bmm(torch.softmax(s, -1), v_c[:, lo:T]).view(N, -1).to(qkv.dtype)

        return attend

    def extend(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Append ``lengths[r]`` tokens of ``tokens[R, K]`` (right-padded) to each row ``rows[r]``'s cache, at its own
        columns and positions (a batched, ragged prefill of only the new tokens: an env's reply); return the next-token
        logits ``[R, V]`` (fp32) after each row's last new token. Must run under ``no_grad``/``inference_mode``."""
        dev_type = self._embed.device.type
        with torch.autocast(dev_type, enabled=False):
            return self._extend(rows, tokens, lengths)

    def _extend(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        G, rep, hd, H, P = self.n_kv, self.rep, self.head_dim, self.n_heads, self._P
        R, K = tokens.shape
        device = self._embed.device
        rows, tokens, lengths = rows.to(device).long(), tokens.to(device), lengths.to(device).long()
        W = self._bias.shape[-1]
        if not self._ragged:
            self._to_ragged()
        cur = self._cur[rows]
        ar = torch.arange(K, device=device)
        cols = P + cur[:, None] + ar  # [R, K]
        if int((cols[:, 0] + lengths).max()) > W:
            raise RuntimeError(f"extend() past the cache's {W} columns: the env's budget should have truncated these rows")
        valid = ar[None] < lengths[:, None]
        cols = cols.clamp(max=W - 1)
        vr, vk = valid.nonzero(as_tuple=True)
        rg = (rows[vr, None] * G + self._arange_g).reshape(-1)  # every (row, new token) pair, per key-value head
        cg = cols[vr, vk, None].expand(-1, G).reshape(-1)
        self._bias[rg, 0, cg] = 0.0
        T = int(cols.max()) + 1
        self._hi = max(self._hi, T - 1)
        rows_g = (rows[:, None] * G + self._arange_g).reshape(-1)
        # attention over the row's own written columns, causal among the new tokens
        allowed = (self._bias[rows_g, 0, :T].view(R, G, T)[:, 0] == 0)[:, None, :] & \
            (torch.arange(T, device=device)[None, None] <= cols[:, :, None])  # [R, K, T]
        kv = self._kv
        att_bias = torch.zeros(R, 1, 1, K, T, dtype=kv, device=device).masked_fill_(~allowed[:, None, None], float("-inf"))
        at = (self._n_prompt[rows][:, None] + cols - P).clamp(max=W - 1)
        css = [(cs[:, :, 0, None, None], cs[:, :, 1, None, None]) for cs in (rope[at] for rope in self._ropes)]  # [R, K, 2, hd]
        ar_t = torch.arange(T, device=device)
        biases = self._per_layer(att_bias, lambda w: att_bias.masked_fill(
            ((cols[:, :, None] - ar_t) >= w)[:, None, None], float("-inf")))
        rope_of, swap = self._rope_of, self._swap

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:  # qkv [R, K, G, rep + 2, hd]
            k_t, v_c = self._cache[li]
            qk = qkv[:, :, :, : rep + 1]
            if rope_of[li] is None:
                r = qk
            else:
                cos, sin = css[rope_of[li]]
                r = torch.addcmul(qk * cos, swap(qk), sin)
            k_t[rg, :, cg] = r[vr, vk, :, rep].reshape(-1, hd).to(kv)
            v_c[rg, cg] = qkv[vr, vk, :, rep + 1].reshape(-1, hd).to(kv)
            keys = k_t[rows_g, :, :T].view(R, G, 1, hd, T)
            vals = v_c[rows_g, :T].view(R, G, 1, T, hd)
            q = r[:, :, :, :rep].permute(0, 2, 3, 1, 4).to(kv)  # [R, G, rep, K, hd]
            att = torch.softmax((q @ keys) * self.scaling + biases[li], -1)
            return (att @ vals).permute(0, 3, 1, 2, 4).reshape(R, K, H * hd).to(qkv.dtype)

        x = self._run_layers(F.embedding(tokens, self._embed), attend)  # [R, K, D]
        self._cur[rows] = cur + lengths
        return self._head(x[torch.arange(R, device=device), (lengths - 1).clamp(min=0)]).float()


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` if it is one of :data:`KV_DTYPES`, else ``ValueError`` naming the choices."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
    return kv_dtype


def kv_cache_dtype(kv_dtype: str, amp: torch.dtype | None, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the KV cache and of attention for a prefill under autocast to ``amp`` (``None``: no autocast) of a
    model in ``model_dtype``: ``amp`` under ``kv_dtype="autocast"``, or under ``"auto"`` where ``amp`` is native on
    ``device``; else ``model_dtype`` (where bf16 is emulated a bf16 cache saves memory but costs time)."""
    if amp is None or kv_dtype == "model" or amp == model_dtype:
        return model_dtype
    return amp if kv_dtype == "autocast" or half_is_fast(device, amp) else model_dtype


def _lin(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ W^T + b`` for a matrix from ``StaticDecoder._refresh`` (packed, or ``[in, out]``): the product
    is taken in ``w``'s dtype (as autocast would) and returned in ``a``'s dtype."""
    return _mm(a, w, b).to(a.dtype)


def _mm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_lin` returned in ``w``'s dtype (autocast's output dtype)."""
    x = a.to(w.dtype)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    if b is None:
        return x @ w
    return torch.addmm(b, x, w) if x.dim() == 2 else x @ w + b


def _lin_add(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x + a @ W^T (+ b)``, the residual add fused into the GEMM for a decode step's ``[N, D]`` rows when all
    dtypes agree; otherwise (prefill's and extend's ``[N, K, D]``, or autocast) a separate add."""
    if x.dim() != 2 or w.dtype != x.dtype or a.dtype != x.dtype:
        return x + _lin(a, w, b)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(a, x, w, b, "add")
    y = torch.addmm(x, a, w)
    return y if b is None else y + b


@functools.lru_cache(maxsize=None)
def _packed_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here for ``dtype`` and agrees with ``torch.mm`` (checked once)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, a, x = (torch.randn(*shape, generator=g) for shape in ((24, 40), (5, 40), (5, 24)))
        w, a = w.to(dtype), a.to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 5)
        ref = (a.float() @ w.float().t())
        out = torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "").float()
        tol = 1e-4 if dtype == torch.float32 else 0.1
        ok = (out - ref).abs().max().item() < tol * 40
        if dtype == x.dtype:
            fused = torch.ops.mkldnn._linear_pointwise.binary(a, x, packed, None, "add")
            ok = ok and (fused - (x + ref)).abs().max().item() < tol * 40
        return bool(ok)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (``None`` for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``x``'s last dimension with its two halves swapped (``rotate_half`` without the sign, which the decode
    paths fold into their sin table); a new tensor."""
    return x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2).flip(-2).view(x.shape)


def _swap_by(perm: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`_swap_halves` for a partial rotary embedding: ``perm`` swaps the halves of the rotated dimensions only."""
    return x.index_select(-1, perm)


def _qk_scale(mode: str | None, lw, G: int, rep: int, hd: int) -> torch.Tensor | None:
    """The q/k norm scales laid out like ``qkv[..., G, rep + 2, hd]``'s first ``rep + 1`` slots: ``[rep + 1, hd]`` for a
    per-head norm, ``[G, rep + 1, hd]`` for a norm over the whole projection (``None``: no q/k norm)."""
    if mode is None:
        return None
    wq, wk = lw.q_norm[0], lw.k_norm[0]
    if mode == "head":
        return torch.cat([wq.expand(rep, hd), wk[None]], 0).contiguous()
    return torch.cat([wq.reshape(G, rep, hd), wk.reshape(G, 1, hd)], 1).contiguous()


def _qk_norm(qkv: torch.Tensor, mode: str, w: torch.Tensor, eps: float, rep: int) -> None:
    """RMS-normalise the queries and keys of ``qkv[..., G, rep + 2, hd]`` in place (before RoPE): over each head's ``hd``
    values (``"head"``: Qwen3, Gemma 3) or over all of the q (k) projection's values (``"proj"``: OLMo 2)."""
    qk = qkv[..., : rep + 1, :]
    if mode == "head":
        qk.copy_(F.rms_norm(qk, (qk.shape[-1],), None, eps) * w)
        return
    q, k = qkv[..., :rep, :], qkv[..., rep: rep + 1, :]
    for part, scale in ((q, w[:, :rep]), (k, w[:, rep:])):
        part.mul_(torch.rsqrt(part.pow(2).mean((-3, -2, -1), keepdim=True) + eps)).mul_(scale)

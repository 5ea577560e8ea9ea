"""``Policy``: a causal LM that acts on ``TokenVectorEnv`` observations with its own KV cache.

Rollout API (the :class:`~tokengym.agents.engine.sampler.Sampler` protocol that :func:`tokengym.agents.collect`
drives; lockstep batches)::

    policy.begin_rollout()                                              # this rollout's sampling-stream key
    logits = policy.prefill(obs["tokens"][:, :P], obs["mask"][:, :P], max_new_tokens=M)  # prompts, once
    actions, logp = policy.sample(logits, ids=rows, steps=gen_len)      # on the device, no host sync
    obs, ... = env.step(actions)
    logits = policy.decode(actions)                                     # one token per slot
    logits[rows] = policy.extend(rows, reply, lengths)                  # multi-turn: the env's reply tokens
    policy.compact(live_rows)                                           # drop finished rows from the cache
    logits[rows] = policy.refill(rows, prompts, mask)                   # continuous batching: new episodes

Fast path: ``policy.prefill(tokens, mask, max_new_tokens=M)`` (what ``collect`` calls) runs supported
models (Llama, Mistral, Qwen2, Qwen3, Gemma 3, SmolLM3, Phi-3, OLMo 2) through :class:`~tokengym.agents.engine.fast_decode.StaticDecoder`:
a static KV cache laid out like the env buffer and a lean decode step written against the model's
weights, with the same numerics. Other models, ``fast_decode=False``, or ``prefill`` without
``max_new_tokens`` use the generic ``transformers`` path with its own cache; a model that falls back to it warns
once per ``Policy``, with the reason.

Generic API: ``policy.act(obs, prompt_len=P)`` works in any Gymnasium-style loop, in either autoreset
mode: it prefills new episodes itself (re-encoding the batch when only some slots restarted).

Training API: ``policy(tokens, mask, prompt_len)`` returns the log-probabilities (and optionally the
entropy) of the generated tokens with one full forward pass, chunked via
:func:`tokengym.agents.functional.token_logprobs`.

Position ids are always ``cumsum(mask) - 1``, so left padding in the prompt and padding after an
episode's end never shift a real token's position, in the cache or in the full pass.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Iterator

import torch
from torch import nn

import tokengym.agents.functional as Fn
from tokengym.agents.engine.fast_decode import StaticDecoder, check_kv_dtype, unsupported_reason
from tokengym.agents.engine.models import load_model, use_tokengym_attention
from tokengym.agents.engine.sampler import SamplerCapabilities
from tokengym.agents.runtime.sharding import unwrapped_class
from tokengym.rewards.common import quiet_transformers
from tokengym.rewards.packing import Bins, check_packing, head_logits, place, plan

__all__ = ["Policy", "AdapterDisabledReference", "inverse_cdf", "make_reference", "position_ids", "row_uniforms",
           "sample_logits", "lm_logprobs"]

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping products; ``>>`` made logical by masking)."""
    z = z + _GOLDEN
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def row_uniforms(key: int | torch.Tensor, ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per ``(key, ids[i], steps[i])``: a counter-based stream, so an episode's draw at a step
    depends only on the rollout's key, the episode's id and the step, never on which other rows share the batch
    (finished rows can leave it, new episodes can join it) or on the batch size. ``key`` may be one per row (signed
    int64): the generation seam's per-request streams ``(key ^ id, step)``."""
    k = key.long() if isinstance(key, torch.Tensor) else torch.full_like(ids, _signed(key & _MASK64))
    z = splitmix64(splitmix64(k ^ ids.long()) ^ steps.long())
    return ((z >> 40) & ((1 << 24) - 1)).double().mul_(2.0**-24).float()


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of real tokens: ``cumsum(mask) - 1`` (0 on leading padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def right_aligned(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)`` with each row rotated so that its newest real token sits in the last column (its trailing
    padding becomes left padding): the layout a prefill continues from."""
    width = tokens.shape[1]
    ar = torch.arange(width, device=tokens.device)
    cols = (ar - (width - 1 - (mask.long() * ar).argmax(1))[:, None]) % width
    return tokens.gather(1, cols), mask.gather(1, cols)


def sample_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits[N, V]``; return ``(tokens[N], logprobs[N])``.

    The log-probability is under the distribution actually sampled from (temperature, then top-k,
    then top-p). ``greedy`` takes the argmax and reports its log-probability under the temperature-scaled
    distribution. Everything stays on the device (no host sync). ``uniform[N]`` in [0, 1) switches from
    ``torch.multinomial`` to inverse-CDF sampling with one given uniform per row (data-parallel runs draw
    them from a stream shared by all ranks, see :mod:`tokengym.agents.runtime.distributed`).
    """
    logits = logits.float()
    if greedy:
        logp = torch.log_softmax(logits / max(temperature, 1e-6), -1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cum - sorted_logits.softmax(-1)) >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if uniform is not None:  # one softmax pass, no log-softmax of the whole vocabulary (the draw's log-prob is one log)
        probs = torch.softmax(logits, -1)
        tok = inverse_cdf(probs, uniform)
        return tok, probs.gather(-1, tok[:, None])[:, 0].log()
    logp = torch.log_softmax(logits, -1)
    tok = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of the cumulative sums ``cdf[N, K]``, the first column whose sum exceeds ``target[N, 1]``; where rounding
    puts the target at or past the row's total, the column where the row reaches its total (whose mass is > 0)."""
    total = cdf[:, -1:].contiguous()  # (searchsorted warns once, on screen, about a strided value tensor)
    return torch.minimum(torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, total))


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Inverse-CDF sampling: per row of ``probs[N, V]`` (non-negative, any total), the first token whose cumulative
    probability exceeds ``uniform[N]`` times the row's total; never a token of probability 0.

    Two levels, for speed: the blocks of ``block`` tokens by their sums, then the tokens of the one block each row
    lands in. A cumulative sum over the whole vocabulary is a serial pass that costs about as much as the softmax
    before it; the block sums are one vectorised pass. The result is the one-level search's except where rounding puts
    ``u`` at a token's boundary.

    Example:
        >>> probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(4, -1)  # blocks of 2: sums 0.1 and 0.9
        >>> inverse_cdf(probs, torch.tensor([0.0, 0.1, 0.69, 0.99]), block=2).tolist()
        [0, 2, 2, 3]
    """
    N, V = probs.shape
    whole = V - V % block
    sums = probs.unfold(1, block, block).sum(-1) if whole else probs.new_zeros(N, 0)  # a view: no copy of the rows
    if whole < V:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], 1)
    cdf = sums.cumsum(-1)
    target = uniform.to(cdf)[:, None] * cdf[:, -1:]
    b = _first_above(cdf, target)  # [N, 1]: the block, of mass > 0
    rest = (target - (cdf.gather(1, b) - sums.gather(1, b))).clamp_(min=0)  # the target's offset inside the block
    cols = b * block + torch.arange(block, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0).cumsum(-1)
    return (b * block + _first_above(inside, rest))[:, 0]


def lm_logprobs(model: nn.Module, bins: Bins, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int,
                temperature: float = 1.0, return_entropy: bool = False, return_logits: bool = False, allowed=None):
    """:meth:`~tokengym.agents.Policy.forward` on bins: log-probs ``[N, M]`` of ``tokens[:, P:]`` (0 where there is
    no real token to score), and with ``return_entropy`` the per-token entropy, with ``return_logits`` the logits
    ``[N, M, V]`` (0 where there is no real token); the LM head runs on the scored positions only."""
    N, M = tokens.shape[0], tokens.shape[1] - prompt_len
    logits, dst = head_logits(model, bins, mask, prompt_len)
    if temperature != 1.0:
        logits = logits / temperature
    labels = tokens[:, prompt_len:].reshape(-1)[dst][None]
    if allowed is not None:  # the scored tokens' allowed sets (``(index[N, M], table)``, see ``Policy.forward``)
        allowed = (allowed[0].reshape(-1)[dst][None], allowed[1])
    out = [place(Fn.token_logprobs(logits, labels, allowed=allowed)[0], dst, N, M)]  # float32 (float64 for a float64 model)
    if return_entropy:
        out.append(place(Fn.entropy(logits, allowed=allowed)[0], dst, N, M))
    if return_logits:
        out.append(logits.new_zeros(N * M, logits.shape[-1]).index_copy(0, dst, logits[0]).view(N, M, -1))
    return out[0] if len(out) == 1 else tuple(out)


class Policy(nn.Module):
    """A ``transformers`` causal LM + tokenizer that acts on token environments.

    It implements :class:`~tokengym.agents.engine.sampler.Sampler` (what ``collect`` drives): per-row streams,
    ``extend`` always; shared prefixes, ``compact`` and ``refill`` on the fast decode path (see :meth:`capabilities`).

    Args:
        model: any ``transformers`` causal LM (a preset, a local checkpoint, an in-memory model).
        tokenizer: its tokenizer (needs EOS and pad tokens).
        temperature: the sampling temperature.
        top_k: sample from the ``top_k`` most likely tokens (``0`` turns this filter off).
        top_p: sample from the smallest set of tokens whose probability reaches ``top_p`` (``1`` turns it off).
        seed: seeds the policy's own sampling generator.
        fast_decode: use the static-cache decode step for supported models when ``prefill`` is given
            ``max_new_tokens`` (see :mod:`tokengym.agents.engine.fast_decode`); ``False`` always takes the
            generic ``transformers`` path.
        kv_dtype: the fast decoder's KV cache and attention under autocast: ``"auto"`` (the autocast dtype where it is
            native: CUDA, CPUs with AVX512-BF16 or AMX; else the model's dtype), ``"model"`` or ``"autocast"``
            (:data:`~tokengym.agents.engine.fast_decode.KV_DTYPES`).
        packing: how :meth:`forward` lays out a batch: ``"off"`` (padded), ``"bins"`` (the real tokens packed
            into bins) or ``"auto"`` (bins where they save a fifth of the tokens); trainers set it from their
            config (:mod:`tokengym.rewards.packing`).

    Example:
        >>> import torch
        >>> from tokengym.envs import TokenVectorEnv
        >>> policy = Policy.from_pretrained("tiny")
        >>> env = TokenVectorEnv(2, "arithmetic")
        >>> obs, _ = env.reset(seed=0)
        >>> actions, logp = policy.act(obs, prompt_len=env.max_prompt_len)
        >>> actions.shape, bool((logp <= 0).all())
        (torch.Size([2]), True)
    """

    def __init__(self, model: nn.Module, tokenizer: Any, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 fast_decode: bool = True, packing: str = "off", kv_dtype: str = "auto"):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.model = use_tokengym_attention(model)  # sdpa -> fp32 attention for bf16 on CPU (models.ATTENTION)
        self.tokenizer = tokenizer
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache: Any = None
        self._ids: torch.Tensor | None = None  # the generic path's token history (to re-encode after an extend)
        self._mask: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None
        self.fast_decode = bool(fast_decode)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.packing = check_packing(packing)  # training forwards: off, bins or auto; trainers set it from their config
        self._fast: StaticDecoder | None = None
        self._fast_active = False
        self._warned_generic = False  # the generic-path notice is printed once per Policy
        self._stream_key: int | None = None  # this rollout's sampling-stream key (begin_rollout)
        self.row_offset = 0  # the first row's index in the global batch (data-parallel ranks)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, **kwargs: Any) -> "Policy":
        """A policy from a preset name (``"tiny"``, ``"small"``) or a local ``save_pretrained`` folder."""
        model, tok = load_model(name_or_path, device=device, dtype=dtype)
        policy = cls(model, tok, **kwargs)
        policy.source = str(name_or_path)  # what a remote rollout worker builds the same architecture from
        return policy

    def save_pretrained(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the model (safetensors) and tokenizer to ``path`` (``state_dict``: these weights instead of the
        model's own, e.g. the full weights of a sharded model)."""
        with quiet_transformers():
            self.model.save_pretrained(path, safe_serialization=True, **({} if state_dict is None else {"state_dict": state_dict}))
        self.tokenizer.save_pretrained(path)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    # ------------------------------------------------------------------ rollout API
    def _forward_cached(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        kw = {self._cache_kw: cache} if cache is not None else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
        self._cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1].float()

    def fast_path_reason(self, width: int | None = None) -> str | None:
        """``None`` if ``prefill(..., max_new_tokens=M)`` takes the fast path for ``width = P + M`` columns, else why not."""
        if not self.fast_decode:
            return "fast_decode=False"
        return unsupported_reason(self.model, width)

    def capabilities(self, width: int | None = None) -> SamplerCapabilities:
        """The :class:`~tokengym.agents.engine.sampler.Sampler` capabilities for a prefill of ``width`` columns.

        Shared prefixes, compaction and refill need the fast decode path (:meth:`fast_path_reason`); the generic
        path re-encodes for ``extend``. A subclass whose ``sample(self, logits, greedy=False)`` override predates the
        per-row streams keeps its own sampling: no ``row_streams``, hence no compaction.
        """
        why = self.fast_path_reason(width)
        try:
            params = inspect.signature(self.sample).parameters
            streams = "ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            streams = False
        fast = why is None
        return SamplerCapabilities(row_streams=streams, shared_prefix=fast, extend=True, compact=fast and streams,
                                   refill=fast, why_not=None if fast else f"the fast decode path is off: {why}")

    def load_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The trainer's new weights: ``None`` (the trainer updates this very module; the fast decoder rebuilds its
        fused weights at every prefill, so there is nothing to do) or a state dict to load into the model."""
        if state_dict is not None:
            self.model.load_state_dict(state_dict)

    @property
    def fast_path_active(self) -> bool:
        """Whether the current cache (from the last ``prefill``) is the fast static cache."""
        return self._fast_active

    def _fast_decoder(self, width: int) -> StaticDecoder | None:
        why = self.fast_path_reason(width)
        if why is not None:
            if self.fast_decode and not self._warned_generic:  # fast_decode=False is the user's own choice: no notice
                self._warned_generic = True
                warnings.warn(f"{unwrapped_class(self.model).__name__} rolls out on the generic transformers path "
                              f"(several times slower than the fast decoder): {why}", stacklevel=4)
            return None
        if self._fast is None or self._fast.source is not self.model or self._fast.kv_dtype != self.kv_dtype:
            self._fast = StaticDecoder(self.model, kv_dtype=self.kv_dtype)
        return self._fast

    def end_rollout(self) -> None:
        """Free what a rollout held (the fast decoder's fused weights and cache, or the generic KV cache); the next
        :meth:`prefill` starts afresh. ``collect`` calls it, so the update's peak memory does not include them."""
        if self._fast is not None:
            self._fast.release()
        self._stream_key = None
        self._cache = self._mask = self._pos = self._seen = self._ids = None

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, mask: torch.Tensor, max_new_tokens: int | None = None, copies: int = 1) -> torch.Tensor:
        """Encode left-padded prompts ``tokens[N, P]`` (``mask`` 1 on real tokens), start a fresh KV cache.

        With ``max_new_tokens`` (the env's budget M) a supported model gets a static cache of ``P + M``
        columns and the fast decode step (at most M ``decode`` calls follow); otherwise the generic path.
        ``copies=G`` says the rows are groups of ``G`` identical prompts: the fast path encodes each once.
        Returns the next-token logits ``[N, V]`` (float32).
        """
        self._seen = None  # act() re-encodes after a prefill it did not make
        fast = self._fast_decoder(tokens.shape[1] + int(max_new_tokens)) if max_new_tokens is not None else None
        self._fast_active = fast is not None
        if fast is not None:
            self._cache = self._mask = self._pos = None
            return fast.prefill(tokens.to(self.device), mask.to(self.device), int(max_new_tokens), copies)
        mask = mask.long()
        pos = position_ids(mask)
        self._mask, self._pos, self._ids = mask, pos[:, -1], tokens
        return self._forward_cached(tokens, mask, pos, None)

    def decode(self, tokens: torch.Tensor, hold: torch.Tensor | None = None) -> torch.Tensor:
        """Append one token per slot (``tokens[N]``) to the cache; return the next-token logits ``[N, V]``.

        ``hold[N]`` (bool): slots whose token the env ignored (a multi-turn row waiting for a slow reply); their
        history does not grow, and the reply that comes later is appended with :meth:`extend`.
        """
        if torch.is_inference_mode_enabled():  # skip re-entering inference mode on every token (rollouts)
            return self._decode(tokens, hold)
        with torch.inference_mode():
            return self._decode(tokens, hold)

    def _decode(self, tokens: torch.Tensor, hold: torch.Tensor | None = None) -> torch.Tensor:
        if self._fast_active:
            return self._fast.decode(tokens, hold)
        if self._mask is None:
            raise RuntimeError("decode() before prefill(): encode the prompts first")
        new = self._mask.new_ones(self._mask.shape[0], 1) if hold is None else (~hold.to(self.device))[:, None].to(self._mask.dtype)
        self._mask = torch.cat([self._mask, new], 1)
        if self._ids is not None:
            self._ids = torch.cat([self._ids, tokens[:, None].to(self._ids)], 1)
        self._pos = self._pos + new[:, 0].to(self._pos.dtype)
        return self._forward_cached(tokens[:, None], self._mask, self._pos[:, None], self._cache)

    @torch.inference_mode()
    def extend(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Append ``lengths[r]`` tokens of ``tokens[R, K]`` (right-padded; an env's reply) to the cache of each slot
        ``rows[r]``, after the tokens it already holds; return the next-token logits ``[R, V]`` of those slots.

        The fast path runs one batched, ragged prefill of only the new tokens at each row's own positions. The generic
        path re-encodes every slot's history with the reply appended (what a plain ``generate`` loop must do).
        """
        rows = torch.as_tensor(rows, device=self.device).long()
        tokens, lengths = tokens.to(self.device), torch.as_tensor(lengths, device=self.device).long()
        if self._fast_active:
            return self._fast.extend(rows, tokens, lengths)
        if self._ids is None:
            raise RuntimeError("extend() before prefill(): encode the prompts first")
        n = torch.zeros(self._ids.shape[0], dtype=torch.long, device=self.device)
        n[rows] = lengths
        add = torch.full((self._ids.shape[0], tokens.shape[1]), int(self.tokenizer.pad_token_id), dtype=self._ids.dtype, device=self.device)
        add[rows] = tokens.to(self._ids.dtype)
        keep = torch.arange(tokens.shape[1], device=self.device)[None] < n[:, None]
        ids, mask = torch.cat([self._ids, add], 1), torch.cat([self._mask.bool(), keep], 1)
        return self.prefill(*right_aligned(ids, mask))[rows]

    def begin_rollout(self) -> None:
        """Start a rollout's sampling stream: one key drawn from the policy's generator (saved in checkpoints), from
        which :meth:`sample` derives each episode's per-step uniforms (see :func:`row_uniforms`)."""
        self._stream_key = self.draw_key()

    def draw_key(self) -> int:
        """A rollout's stream key, drawn from the policy's generator (what :meth:`begin_rollout` keys a rollout by)."""
        return int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))

    def sample(self, logits: torch.Tensor, greedy: bool = False, ids: torch.Tensor | None = None,
               steps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample with the policy's settings; see :func:`sample_logits`.

        Where the rows' episode ``ids[n]`` and token ``steps[n]`` are given (what ``collect`` does, after
        :meth:`begin_rollout`), each row's uniform comes from :func:`row_uniforms` (inverse-CDF sampling): a row's
        token does not depend on the rest of the batch, so finished rows can be dropped from it without changing any
        result. A data-parallel rank numbers its rows from ``row_offset`` (its first row in the global batch), so it
        samples what those rows of a 1-process rollout would. Without ids, ``torch.multinomial`` draws from the
        policy's generator.
        """
        uniform = None
        if not greedy and ids is not None and self._stream_key is not None:
            uniform = row_uniforms(self._stream_key, ids.to(logits.device) + self.row_offset, steps.to(logits.device))
        return sample_logits(logits, self.temperature, self.top_k, self.top_p, greedy, self.generator, uniform)

    @torch.inference_mode()
    def refill(self, rows: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Start new episodes in cache rows ``rows`` from prompts ``tokens[R, P]`` (the last prefill's width) while the
        other rows go on; return their next-token logits ``[R, V]``. Fast path only (continuous batching)."""
        if not self._fast_active:
            raise RuntimeError("refill() needs the fast decode path (a prefill with max_new_tokens on a supported model)")
        return self._fast.refill(torch.as_tensor(rows, device=self.device), tokens.to(self.device), mask.to(self.device))

    def compact(self, keep: torch.Tensor) -> bool:
        """Keep only the cache rows ``keep`` (ascending indices) for the rest of the rollout, so decode steps cost only
        the live rows; returns ``False`` (nothing changed) on the generic ``transformers`` path."""
        if not self._fast_active:
            return False
        self._fast.compact(keep.to(self.device))
        return True

    @torch.inference_mode()
    def act(self, obs: dict[str, torch.Tensor], prompt_len: int, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One action per slot for an env observation (``prompt_len`` = the env's ``max_prompt_len``).

        New episodes are detected from the observation (no generated tokens yet). When every slot is
        new the prompts are prefilled; when only some restarted (``next_step`` autoreset) or a multi-turn env
        appended a reply, the whole buffer is re-encoded (each row right-aligned on its newest token); otherwise the newest token
        of each slot is decoded. This is the generic path; ``collect`` uses the faster lockstep API.
        """
        tokens, mask = obs["tokens"].to(self.device), obs["mask"].to(self.device)
        gen = mask[:, prompt_len:].long().sum(1)
        fresh = gen == 0
        jumped = (gen - self._seen > 1).any() if self._seen is not None else fresh.any()  # an env reply came in
        all_fresh, any_fresh, any_jump = (bool(x) for x in torch.stack([fresh.all(), fresh.any(), jumped]).tolist())
        if all_fresh:
            logits = self.prefill(tokens[:, :prompt_len], mask[:, :prompt_len])
        elif any_fresh or any_jump or self._seen is None:
            width = prompt_len + int(gen.max())  # re-encode every slot
            logits = self.prefill(*right_aligned(tokens[:, :width], mask[:, :width]))
        else:
            last = tokens.gather(1, (prompt_len + gen - 1).unsqueeze(1))[:, 0]
            new = gen > self._seen  # finished slots get no new token: feed a masked pad
            logits = self.decode(torch.where(new, last, self.tokenizer.pad_token_id))
            self._mask[:, -1] = new.long()
        self._seen = gen
        return self.sample(logits, greedy)

    # ------------------------------------------------------------------ training API
    def forward(
        self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int, return_entropy: bool = False,
        return_logits: bool = False, allowed: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Log-probabilities ``[N, M]`` of the generated tokens ``tokens[:, P:]`` under the policy.

        One forward pass over ``tokens[N, P + M]``; logits are divided by the sampling temperature so
        that they match the rollout's log-probabilities. Values at padding positions are meaningless:
        multiply by the action mask ``mask[:, P:]``. With ``return_entropy`` also the per-token entropy, with
        ``return_logits`` also those logits ``[N, M, V]`` (after the entropy; distillation's ``topk`` and ``full``).
        ``self.packing`` (``off``, ``bins``, ``auto``) runs the real tokens packed into bins instead (equal up to
        float rounding, 0 at padding: :mod:`~tokengym.rewards.packing`). ``allowed`` (a rollout's
        :class:`~tokengym.envs.masks.TokenMasks` for these columns, or ``(index[N, M], table[U, V])``): the log-probs and
        entropies are of the masked distribution each token was sampled from (the logits stay unmasked).
        """
        allowed = allowed.pair() if hasattr(allowed, "pair") else allowed
        bins = plan(self.packing, self.model, tokens, mask)
        if bins is not None:
            return lm_logprobs(self.model, bins, tokens, mask, prompt_len, self.temperature, return_entropy, return_logits,
                               allowed)
        m = tokens.shape[1] - prompt_len
        out = self.model(input_ids=tokens, attention_mask=mask.long(), position_ids=position_ids(mask), logits_to_keep=m + 1)
        logits = out.logits[:, :-1]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        labels = tokens[:, prompt_len:]
        if allowed is not None:  # padding may hold any token: score it as an unmasked position
            allowed = (torch.where(mask[:, prompt_len:].bool(), allowed[0], 0), allowed[1])
        outs = [Fn.token_logprobs(logits, labels, allowed=allowed)]
        if return_entropy:
            outs.append(Fn.entropy(logits, mask[:, prompt_len:], allowed=allowed))
        if return_logits:
            outs.append(logits)
        return outs[0] if len(outs) == 1 else tuple(outs)


class AdapterDisabledReference:
    """The reference policy of a LoRA-trained policy: the same model with its ``peft`` adapter disabled.

    No second copy of the weights is kept; calling it runs ``policy(...)`` inside :meth:`disabled`.
    Code that needs more than log-probs of a ``[N, P + M]`` batch (e.g. a custom forward of
    ``policy.model``) runs it inside ``with ref.disabled():`` too.
    """

    def __init__(self, policy: Policy):
        self.policy = policy

    @contextlib.contextmanager
    def disabled(self) -> Iterator[Policy]:
        """Context in which ``self.policy`` *is* the reference: adapter off, eval mode, no autograd (all restored on exit)."""
        model = self.policy.model
        was_training = model.training
        model.eval()  # as a frozen copy would be: no dropout in reference log-probs
        try:
            with torch.no_grad(), model.disable_adapter():
                yield self.policy
        finally:
            model.train(was_training)

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int, **kwargs: Any) -> torch.Tensor:
        with self.disabled() as ref:
            return ref(tokens, mask, prompt_len, **kwargs)


def make_reference(policy: Policy):
    """A frozen reference for ``policy``: ``ref(tokens, mask, prompt_len) -> logp[N, M]``.

    A ``peft`` model (LoRA) gets :class:`AdapterDisabledReference` (no extra weights); any other model a
    frozen deep copy wrapped in a :class:`Policy` with the same temperature.
    """
    from tokengym.agents.engine.models import frozen_copy

    if getattr(policy.model, "peft_config", None) and hasattr(policy.model, "disable_adapter"):
        return AdapterDisabledReference(policy)
    return type(policy)(frozen_copy(policy.model), policy.tokenizer, temperature=policy.temperature,
                        packing=getattr(policy, "packing", "off"))

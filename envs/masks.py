"""Action masks: the tokens an env allows at each step, and the compact record a rollout keeps of them.

Where one token is one action, a grammar is an action mask. The env exposes it the way sb3-contrib's MaskablePPO reads
it (``env.action_masks()``; a single :class:`~tokengym.envs.TokenEnv` also puts it in ``info["action_mask"]``) and
rejects a forbidden action in one line. Masks come from a grammar (``llguidance``: a JSON schema, a regex or a Lark
grammar; the ``grammar`` extra) or from a callable ``fn(sample, generated_ids) -> allowed``.

A rollout samples from the masked, renormalised distribution and stores each token's allowed set as
:class:`TokenMasks`: every distinct set once, bit-packed, and one small index per token, never ``[N, M, V]`` booleans.
The trainer then scores pi_old, pi_theta and the reference under the same sets, so the ratios are exact.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["TokenMasks", "ActionMasker", "GrammarDeadEnd", "grammar_text", "mask_metrics", "pack_bits", "unpack_bits", "GRAMMAR_EXTRA"]

GRAMMAR_EXTRA = "grammar"
"""The extra that installs the grammar library: ``pip install 'tokengym[grammar]'``."""

_KINDS = ("json_schema", "regex", "lark")


def _llguidance():
    try:
        import llguidance

        with warnings.catch_warnings():  # its torch.compile import warns about torch.jit (torch's own deprecation),
            warnings.simplefilter("ignore", DeprecationWarning)  # which the CLI's warning hook would print
            import llguidance.torch  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise ImportError(f"grammar masks need llguidance, which is not installed: pip install "
                          f"'tokengym[{GRAMMAR_EXTRA}]'") from None
    return llguidance


def grammar_text(spec: Any) -> str:
    """The llguidance grammar for ``spec``: ``{"json_schema": schema}`` (a dict or JSON text), ``{"regex": pattern}``
    or ``{"lark": grammar}``. JSON schemas are compact (no optional whitespace), so every call has one spelling."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in _KINDS:
        raise ValueError(f"a grammar is a dict with one key of {list(_KINDS)}, e.g. {{'regex': '[0-9]+'}}; got {spec!r:.80}")
    kind, body = next(iter(spec.items()))
    m = _llguidance().LLMatcher
    if kind == "json_schema":
        schema = json.loads(body) if isinstance(body, str) else body
        return m.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    return m.grammar_from_regex(str(body)) if kind == "regex" else m.grammar_from_lark(str(body))


# ---------------------------------------------------------------------------------------------- bit packing
_BITS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., V]`` -> uint8 ``[..., ceil(V / 8)]``; token ``8b + j`` is bit ``j`` of byte ``b`` (llguidance's
    order, read as bytes)."""
    V = allowed.shape[-1]
    pad = (-V) % 8
    a = torch.nn.functional.pad(allowed.to(torch.uint8), (0, pad)).view(*allowed.shape[:-1], -1, 8)
    return (a * _BITS.to(a.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: uint8 ``[..., ceil(V / 8)]`` -> bool ``[..., V]``."""
    bits = (packed[..., None] & _BITS.to(packed.device)) != 0
    return bits.reshape(*packed.shape[:-1], -1)[..., :vocab_size]


# ---------------------------------------------------------------------------------------------- the record
class TokenMasks:
    """The allowed sets a batch of episodes was sampled under.

    ``index[N, M]`` (int32, aligned with the generated columns ``tokens[:, P:]``): 0 where the token was not masked
    (every token allowed, and every non-action column), ``k`` where it was sampled under ``table[k]``.
    ``table[U, ceil(V / 8)]`` (uint8): each distinct allowed set once, bit-packed; row 0 allows everything.

    Example:
        >>> allowed = torch.tensor([[[True, False, True], [True, True, True]]])
        >>> tm = TokenMasks.from_dense(allowed)
        >>> tm.index.tolist(), tm.table.shape[0]
        ([[1, 0]], 2)
        >>> bool((tm.dense() == allowed).all())
        True
    """

    def __init__(self, index: torch.Tensor, table: torch.Tensor, vocab_size: int):
        if index.dim() != 2 or table.dim() != 2 or table.dtype != torch.uint8 or table.shape[1] != -(-vocab_size // 8):
            raise ValueError(f"TokenMasks needs index [N, M] and a uint8 table [U, {-(-vocab_size // 8)}], got "
                             f"{tuple(index.shape)} and {table.dtype} {tuple(table.shape)}")
        self.index, self.table, self.vocab_size = index.to(torch.int32), table, int(vocab_size)

    @classmethod
    def from_dense(cls, allowed: torch.Tensor) -> "TokenMasks":
        """From bool ``[N, M, V]`` (tests and small vocabularies); all-true positions get index 0."""
        N, M, V = allowed.shape
        index = torch.arange(1, N * M + 1, device=allowed.device).view(N, M)
        ones = pack_bits(torch.ones(1, V, dtype=torch.bool, device=allowed.device))
        return cls._distinct(index, torch.cat([ones, pack_bits(allowed.reshape(N * M, V))]), V)

    @classmethod
    def _distinct(cls, index: torch.Tensor, table: torch.Tensor, V: int) -> "TokenMasks":
        """``index`` into ``table`` (row 0 all ones) with every set stored once, row 0 still the all-ones set (and
        every position whose set allows everything pointing at it)."""
        uniq, inv = torch.unique(table, dim=0, return_inverse=True)
        ones = int(inv[0])
        order = torch.arange(len(uniq), device=table.device)
        order = torch.cat([order[ones : ones + 1], order[:ones], order[ones + 1 :]])  # the all-ones set first
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order), device=table.device)
        return cls(where[inv][index.long()], uniq[order], V)

    def dense(self) -> torch.Tensor:
        """Bool ``[N, M, V]`` (for tests; training reads :meth:`pair`)."""
        return unpack_bits(self.table, self.vocab_size)[self.index.long()]

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index[N, M] int64, table[U, V] bool)``: what :func:`tokengym.agents.functional.token_logprobs` takes."""
        return self.index.long(), unpack_bits(self.table, self.vocab_size)

    @property
    def masked(self) -> torch.Tensor:
        """Bool ``[N, M]``: the token was sampled under a mask that forbade something."""
        return self.index != 0

    def select(self, rows: torch.Tensor | Sequence[int]) -> "TokenMasks":
        return TokenMasks(self.index[torch.as_tensor(rows, device=self.index.device)], self.table, self.vocab_size)

    def columns(self, m: int) -> "TokenMasks":
        """The first ``m`` generated columns."""
        return TokenMasks(self.index[:, :m], self.table, self.vocab_size)

    def to(self, device: Any) -> "TokenMasks":
        return TokenMasks(self.index.to(device), self.table.to(device), self.vocab_size)

    @staticmethod
    def cat(parts: Sequence["TokenMasks | None"]) -> "TokenMasks | None":
        """The rows of ``parts`` in order, each distinct set stored once (``None`` for parts that all hold no masks)."""
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ValueError("cannot concatenate rollouts with and without action masks")
        V, dev = parts[0].vocab_size, parts[0].index.device
        tables, index, offset = [parts[0].table[:1]], [], 0
        for p in parts:
            index.append(torch.where(p.index > 0, p.index + offset, 0))
            tables.append(p.table[1:].to(dev))
            offset += p.table.shape[0] - 1
        return TokenMasks._distinct(torch.cat(index), torch.cat(tables), V)  # a set two parts share: stored once

    def state(self) -> dict[str, Any]:
        """Plain tensors and an int, for ``torch.save`` / ``torch.load(weights_only=True)``."""
        return {"index": self.index, "table": self.table, "vocab_size": self.vocab_size}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> "TokenMasks | None":
        return None if state is None else cls(state["index"], state["table"], state["vocab_size"])

    @property
    def nbytes(self) -> int:
        return self.index.numel() * 4 + self.table.numel()

    def __repr__(self) -> str:
        return f"TokenMasks({tuple(self.index.shape)}, {self.table.shape[0]} sets of {self.vocab_size})"


def mask_metrics(masks: TokenMasks, action_mask: torch.Tensor) -> dict[str, float]:
    """For the logs: the fraction of the agent's tokens sampled under a mask (``mask/masked_fraction``), of those forced
    (one allowed token: ``mask/forced_fraction``), and the distinct sets (``mask/sets``)."""
    act = action_mask.bool()
    n = max(int(act.sum()), 1)
    sizes = unpack_bits(masks.table, masks.vocab_size).sum(1)
    forced = (sizes[masks.index.long()] == 1) & act & masks.masked
    return {"mask/masked_fraction": float((masks.masked & act).sum()) / n, "mask/forced_fraction": float(forced.sum()) / n,
            "mask/sets": float(masks.table.shape[0] - 1)}


# ---------------------------------------------------------------------------------------------- the env's side
class EveryTurn:
    """``spec_for`` of an env given one ``grammar``: the same grammar for every agent turn (picklable)."""

    def __init__(self, grammar: Any):
        self.grammar = grammar

    def __call__(self, sample: dict, turn: int) -> Any:
        return self.grammar


def _ll_tokenizer(tokenizer: Any, n_vocab: int | None = None):
    """An llguidance tokenizer for ``tokenizer`` (cached): from its JSON where llguidance reads it, else
    (:func:`token_list_tokenizer`) from its token strings (the bundled char tokenizer, whose decoder it does not)."""
    cached = _LL_CACHE.get((id(tokenizer), n_vocab))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    _llguidance()
    try:
        import llguidance.hf

        llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab)
    except (ValueError, TypeError):
        llt = token_list_tokenizer(tokenizer, n_vocab)
    _LL_CACHE[(id(tokenizer), n_vocab)] = (tokenizer, llt)
    return llt


def token_list_tokenizer(tokenizer: Any, n_vocab: int | None = None):
    """An llguidance tokenizer built from ``tokenizer``'s token strings, one per id (ids past its length, up to
    ``n_vocab``, are specials no grammar allows): for a tokenizer whose decoder llguidance does not recognise."""
    llg = _llguidance()
    n = max(n_vocab or 0, len(tokenizer))

    class _Plain:  # what llguidance.TokenizerWrapper reads
        eos_token_id = tokenizer.eos_token_id
        bos_token_id = tokenizer.bos_token_id
        tokens = [(tokenizer.convert_ids_to_tokens(i) or "").encode() if i < len(tokenizer) else f"<|unused{i}|>".encode()
                  for i in range(n)]
        special_token_ids = sorted({*tokenizer.all_special_ids, *range(len(tokenizer), n)})

        def __call__(self, s: str | bytes) -> list[int]:
            return tokenizer(s if isinstance(s, str) else s.decode(), add_special_tokens=False)["input_ids"]

    return llg.LLTokenizer(llg.TokenizerWrapper(_Plain()))


_LL_CACHE: dict[tuple[int, int | None], tuple[Any, Any]] = {}
"""llguidance tokenizers by the tokenizer they were built from (building one takes about a second)."""


class GrammarDeadEnd(ValueError):
    """An episode's grammar (or ``action_mask_fn``) allows no token where the episode must go on: the run stops with
    this one line. :func:`~tokengym.envs.grammar_check.check_grammar` finds most such grammars before a run starts."""


class ActionMasker:
    """The env's per-slot mask state: an llguidance matcher per slot (grammar) or the slot's prefix (callable).

    ``spec_for(sample, turn)`` gives the grammar (or ``None``: that turn is free) of each agent turn; ``fn(sample,
    generated_ids)`` returns ``None`` (everything allowed), a bool array ``[V]`` or a list of allowed ids. Masks are
    computed once per step (:meth:`allowed`), checked against the actions, and recorded into a table of distinct sets.
    """

    def __init__(self, n: int, m: int, vocab_size: int, tokenizer: Any, device: torch.device,
                 spec_for: Callable[[dict, int], Any] | None = None, fn: Callable | None = None):
        self.n, self.m, self.V, self.tokenizer, self.device = n, m, vocab_size, tokenizer, device
        self.spec_for, self.fn = spec_for, fn
        self.W8, self.W4 = -(-vocab_size // 8), 4 * -(-vocab_size // 32)  # bytes per set: stored, and as int32 words
        self.index = torch.zeros((n, m), dtype=torch.int32, device=device)
        self._rows: list[bytes] = [bytes(pack_bits(torch.ones(vocab_size, dtype=torch.bool)).numpy())]
        self._ids: dict[bytes, int] = {self._rows[0]: 0}
        self._matchers: list[Any] = [None] * n  # grammar: a matcher per slot (None: free turn)
        self._specs: list[Any] = [None] * n  # the grammar of each slot's current turn
        self._samples: list[dict] = [{}] * n
        self._prefix: list[list[int]] = [[] for _ in range(n)]  # the current turn's tokens (callable; messages)
        self._cache: torch.Tensor | None = None  # packed [N, W4] of the current step, on the device
        self._host: np.ndarray | None = None  # the same, on the host (what take() keys the sets by)
        self._grammars: dict[str, Any] = {}
        self._real = self._real_tokens()  # what a step's dead-end check counts (once, not per step)
        if spec_for is not None:
            self._llt = _ll_tokenizer(tokenizer)
            self._executor = _llguidance().LLExecutor()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without llguidance's objects; unpickling rebuilds each slot's matcher from its turn's grammar and the
        tokens of the turn so far (an async run's workers receive the env pickled)."""
        state = dict(self.__dict__)
        for k in ("_llt", "_executor"):
            state.pop(k, None)
        state["_matchers"], state["_cache"], state["_host"] = [None] * self.n, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.spec_for is not None:
            self._llt = _ll_tokenizer(self.tokenizer)
            self._executor = _llguidance().LLExecutor()
            for s, spec in enumerate(self._specs):
                if spec is not None:
                    self._matchers[s] = mt = self._matcher(spec)
                    for t in self._prefix[s]:
                        mt.consume_token(t)

    # -- episode and turn starts
    def start(self, slots: Sequence[int], samples: Sequence[dict]) -> None:
        """New episodes in ``slots``: their first turn's grammar, an empty prefix, their index cleared."""
        for s, sample in zip(slots, samples):
            self._samples[s] = sample
        self.index[torch.as_tensor(list(slots), device=self.device)] = 0
        self.next_turn(slots, [0] * len(slots))

    def next_turn(self, slots: Sequence[int], turns: Sequence[int]) -> None:
        """Agent turn ``turns[i]`` starts in ``slots[i]`` (after the env's reply): its own grammar, from its start."""
        for s, t in zip(slots, turns):
            self._prefix[s] = []
            if self.spec_for is not None:
                spec = self.spec_for(self._samples[s], int(t))
                self._specs[s] = spec
                self._matchers[s] = None if spec is None else self._matcher(spec)
        self._cache = None

    def new_matcher(self, spec: Any):
        """A fresh llguidance matcher of grammar ``spec`` at its start, on the env's tokenizer (what
        :func:`~tokengym.envs.grammar_check.check_grammar` walks); ``ValueError`` if it does not compile."""
        return self._matcher(spec)

    def _matcher(self, spec: Any):
        key = json.dumps(spec, sort_keys=True, default=str)
        if key not in self._grammars:
            self._grammars[key] = grammar_text(spec)
        llg = _llguidance()
        mt = llg.LLMatcher(self._llt, self._grammars[key])
        if mt.is_error():
            raise ValueError(f"the grammar {spec!r:.80} does not compile: {mt.get_error()}")
        return mt

    def engine_grammar(self, slot: int) -> Any:
        """The grammar an inference engine applies itself to ``slot``'s generation from here (``None``: a free turn);
        refused in one line where an engine cannot reproduce the env's mask (a callable, or a turn already begun)."""
        if self.spec_for is None:
            raise ValueError("masks from an action_mask_fn are applied token by token: a generation backend (vLLM, a "
                             "remote worker) cannot apply them; use the tokengym sampler, or a grammar")
        if self._specs[slot] is not None and self._prefix[slot]:
            raise ValueError(f"env row {slot} is {len(self._prefix[slot])} tokens into a turn under a grammar, but a "
                             "generation backend starts a grammar at its beginning")
        return self._specs[slot]

    # -- the current step
    def packed(self, live: torch.Tensor) -> torch.Tensor:
        """Packed allowed sets ``[N, 4 * ceil(V / 32)]`` (uint8, llguidance's bit order, viewable as its int32 words; on
        the env's device) of the current step; rows not in ``live`` (bool ``[N]``) allow everything. Raises naming the
        row and its prefix where a live row allows nothing. Computed once per step (until :meth:`take` or a turn
        start): later calls of the step pass the same rows or fewer (the env's live rows, then those it acts on)."""
        if self._cache is not None:
            return self._cache
        out = np.full((self.n, self.W4), 255, dtype=np.uint8)
        rows = live.nonzero().flatten().tolist()
        if self.spec_for is not None:
            import llguidance.torch as lt

            todo = [s for s in rows if self._matchers[s] is not None]
            if todo:
                bm = lt.allocate_token_bitmask(len(todo), self._llt.vocab_size)
                lt.fill_next_token_bitmask_par(self._executor, [(self._matchers[s], i) for i, s in enumerate(todo)], bm)
                out[todo] = bm.numpy().view(np.uint8)[:, : self.W4]
        else:
            for s in rows:
                out[s] = self._from_fn(s)
        self._tail(out)
        empty = np.flatnonzero(~(out[rows] & self._real).any(1)) if rows else []
        if len(empty):
            s = rows[int(empty[0])]
            prefix = self.tokenizer.decode(self._prefix[s])
            src = "its grammar" if self.spec_for is not None else "action_mask_fn"
            raise GrammarDeadEnd(f"the action mask of env row {s} allows no token after the prefix {prefix!r} ({src} is "
                                 "at a dead end): fix the grammar, or give the episode more room")
        self._host, self._cache = out, torch.from_numpy(out).to(self.device)
        return self._cache

    def _real_tokens(self) -> np.ndarray:
        """Packed ``[W4]``: the tokens that count as a way on. Under a grammar every one but the specials (unk, pad,
        bos; never EOS) that llguidance still allows at a dead end, where no real token can go on."""
        real = np.full(self.W4, 255, dtype=np.uint8)
        if self.spec_for is not None:
            tok = self.tokenizer
            ids = {getattr(tok, a, None) for a in ("unk_token_id", "pad_token_id", "bos_token_id")}
            for t in ids - {None, getattr(tok, "eos_token_id", None)}:
                if 0 <= t < self.V:
                    real[t // 8] &= ~np.uint8(1 << (t % 8))
        return real

    def _tail(self, out: np.ndarray) -> None:
        """Clear the bits past the vocabulary (they are not tokens)."""
        if self.V % 8:
            out[:, self.W8 - 1] &= (1 << (self.V % 8)) - 1
        out[:, self.W8:] = 0

    def _from_fn(self, s: int) -> np.ndarray:
        """Row ``s``'s packed set from ``action_mask_fn`` (all ones where it returns ``None``)."""
        got = self.fn(self._samples[s], list(self._prefix[s]))
        row = np.full(self.W4, 255, dtype=np.uint8)
        if got is None:
            return row
        a = np.asarray(got)
        if a.dtype != np.bool_:
            ids, a = a.astype(np.int64).reshape(-1), np.zeros(self.V, dtype=np.bool_)
            if ids.size and (ids.min() < 0 or ids.max() >= self.V):
                bad = int(ids.max() if ids.max() >= self.V else ids.min())
                raise ValueError(f"action_mask_fn returned token id {bad} for env row {s}, outside the vocabulary "
                                 f"[0, {self.V})")
            a[ids] = True
        elif a.shape != (self.V,):
            raise ValueError(f"action_mask_fn returned a bool array of shape {a.shape} for env row {s}; expected "
                             f"({self.V},)")
        row[: self.W8] = np.packbits(a, bitorder="little")
        return row

    def allowed(self, live: torch.Tensor) -> torch.Tensor:
        """Bool ``[N, V]``: the current step's allowed tokens (everything, for rows not in ``live``)."""
        return unpack_bits(self.packed(live)[:, : self.W8], self.V)

    def mask_logits(self, logits: torch.Tensor, live: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``logits[R, V']`` of slots ``rows`` with ``-inf`` outside the current step's masks: in place, with
        llguidance's bitmask kernel on the CPU (a tenth of unpacking the sets), else through :meth:`allowed`. A head
        wider than the tokenizer gets ``-inf`` on its extra ids."""
        packed = self.packed(live)[rows]
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            from llguidance.torch import apply_token_bitmask_inplace

            apply_token_bitmask_inplace(logits, packed.contiguous().view(torch.int32))
            if logits.shape[1] > self.V:
                logits[:, self.V:] = float("-inf")
            return logits
        allowed = unpack_bits(packed[:, : self.W8], self.V)
        if allowed.shape[1] < logits.shape[1]:
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def take(self, live: torch.Tensor, actions: torch.Tensor, cols: torch.Tensor) -> None:
        """Check ``actions`` of the ``live`` rows against their masks, record each row's set at its generated column
        ``cols[row]`` and advance the row's grammar; one line naming the row, token and prefix for a forbidden one."""
        packed = self.packed(live)
        rows = live.nonzero().flatten()
        a = actions[rows]
        ok = (packed[rows, a // 8] >> (a % 8).to(torch.uint8)) & 1
        if not bool(ok.all()):
            bad = int((ok == 0).nonzero()[0])
            s, tok = int(rows[bad]), int(a[bad])
            raise ValueError(f"action {tok} ({self.tokenizer.decode([tok])!r}) for env {s} is outside its action mask "
                             f"after the prefix {self.tokenizer.decode(self._prefix[s])!r}")
        host_rows, host_a = rows.tolist(), a.tolist()
        ks = []
        for s, t in zip(host_rows, host_a):
            b = self._host[s, : self.W8].tobytes()  # the step's sets, still on the host: no device round trip
            k = self._ids.get(b)
            if k is None:
                k = self._ids[b] = len(self._rows)
                self._rows.append(b)
            ks.append(k)
            self._prefix[s].append(t)
            mt = self._matchers[s] if self.spec_for is not None else None
            if mt is not None and not mt.consume_token(t):  # the mask allowed it, so this is the grammar's own error
                raise ValueError(f"env {s}: the grammar refused token {t} it had allowed: {mt.get_error()}")
        c = cols[rows].to(self.device)
        fits = c < self.m
        self.index[rows[fits], c[fits]] = torch.tensor(ks, dtype=torch.int32, device=self.device)[fits]
        self._cache = None

    def record(self, idx: Any) -> TokenMasks:
        """The :class:`TokenMasks` of slots ``idx`` (a slice or index tensor), with only the sets they use."""
        index = self.index[idx].clone()
        used = torch.unique(index)
        used = used[used != 0]
        remap = torch.zeros(len(self._rows), dtype=torch.int32, device=self.device)
        remap[used.long()] = torch.arange(1, len(used) + 1, dtype=torch.int32, device=self.device)
        rows = [self._rows[0]] + [self._rows[k] for k in used.tolist()]
        table = torch.from_numpy(np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), self.W8).copy())
        return TokenMasks(remap[index.long()], table.to(self.device), self.V)

    def forget(self) -> None:
        """Drop the table of sets (a full reset: no index points into it any more)."""
        self._rows, self._ids = self._rows[:1], {self._rows[0]: 0}
        self.index.zero_()

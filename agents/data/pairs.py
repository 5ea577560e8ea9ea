"""Preference pairs for DPO: load them, tokenize them, mine them from env groups.

Reads top to bottom: text pairs (loading, validation split) -> :class:`PairData` (tokenized pairs in the
env's token layout, batched as one ``[2B, L]`` stack) -> pairs mined from a ``group_size=G`` rollout. The
bundled arithmetic pairs (reference solution vs a corrupted one) are the task's own
(:meth:`~tokengym.envs.tasks.ArithmeticTask.preference_pairs`); :func:`arithmetic_pairs`, :data:`CORRUPTIONS` and
:func:`corrupt_solution` here are the same objects from :mod:`tokengym.envs.tasks.arithmetic_data`.

**Text pairs** are dicts with ``"prompt"``, ``"chosen"`` and ``"rejected"`` (other keys are kept as
metadata). Values are strings, or lists of chat messages (``{"role": ..., "content": ...}``) when the
tokenizer has a chat template and ``chat_template=True``. Sources: a JSONL file, a
``datasets.Dataset``, or a list of dicts (:func:`load_pairs`).

**Token layout** (the one :class:`~tokengym.envs.TokenVectorEnv` and :class:`~tokengym.agents.Policy`
use): the prompt (encoded as the env encodes prompts: special tokens on, so the char tokenizer prepends
``<bos>``) is left-padded into ``P`` columns and the completion (encoded without special tokens, then
``<eos>``, the action that ends an episode) starts at column ``P``, right-padded. A batch of ``B`` pairs
is one ``[2B, P + M]`` stack, chosen rows first, sharing the prompt columns; ``P`` and ``M`` are the
longest prompt and completion *of that batch*, so short batches cost less.

Example:
    >>> from tokengym.envs.tokenizer import char_tokenizer
    >>> pairs = [{"prompt": "1+2\\n", "chosen": "1+2=3\\nA: 3", "rejected": "1+2=4\\nA: 4"}]
    >>> data = PairData.from_pairs(load_pairs(pairs), char_tokenizer())
    >>> batch = data.batch([0])
    >>> batch.tokens.shape, batch.prompt_len, batch.completion_mask.sum(1).tolist()
    (torch.Size([2, 16]), 5, [11, 11])
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from tokengym.envs.chat import check_roles
from tokengym.envs.tasks import arithmetic_data as _arithmetic_data
from tokengym.envs.tasks.dataset import read_jsonl
from tokengym.rewards.common import TokengymWarning

__all__ = [
    "PAIR_COLUMNS",
    "CORRUPTIONS",
    "load_pairs",
    "split_pairs",
    "PairBatch",
    "SharedPrefixBatch",
    "PairData",
    "corrupt_solution",
    "arithmetic_pairs",
    "mine_pairs",
]

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


# ============================================================================== text pairs
def _is_messages(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in v) and len(v) > 0


def load_pairs(source: Any, columns: Mapping[str, str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Read preference pairs into a list of dicts with ``"prompt"``, ``"chosen"``, ``"rejected"``.

    Args:
        source: a JSONL file path, a ``datasets.Dataset``, or a sequence of dicts (a :class:`PairData`
            is returned unchanged).
        columns: where the three fields live when the data names them differently, e.g.
            ``{"chosen": "good", "rejected": "bad"}``; renamed on the way in.
        limit: keep only the first ``limit`` pairs.

    Raises:
        ValueError: empty data, a missing column (the message lists the columns the data has), or a
            value that is neither a string nor a list of chat messages.

    Example:
        >>> load_pairs([{"question": "1+1\\n", "chosen": "A: 2", "rejected": "A: 3"}], columns={"prompt": "question"})
        [{'prompt': '1+1\\n', 'chosen': 'A: 2', 'rejected': 'A: 3'}]
    """
    if isinstance(source, PairData):
        return source  # type: ignore[return-value]
    columns = dict(columns or {})
    unknown = set(columns) - set(PAIR_COLUMNS)
    if unknown:
        raise ValueError(f"columns may only map {list(PAIR_COLUMNS)}, got keys {sorted(unknown)}")
    if isinstance(source, (str, os.PathLike)):
        rows = read_jsonl(os.fspath(source))
        where = f"file {os.fspath(source)!r}"
    elif type(source).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise ValueError(f"got a DatasetDict with splits {list(source)}; pass one split, e.g. data['train']")
    elif hasattr(source, "column_names") and hasattr(source, "to_list"):  # datasets.Dataset
        rows = source.to_list() if limit is None else source.select(range(min(limit, len(source)))).to_list()
        where = "dataset"
    elif isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        rows = list(source)
        where = "list"
    else:
        raise TypeError(f"cannot read preference pairs from {type(source).__name__}; pass a JSONL path, a datasets.Dataset or a list of dicts")
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"no preference pairs: the {where} is empty")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"pair {i} of the {where} is a {type(row).__name__}, expected a dict with {list(PAIR_COLUMNS)}")
        rest = dict(row)
        rec = {}
        for name in PAIR_COLUMNS:
            src = columns.get(name, name)
            if src not in rest:
                raise ValueError(
                    f"pair {i} of the {where} has no {src!r} column (needed for {name!r}); its columns are {sorted(row)}. "
                    f"Rename them or pass columns={{{name!r}: <column name>}}"
                )
            v = rec[name] = rest.pop(src)
            if not (isinstance(v, str) or _is_messages(v)):
                raise ValueError(f"pair {i}: {name!r} must be a string or a non-empty list of chat messages, got {type(v).__name__}: {v!r:.60}")
            check_roles(v, f"pair {i}: {name!r}")
        rec.update(rest)  # other columns are kept as metadata
        out.append(rec)
    return out


def split_pairs(pairs: Sequence[dict[str, Any]], val_fraction: float = 0.1, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Split text pairs into ``(train, validation)`` *by prompt*: no prompt lands in both.

    Prompts are shuffled with ``seed``; prompts are moved to validation until it holds at least
    ``val_fraction`` of the pairs (at least one prompt, and at least one prompt stays in training).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    keys = list(dict.fromkeys(json.dumps(p["prompt"], sort_keys=True) for p in pairs))
    if len(keys) < 2:
        raise ValueError(f"need pairs with at least 2 distinct prompts to split without leaking prompts, got {len(keys)}")
    order = np.random.default_rng(seed).permutation(len(keys))
    counts: dict[str, int] = {}
    for p in pairs:
        k = json.dumps(p["prompt"], sort_keys=True)
        counts[k] = counts.get(k, 0) + 1
    val_keys: set[str] = set()
    n_val, target = 0, math.ceil(val_fraction * len(pairs))
    for i in order[:-1]:
        if n_val >= target:
            break
        val_keys.add(keys[i])
        n_val += counts[keys[i]]
    train = [p for p in pairs if json.dumps(p["prompt"], sort_keys=True) not in val_keys]
    val = [p for p in pairs if json.dumps(p["prompt"], sort_keys=True) in val_keys]
    return train, val


# ============================================================================== tokenized pairs
@dataclass
class PairBatch:
    """``B`` pairs as one ``[2B, P + M]`` stack (rows ``:B`` chosen, ``B:`` rejected), on one device.

    ``tokens``/``mask``: prompt left-padded into ``P`` columns, completion from column ``P``;
    ``completion_mask[2B, M]`` is 1 on the completion tokens the agent wrote (the only ones scored; a multi-turn
    episode's env replies are context, 1 in ``mask`` only); ``index`` are the
    pairs' positions in their :class:`PairData`; ``num_tokens`` counts real tokens (host int).
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_len: int
    index: torch.Tensor
    num_tokens: int

    @property
    def num_pairs(self) -> int:
        return self.tokens.shape[0] // 2

    @property
    def completion_lens(self) -> torch.Tensor:
        """Completion tokens per row, ``[2B]``."""
        return self.completion_mask.sum(1)

    def to(self, device: str | torch.device) -> "PairBatch":
        d = torch.device(device)
        if self.tokens.device == d:
            return self
        return PairBatch(self.tokens.to(d), self.mask.to(d), self.completion_mask.to(d), self.prompt_len, self.index, self.num_tokens)


@dataclass
class SharedPrefixBatch:
    """``B`` pairs packed into ``R <= B`` rows, each pair stored once as ``[prompt | chosen | rejected after the common prefix]``.

    Chosen and rejected completions often start alike (always the prompt; for arithmetic corruptions
    also every token before the first wrong digit). Here a pair holds the prompt and the chosen
    completion once, then only the rejected completion's tokens after the prefix it shares with the
    chosen one; pairs are packed several to a row (first-fit decreasing into rows as wide as the
    longest pair) to cut padding. :meth:`attention_bias` lets a token attend only within its own pair,
    and a rejected-suffix token only to the prompt, the common prefix and the rejected suffix (never the
    chosen suffix); ``position_ids`` restart at 0 for each pair and restart the rejected suffix where
    the chosen suffix started. So every scored token sees exactly the context it has in a ``[2B, L]``
    stack: the same log-probs from fewer tokens ("prefix sharing", Wang et al. 2024; "packing").

    Attributes:
        tokens, position_ids: ``[R, W]``.
        pair: ``[R, W]`` the column's pair (0..B-1 in batch order), -1 on padding.
        segment: ``[R, W]`` int8: 0 prompt and common prefix, 1 chosen suffix, 2 rejected suffix, -1 padding.
        score_chosen, score_rejected: ``[R, W]`` bool: the column's token (predicted by the column before
            it) counts in its pair's chosen / rejected log-prob; the rejected suffix's first token is
            scored apart, from ``first_rejected_at``.
        first_rejected_at: ``[B, 2]`` (row, column) whose output predicts the rejected suffix's first
            token (the pair's last shared column); ``first_rejected``: ``[B]`` that token;
            ``has_rejected_suffix``: ``[B]`` bool.
        completion_lens: ``[2B]`` full completion lengths, chosen then rejected.
    """

    tokens: torch.Tensor
    pair: torch.Tensor
    segment: torch.Tensor
    position_ids: torch.Tensor
    score_chosen: torch.Tensor
    score_rejected: torch.Tensor
    first_rejected_at: torch.Tensor
    first_rejected: torch.Tensor
    has_rejected_suffix: torch.Tensor
    completion_lens: torch.Tensor
    index: torch.Tensor
    num_tokens: int

    @property
    def num_pairs(self) -> int:
        return self.index.numel()

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[R, 1, W, W]`` mask: 0 where query ``q`` may attend key ``k``, the dtype's minimum elsewhere.

        Allowed: ``k <= q``, same pair, and ``k`` in the pair's shared prefix or in ``q``'s own suffix
        (every position also attends to itself, so padding rows stay finite).
        """
        seg, pid = self.segment.long(), self.pair
        W = seg.shape[1]
        causal = torch.ones(W, W, dtype=torch.bool, device=seg.device).tril()
        ok = causal & (pid[:, None, :] == pid[:, :, None]) & (pid[:, None, :] >= 0)
        ok &= (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
        ok |= torch.eye(W, dtype=torch.bool, device=seg.device)
        return torch.zeros(ok.shape, dtype=dtype, device=seg.device).masked_fill_(~ok, torch.finfo(dtype).min)[:, None]

    def to(self, device: str | torch.device) -> "SharedPrefixBatch":
        d = torch.device(device)
        if self.tokens.device == d:
            return self
        move = {k: (v.to(d) if isinstance(v, torch.Tensor) and k != "index" else v) for k, v in self.__dict__.items()}
        return SharedPrefixBatch(**move)


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=special, verbose=False)["input_ids"]] if texts else []


def _eos_id(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; completions end with EOS (set tokenizer.eos_token)")
    return int(eos[0] if isinstance(eos, (list, tuple)) else eos)


@dataclass
class PairData:
    """Tokenized preference pairs, stored padded on the host, batched by :meth:`batch`.

    Attributes:
        prompts: ``[N, P]`` prompt ids, left-padded.
        prompt_mask: ``[N, P]`` bool, True on real prompt tokens.
        completions: ``[2, N, M]`` completion ids, right-padded; ``[0]`` chosen, ``[1]`` rejected.
        completion_lens: ``[2, N]`` completion lengths in tokens (>= 1).
        pad_id: the padding token id.
        records: optional per-pair metadata (texts, rewards, corruption kind, ...).
        completion_agent: ``[2, N, M]`` bool, True on the completion tokens the agent wrote; ``None``: all of them.
            Multi-turn episodes have env replies inside the completion: context that is never scored.
        truncated: ``[N]`` bool, True on the pairs that ``max_prompt_len`` / ``max_length`` cut (:meth:`from_pairs`
            given a limit; DPO logs their fraction as ``train/truncated``); ``None``: no limit was applied.
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    completions: torch.Tensor
    completion_lens: torch.Tensor
    pad_id: int
    records: list[dict[str, Any]] = field(default_factory=list)
    completion_agent: torch.Tensor | None = None
    truncated: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.prompts.shape[0]
        if self.prompt_mask.shape != self.prompts.shape:
            raise ValueError(f"prompt_mask {tuple(self.prompt_mask.shape)} must match prompts {tuple(self.prompts.shape)}")
        if self.completions.dim() != 3 or self.completions.shape[:2] != (2, n):
            raise ValueError(f"completions must be [2, N={n}, M], got {tuple(self.completions.shape)}")
        if self.completion_lens.shape != (2, n):
            raise ValueError(f"completion_lens must be [2, N={n}], got {tuple(self.completion_lens.shape)}")
        if n and int(self.completion_lens.min()) < 1:
            raise ValueError("every chosen and rejected completion needs at least one token")
        if self.completion_agent is not None and self.completion_agent.shape != self.completions.shape:
            raise ValueError(f"completion_agent {tuple(self.completion_agent.shape)} must match completions {tuple(self.completions.shape)}")
        self.prompt_lens = self.prompt_mask.sum(1)
        self._tokens_per_pair = (2 * self.prompt_lens + self.completion_lens.sum(0)).tolist()
        M = self.completions.shape[2]
        agent = self.agent_mask
        same = (self.completions[0] == self.completions[1]) & (agent[0] == agent[1]) & \
            (torch.arange(M) < self.completion_lens.min(0).values[:, None])
        self.common_prefix = same.long().cumprod(1).sum(1)  # [N] completion tokens chosen and rejected share

    def __len__(self) -> int:
        return self.prompts.shape[0]

    @property
    def agent_mask(self) -> torch.Tensor:
        """``[2, N, M]`` bool: the completion tokens that are scored (the agent's, within each length)."""
        real = torch.arange(self.completions.shape[2]) < self.completion_lens[..., None]
        return real if self.completion_agent is None else real & self.completion_agent.bool()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_token_ids(cls, prompt_ids: Sequence[Sequence[int]], chosen_ids: Sequence[Sequence[int]],
                       rejected_ids: Sequence[Sequence[int]], pad_id: int, records: list[dict[str, Any]] | None = None) -> "PairData":
        """Pairs from token id lists (a prompt, a chosen and a rejected completion per pair)."""
        n = len(prompt_ids)
        if not (n == len(chosen_ids) == len(rejected_ids)):
            raise ValueError(f"got {n} prompts, {len(chosen_ids)} chosen and {len(rejected_ids)} rejected completions")
        if n == 0:
            raise ValueError("no preference pairs")
        P = max(len(p) for p in prompt_ids)
        M = max(max(len(c) for c in chosen_ids), max(len(r) for r in rejected_ids))
        prompts = torch.full((n, P), pad_id, dtype=torch.long)
        pmask = torch.zeros((n, P), dtype=torch.bool)
        comps = torch.full((2, n, M), pad_id, dtype=torch.long)
        lens = torch.zeros((2, n), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            if len(p):
                prompts[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                pmask[i, P - len(p):] = True
            for k, c in enumerate((chosen_ids[i], rejected_ids[i])):
                comps[k, i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
                lens[k, i] = len(c)
        return cls(prompts, pmask, comps, lens, int(pad_id), list(records or []))

    @classmethod
    def from_pairs(cls, pairs: Any, tokenizer: Any, chat_template: bool = False, max_prompt_len: int | None = None,
                   max_length: int | None = None, add_eos: bool | None = None) -> "PairData":
        """Tokenize text pairs (anything :func:`load_pairs` reads) in the env's layout.

        Args:
            pairs: text pairs or a source for :func:`load_pairs` (a :class:`PairData` is returned as is).
            tokenizer: a ``transformers`` tokenizer with EOS and pad tokens.
            chat_template: render prompts (``add_generation_prompt=True``) and completions (the assistant
                turn: the full conversation's text after the prompt's) with
                ``tokenizer.apply_chat_template``; needs a tokenizer that has one. String values become a
                user / an assistant message.
            max_prompt_len: keep only the last ``max_prompt_len`` prompt tokens (``None``: no limit).
            max_length: cap prompt + completion tokens; completions keep their start. Pairs whose
                completions become identical, or whose prompt leaves no room, are dropped (with a warning).
            add_eos: append EOS to completions that do not end with it (default: on for plain text,
                off with a chat template, whose assistant turn carries its own end-of-turn token).
        """
        if isinstance(pairs, PairData):
            return pairs
        rows = load_pairs(pairs)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            raise ValueError("the tokenizer has no pad token (set tokenizer.pad_token, e.g. to its EOS token)")
        eos = _eos_id(tokenizer)
        if add_eos is None:
            add_eos = not chat_template
        if chat_template:
            prompt_ids, chosen_ids, rejected_ids = _encode_chat(rows, tokenizer)
        else:
            conv = [i for i, r in enumerate(rows) if any(not isinstance(r[c], str) for c in PAIR_COLUMNS)]
            if conv:
                raise ValueError(f"pair {conv[0]} holds chat messages; pass chat_template=True (with a tokenizer that has a chat template)")
            prompt_ids = _encode(tokenizer, [r["prompt"] for r in rows], True)
            chosen_ids = _encode(tokenizer, [r["chosen"] for r in rows], False)
            rejected_ids = _encode(tokenizer, [r["rejected"] for r in rows], False)
        if add_eos:
            chosen_ids = [c if c and c[-1] == eos else c + [eos] for c in chosen_ids]
            rejected_ids = [c if c and c[-1] == eos else c + [eos] for c in rejected_ids]
        keep, cut_prompts, dropped = [], 0, {"identical": [], "empty after truncation": [], "identical after truncation": []}
        cut = []  # kept pairs that a limit shortened
        for i in range(len(rows)):
            p, c, r = prompt_ids[i], chosen_ids[i], rejected_ids[i]
            if c == r:
                dropped["identical"].append(i)
                continue
            if max_prompt_len is not None and len(p) > max_prompt_len:
                p, cut_prompts = p[len(p) - max_prompt_len:], cut_prompts + 1
            if max_length is not None:
                room = max_length - len(p)
                c, r = c[:room], r[:room]
            if not c or not r or c == r:
                dropped["empty after truncation" if not c or not r else "identical after truncation"].append(i)
                continue
            cut.append(len(p) < len(prompt_ids[i]) or len(c) < len(chosen_ids[i]) or len(r) < len(rejected_ids[i]))
            prompt_ids[i], chosen_ids[i], rejected_ids[i] = p, c, r
            keep.append(i)
        if cut_prompts:
            warnings.warn(f"{cut_prompts} prompt(s) longer than max_prompt_len={max_prompt_len} were cut to their last tokens",
                          TokengymWarning, stacklevel=2)
        why = "; ".join(f"{len(v)} {k} (first: pair {v[0]})" for k, v in dropped.items() if v)
        if why and keep:
            warnings.warn(f"dropped {len(rows) - len(keep)} of {len(rows)} pairs whose chosen and rejected completions "
                          f"are not two different non-empty texts: {why} (max_length={max_length})", TokengymWarning, stacklevel=2)
        if not keep:
            raise ValueError(f"no preference pair is left to learn from: of {len(rows)}, {why} "
                             "(chosen and rejected must differ)")
        data = cls.from_token_ids([prompt_ids[i] for i in keep], [chosen_ids[i] for i in keep],
                                  [rejected_ids[i] for i in keep], int(pad), [rows[i] for i in keep])
        if max_prompt_len is not None or max_length is not None:
            data.truncated = torch.tensor(cut, dtype=torch.bool)
        return data

    def row_lengths(self) -> torch.Tensor:
        """``[N]`` tokens of each pair's longer row (prompt + the longer completion): what the model must position."""
        return self.prompt_mask.sum(1) + self.completion_lens.max(0).values

    @classmethod
    def concat(cls, parts: Sequence["PairData"]) -> "PairData":
        """One :class:`PairData` from several (re-padded to the widest)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("no preference pairs to concatenate")
        P = max(p.prompts.shape[1] for p in parts)
        M = max(p.completions.shape[2] for p in parts)
        pad = parts[0].pad_id

        def left(x: torch.Tensor, width: int, value: Any) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[-1], 0), value=value)

        def right(x: torch.Tensor, width: int) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=pad)

        return cls(torch.cat([left(p.prompts, P, pad) for p in parts]), torch.cat([left(p.prompt_mask, P, False) for p in parts]),
                   torch.cat([right(p.completions, M) for p in parts], 1), torch.cat([p.completion_lens for p in parts], 1),
                   pad, [r for p in parts for r in (p.records or [{}] * len(p))],
                   None if all(p.completion_agent is None for p in parts) else
                   torch.cat([torch.nn.functional.pad(p.agent_mask, (0, M - p.completions.shape[2])) for p in parts], 1))

    def select(self, idx: Sequence[int] | torch.Tensor) -> "PairData":
        """The pairs at ``idx``."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        recs = [self.records[i] for i in idx.tolist()] if self.records else []
        agent = None if self.completion_agent is None else self.completion_agent[:, idx]
        return PairData(self.prompts[idx], self.prompt_mask[idx], self.completions[:, idx], self.completion_lens[:, idx], self.pad_id, recs, agent)

    # ---------------------------------------------------------------- batching
    def batch(self, idx: Sequence[int] | torch.Tensor, device: str | torch.device | None = None) -> PairBatch:
        """Pairs ``idx`` as a ``[2B, P + M]`` stack (see :class:`PairBatch`), trimmed to the batch's longest prompt and completion."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        P = int(self.prompt_lens[idx].max())
        lens = self.completion_lens[:, idx].reshape(-1)  # [2B]: chosen then rejected
        M = int(lens.max())
        prompts = self.prompts[idx, self.prompts.shape[1] - P:].repeat(2, 1)
        pmask = self.prompt_mask[idx, self.prompts.shape[1] - P:].repeat(2, 1)
        comps = self.completions[:, idx, :M].reshape(-1, M)
        cmask = torch.arange(M) < lens[:, None]
        tokens = torch.cat([prompts, comps], 1)
        mask = torch.cat([pmask, cmask], 1)
        ntok = sum(self._tokens_per_pair[i] for i in idx.tolist())
        out = PairBatch(tokens, mask, self.agent_mask[:, idx, :M].reshape(-1, M), P, idx, ntok)
        return out.to(device) if device is not None else out

    def shared_batch(self, idx: Sequence[int] | torch.Tensor, device: str | torch.device | None = None) -> SharedPrefixBatch:
        """Pairs ``idx`` with shared prefixes, packed several to a row (see :class:`SharedPrefixBatch`)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        B = idx.numel()
        a = self.prompt_lens[idx]
        lc, lr = self.completion_lens[0, idx], self.completion_lens[1, idx]
        k = self.common_prefix[idx]
        r = lr - k  # rejected suffix after the common prefix
        n = a + lc + r  # columns per pair
        W = int(n.max())
        # each pair laid out alone in a [B, W] block first (column t of pair i) ...
        t = torch.arange(W)[None]
        a_, lc_, k_, r_ = a[:, None], lc[:, None], k[:, None], r[:, None]
        Pmax, M = self.prompts.shape[1], self.completions.shape[2]
        in_prompt, in_chosen = t < a_, (t >= a_) & (t < a_ + lc_)
        in_rej = (t >= a_ + lc_) & (t < n[:, None])
        prompt_tok = self.prompts[idx].gather(1, (Pmax - a_ + t).clamp(0, Pmax - 1))
        chosen_tok = self.completions[0, idx].gather(1, (t - a_).clamp(0, M - 1))
        rej_tok = self.completions[1, idx].gather(1, (k_ + t - a_ - lc_).clamp(0, M - 1))
        tokens = torch.where(in_prompt, prompt_tok, torch.where(in_chosen, chosen_tok, rej_tok))
        segment = torch.where(in_prompt | (in_chosen & (t < a_ + k_)), 0, torch.where(in_chosen, 1, 2))
        position = torch.where(in_rej, k_ + t - lc_, t)
        agent = self.agent_mask[:, idx]  # [2, B, M]: scored completion tokens
        agent_c = agent[0].gather(1, (t - a_).clamp(0, M - 1))
        agent_r = agent[1].gather(1, (k_ + t - a_ - lc_).clamp(0, M - 1))
        score_c = in_chosen & agent_c
        score_r = (in_chosen & (t < a_ + k_) & agent_c) | (in_rej & (t > a_ + lc_) & agent_r)
        # ... then packed: first-fit decreasing into rows of width W
        lengths = n.tolist()
        fill: list[int] = []
        row_of, offset = [0] * B, [0] * B
        for i in sorted(range(B), key=lambda i: -lengths[i]):
            j = next((j for j, used in enumerate(fill) if used + lengths[i] <= W), len(fill))
            if j == len(fill):
                fill.append(0)
            row_of[i], offset[i] = j, fill[j]
            fill[j] += lengths[i]
        R = len(fill)
        row_t, off_t = torch.tensor(row_of), torch.tensor(offset)
        valid = t < n[:, None]
        dest = (row_t[:, None] * W + off_t[:, None] + t)[valid]

        def pack(x: torch.Tensor, fill_value: Any) -> torch.Tensor:
            out = torch.full((R * W,), fill_value, dtype=x.dtype)
            out[dest] = x[valid]
            return out.view(R, W)

        pair_ids = torch.arange(B)[:, None].expand(B, W)
        first_col = off_t + a + k - 1  # the pair's last shared column predicts its rejected suffix's first token
        first_tok = self.completions[1, idx].gather(1, k_.clamp(max=M - 1))[:, 0]
        ntok = sum(self._tokens_per_pair[i] for i in idx.tolist())
        out = SharedPrefixBatch(
            tokens=pack(tokens, self.pad_id), pair=pack(pair_ids, -1), segment=pack(segment.to(torch.int8), -1),
            position_ids=pack(position, 0), score_chosen=pack(score_c, False), score_rejected=pack(score_r, False),
            first_rejected_at=torch.stack([row_t, first_col], 1), first_rejected=first_tok,
            has_rejected_suffix=(r > 0) & agent[1].gather(1, k_.clamp(max=M - 1))[:, 0],
            completion_lens=agent.sum(2).reshape(-1), index=idx, num_tokens=ntok)
        return out.to(device) if device is not None else out


    def texts(self, tokenizer: Any, i: int) -> dict[str, str]:
        """Decoded ``prompt``/``chosen``/``rejected`` of pair ``i`` (special tokens kept), for inspection."""
        p = self.prompts[i][self.prompt_mask[i]].tolist()
        c = self.completions[0, i, : int(self.completion_lens[0, i])].tolist()
        r = self.completions[1, i, : int(self.completion_lens[1, i])].tolist()
        return {"prompt": tokenizer.decode(p), "chosen": tokenizer.decode(c), "rejected": tokenizer.decode(r)}


def _encode_chat(rows: list[dict[str, Any]], tokenizer: Any) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise ValueError(f"chat_template=True but tokenizer {name!r} has no chat template; pass chat_template=False for plain text")

    def msgs(v: Any, role: str) -> list[dict[str, Any]]:
        return [{"role": role, "content": v}] if isinstance(v, str) else [dict(m) for m in v]

    prompts, chosen, rejected = [], [], []
    for i, r in enumerate(rows):
        pm = msgs(r["prompt"], "user")
        p_text = tokenizer.apply_chat_template(pm, tokenize=False, add_generation_prompt=True)
        comps = []
        for name in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template(pm + msgs(r[name], "assistant"), tokenize=False)
            if not full.startswith(p_text):
                raise ValueError(f"pair {i}: the chat template renders the prompt differently alone and with the {name} "
                                 "answer, so the completion cannot be cut off after the prompt")
            comps.append(full[len(p_text):])
        prompts.append(p_text)
        chosen.append(comps[0])
        rejected.append(comps[1])
    # the template writes the special tokens (BOS, turn markers) itself
    return _encode(tokenizer, prompts, False), _encode(tokenizer, chosen, False), _encode(tokenizer, rejected, False)


# ============================================================================== bundled arithmetic pairs
# The Arithmetic task owns its pairs (``ArithmeticTask.preference_pairs``); these names stay for existing callers.
arithmetic_pairs = _arithmetic_data.arithmetic_pairs
CORRUPTIONS = _arithmetic_data.CORRUPTIONS
corrupt_solution = _arithmetic_data.corrupt_solution


# ============================================================================== mined pairs
def mine_pairs(rollout: Any, min_gap: float = 0.0, score: str = "return", pad_id: int | None = None) -> PairData:
    """(best, worst) completion of each group of a ``group_size=G`` rollout, as token pairs.

    Prompts and completions are the rollout's own tokens (never re-tokenized): the chosen completion is
    the group's highest-scoring one, the rejected its lowest (first one on ties). Groups whose reward
    gap ``best - worst`` is not above ``min_gap`` carry no preference and are skipped. The result may
    be empty (``len == 0``); records carry ``group``, ``chosen_reward``, ``rejected_reward`` and texts.

    Args:
        rollout: a :class:`~tokengym.agents.engine.rollout.Rollout` with ``group_size >= 2``.
        min_gap: smallest reward gap that makes a pair.
        score: ``"return"`` (the episode's summed per-token reward: the outcome plus any process
            rewards) or ``"outcome"`` (the outcome reward only).
        pad_id: the padding id (default: read from the rollout's padded positions).
    """
    G = rollout.group_size
    if G < 2:
        raise ValueError(f"mining pairs needs groups: collect from an env with group_size >= 2 (got {G})")
    if score not in ("return", "outcome"):
        raise ValueError(f"score must be 'return' or 'outcome', got {score!r}")
    r = (rollout.rewards.sum(1) if score == "return" else rollout.outcome).float().cpu()
    g = r.view(-1, G)
    best = g.argmax(1)
    worst = g.argmin(1)
    gap = g.max(1).values - g.min(1).values
    keep = (gap > min_gap).nonzero().flatten()
    base = keep * G
    bi, wi = base + best[keep], base + worst[keep]
    P = rollout.prompt_len
    tokens, amask = rollout.tokens.cpu(), rollout.action_mask.cpu().bool()
    real = rollout.attention_mask.cpu().bool()[:, P:]  # agent tokens and, in multi-turn episodes, env replies
    pad = _rollout_pad(rollout) if pad_id is None else int(pad_id)
    comp = tokens[:, P:].masked_fill(~real, pad)
    lens = real.sum(1)
    M = max(int(lens[torch.cat([bi, wi])].max()), 1) if len(keep) else 1
    return PairData(
        prompts=tokens[bi, :P].masked_fill(~rollout.attention_mask.cpu().bool()[bi, :P], pad),
        prompt_mask=rollout.attention_mask.cpu().bool()[bi, :P],
        completions=torch.stack([comp[bi, :M], comp[wi, :M]]),
        completion_lens=torch.stack([lens[bi], lens[wi]]),
        pad_id=pad,
        records=[{"prompt": rollout.samples[int(b)].get("prompt") if rollout.samples else None,
                  "chosen": rollout.completions[int(b)] if rollout.completions else None,
                  "rejected": rollout.completions[int(w)] if rollout.completions else None,
                  "group": int(k), "chosen_reward": float(r[b]), "rejected_reward": float(r[w])}
                 for k, b, w in zip(keep.tolist(), bi.tolist(), wi.tolist())],
        completion_agent=None if bool((amask == real).all()) else torch.stack([amask[bi, :M], amask[wi, :M]]),
    )


def _rollout_pad(rollout: Any) -> int:
    """The pad id of a rollout's buffer: the token at any masked position (0 when nothing is padded)."""
    masked = ~rollout.attention_mask.bool()
    if bool(masked.any()):
        return int(rollout.tokens[masked][0])
    return 0

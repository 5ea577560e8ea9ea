"""Padding-free forwards: the real tokens of a padded ``[N, L]`` batch packed into ``R`` bins of width ``W``.

Every row's real tokens (``mask == 1``, in order) are laid end to end, first-fit decreasing, into bins as wide as the
longest row, so a bin holds several short rows and no row is split. Each segment's position ids restart at 0
(``cumsum(mask) - 1``, what the padded forward gives each real token) and a 4D attention mask confines every query
to the keys of its own segment at or before it, so a packed forward sees exactly the context of the padded one:
only the order of float sums changes. On a CPU, attention over one long packed row would still compute the whole
square; bins of bounded width keep it to ``R * W**2``. The models' outputs are then read only where they are used:
:func:`head_logits` runs the LM head on the positions that predict a real token (the agents'
``tokengym.agents.engine.policy.lm_logprobs`` turns them into log-probs), :func:`hidden_at` gathers a trunk's hidden
states and :func:`classifier_at` a classifier's head outputs, so padding costs neither the trunk nor the head. The
packer lives here, beside the reward models that use it, because ``tokengym.rewards`` never imports the agents; this
module is its one home (the agents import it from here).

``packing`` (a setting of every trainer): ``off`` (the padded batch), ``bins`` (always pack) or ``auto`` (pack when the
bins hold at most :data:`AUTO_FILL` of the padded batch's tokens: measured in ``bench/packing.py``). The first packed
forward of a model checks that the model honours the 4D mask (:func:`honours_mask`); a model that does not is refused
under ``bins`` and runs padded under ``auto``. Every trainer sets its models' mode with :func:`set_packing`.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from .common import PACKING, TokengymWarning

__all__ = ["PACKING", "AUTO_FILL", "Bins", "check_packing", "set_packing", "pack", "place", "plan", "packed_share",
           "honours_mask", "head_logits", "hidden_at", "classifier_at"]

AUTO_FILL = 0.8
"""``auto`` packs when the bins' tokens ``R * W`` are at most this fraction of the padded ``N * L`` (the gather, the
mask and the scatter cost a little, so a batch that packs into nearly as many tokens runs padded)."""


def check_packing(mode: str) -> str:
    """``mode`` if it is a :data:`PACKING` value, else ``ValueError`` naming the choices."""
    if mode not in PACKING:
        raise ValueError(f"packing must be one of {list(PACKING)}, got {mode!r}")
    return mode


def set_packing(mode: str, *models: Any) -> str:
    """A trainer's ``packing`` setting onto each of ``models`` that packs (has a ``packing`` attribute: a policy, a
    critic, a reward model); any other (None, a user's own value model) is left alone. Returns ``mode``."""
    check_packing(mode)
    for model in models:
        if model is not None and hasattr(model, "packing"):
            model.packing = mode
    return mode


@dataclass(frozen=True)
class Bins:
    """A packed batch. ``tokens``, ``position_ids``, ``segment`` (the source row, -1 on padding): ``[R, W]``.
    ``index[N, L]``: each source token's flat position ``r * W + c`` in the bins, -1 where the source mask is 0."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    segment: torch.Tensor
    index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Positions the packed forward computes (``R * W``)."""
        return self.tokens.numel()

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[R, 1, W, W]`` mask: 0 where query ``q`` may attend key ``k`` (same segment, ``k <= q``), the
        dtype's minimum elsewhere. Padding attends to itself only, so no softmax row is empty."""
        seg = self.segment
        W = seg.shape[1]
        ok = torch.ones(W, W, dtype=torch.bool, device=seg.device).tril() & (seg[:, :, None] == seg[:, None, :])
        ok &= (seg[:, None, :] >= 0) | torch.eye(W, dtype=torch.bool, device=seg.device)
        return torch.zeros(ok.shape, dtype=dtype, device=seg.device).masked_fill_(~ok, torch.finfo(dtype).min)[:, None]

    def run(self, model: nn.Module, **kwargs: Any) -> Any:
        """``model(...)`` on the bins (its parameters' dtype sets the mask's)."""
        dtype = next(model.parameters()).dtype
        return model(input_ids=self.tokens, attention_mask=self.attention_bias(dtype), position_ids=self.position_ids, **kwargs)


def _first_fit_decreasing(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """``(bin, start)`` of each row: rows longest first (ties in row order) into the first bin with room."""
    room: list[int] = []
    where, start = [0] * len(lengths), [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        b = next((b for b, r in enumerate(room) if r >= n), len(room))
        if b == len(room):
            room.append(width)
        where[i], start[i] = b, width - room[b]
        room[b] -= n
    return where, start


def _layout(real: torch.Tensor, width: int | None = None) -> tuple[list[int], list[int], int, int]:
    """``(bin, start, R, W)`` of each row of the bool mask ``real``: bins ``W`` wide (``width``, never narrower than
    the longest row; default the longest row), filled first-fit decreasing."""
    lengths = real.sum(1).tolist()
    W = max([1, *lengths] if width is None else [width, *lengths])
    where, start = _first_fit_decreasing(lengths, W)
    return where, start, max(where, default=-1) + 1, W


def pack(tokens: torch.Tensor, mask: torch.Tensor, width: int | None = None, pad_id: int = 0,
         layout: tuple[list[int], list[int], int, int] | None = None) -> Bins:
    """Pack the real tokens of ``tokens[N, L]`` (where ``mask`` is 1) into bins ``width`` wide (default: the longest
    row's real tokens; never narrower). ``layout``: the mask's :func:`_layout`, when it was already computed.

    Example:
        >>> t = torch.tensor([[0, 5, 6, 7], [0, 0, 8, 9], [3, 0, 0, 0]])
        >>> b = pack(t, (t > 0).long())
        >>> b.tokens.tolist(), b.position_ids.tolist(), b.segment.tolist()
        ([[5, 6, 7], [8, 9, 3]], [[0, 1, 2], [0, 1, 0]], [[0, 0, 0], [1, 1, 2]])
    """
    real = mask.bool()
    where, start, R, W = layout or _layout(real, width)
    k = real.long().cumsum(1) - 1  # a real token's position in its row: the padded forward's position id
    base = (torch.tensor(where) * W + torch.tensor(start)).to(tokens.device)
    index = torch.where(real, base[:, None] + k, -1)
    rows, cols = real.nonzero(as_tuple=True)
    at = index[rows, cols]
    flat_tokens = torch.full((R * W,), pad_id, dtype=tokens.dtype, device=tokens.device).index_put_((at,), tokens[rows, cols])
    flat_pos = torch.zeros(R * W, dtype=torch.long, device=tokens.device).index_put_((at,), k[rows, cols])
    flat_seg = torch.full((R * W,), -1, dtype=torch.long, device=tokens.device).index_put_((at,), rows)
    return Bins(flat_tokens.view(R, W), flat_pos.view(R, W), flat_seg.view(R, W), index)


def place(values: torch.Tensor, dst: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` zeros with ``values[K]`` at the flat positions ``dst`` (differentiable): a packed pass's
    outputs back in the padded layout, 0 at padding."""
    return values.new_zeros(rows * cols).index_copy(0, dst, values).view(rows, cols)


_HONOURS: "weakref.WeakKeyDictionary[nn.Module, str | None]" = weakref.WeakKeyDictionary()
_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models auto already warned about (not an attribute on them)


def honours_mask(model: nn.Module) -> str | None:
    """``None`` when ``model`` gives a packed batch the padded batch's outputs (checked once per model on three
    random rows, in eval mode, without autograd), else why not. A model that ignores or rejects the 4D mask fails."""
    if model in _HONOURS:
        return _HONOURS[model]
    g = torch.Generator().manual_seed(0)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(getattr(embeddings, "num_embeddings", None), int):
        _HONOURS[model] = reason = "it has no input embeddings to draw test tokens for"
        return reason
    device = next(model.parameters()).device
    lens = [5, 2, 3]
    mask = (torch.arange(6)[None] >= 6 - torch.tensor(lens)[:, None]).long().to(device)  # left padded, 2 + 3 share a bin
    tokens = torch.randint(embeddings.num_embeddings, (3, 6), generator=g).to(device) * mask
    was_training = model.training
    model.eval()
    reason = None
    try:
        with torch.no_grad():
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            plain = model(input_ids=tokens, attention_mask=mask, position_ids=pos)[0].float()
            bins = pack(tokens, mask)
            packed = bins.run(model)[0].float().reshape(-1, plain.shape[-1])
        real = mask.bool()
        want, got = plain[real], packed[bins.index[real]]
        tol = (1e-3 if next(model.parameters()).dtype == torch.float32 and not torch.is_autocast_enabled(device.type) else 3e-2)
        if not bool(((want - got).abs() <= tol * (1 + want.abs().max())).all()):
            reason = "its outputs on packed rows differ from the padded rows' (it ignores the 4D attention mask)"
    except (TypeError, ValueError, RuntimeError, NotImplementedError, IndexError) as e:
        reason = f"it rejects a 4D attention mask ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    finally:
        model.train(was_training)
    _HONOURS[model] = reason
    return reason


_PLANNED: "weakref.WeakKeyDictionary[nn.Module, list[int]]" = weakref.WeakKeyDictionary()  # model -> [packed, planned]


def packed_share(model: nn.Module) -> float | None:
    """The fraction of ``model``'s forwards that :func:`plan` packed since the last call (None: it planned none), and
    a fresh count from here: under ``auto`` a trainer logs it (``train/packed``) to say whether its steps ran packed."""
    packed, planned = _PLANNED.pop(model, (0, 0))
    return packed / planned if planned else None


def _count(model: nn.Module, bins: Bins | None) -> Bins | None:
    counts = _PLANNED.setdefault(model, [0, 0])
    counts[0] += bins is not None
    counts[1] += 1
    return bins


def plan(mode: str, model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> Bins | None:
    """The bins a forward of ``model`` over ``tokens``/``mask`` should use under ``mode``, or ``None`` for the
    padded batch. Any ``mode`` but ``off`` checks the model first (so that data-parallel ranks, which may decide
    differently under ``auto``, run the same check passes)."""
    if check_packing(mode) == "off":
        return None
    reason = honours_mask(model)
    if reason is not None:
        if mode == "bins":
            raise ValueError(f"packing='bins' needs a model that takes a 4D attention mask, and {type(model).__name__} "
                             f"does not: {reason}; use packing='off'")
        if model not in _WARNED:  # once per model
            _WARNED.add(model)
            warnings.warn(f"packing='auto' runs padded: {type(model).__name__} {reason}", TokengymWarning, stacklevel=3)
        return _count(model, None)
    real = mask.bool()
    if not bool(real.any()):
        return _count(model, None)
    layout = _layout(real)  # the decision needs only the bins' count and width: no tensors built for a padded batch
    if mode == "auto" and layout[2] * layout[3] > AUTO_FILL * tokens.numel():
        return _count(model, None)
    return _count(model, pack(tokens, real, layout=layout))


@contextlib.contextmanager
def _head_reads(model: nn.Module, flat: torch.Tensor) -> Iterator[None]:
    """While active, the LM head of ``model`` reads only the hidden states at the flat positions ``flat`` (of its
    ``[R, W, H]`` input): its logits come out ``[1, K, V]``."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings to read packed positions from")

    def gather(_module: nn.Module, args: tuple) -> tuple:
        h = args[0]
        return (h.reshape(-1, h.shape[-1]).index_select(0, flat)[None], *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def _targets(bins: Bins, mask: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)``: flat ``[N, L - first]`` positions of the real source tokens at columns ``first..`` that have a
    real token before them, and the packed flat position of that token (whose output predicts them)."""
    idx = bins.index[:, first:]
    has = (idx >= 0) & (mask.long().cumsum(1)[:, first:] >= 2)
    dst = has.reshape(-1).nonzero()[:, 0]
    return dst, idx.reshape(-1)[dst] - 1


def head_logits(model: nn.Module, bins: Bins, mask: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits[1, K, V], dst)``: an LM's logits only at the packed positions that predict the real source tokens of
    columns ``first..`` (those with a real token before them), and those tokens' flat positions in
    ``[N, L - first]``; the LM head runs on those ``K`` positions alone."""
    dst, src = _targets(bins, mask, first)
    with _head_reads(model, src):
        logits = bins.run(model).logits
    if logits.shape[:2] != (1, dst.numel()):
        raise ValueError(f"{type(model).__name__} did not run its output embeddings on the packed positions "
                         f"(logits {tuple(logits.shape)}); use packing='off'")
    return logits, dst


def hidden_at(trunk: nn.Module, bins: Bins, mask: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden[K, H], dst)``: a trunk's last hidden states at the real source tokens of columns ``first..`` and
    their flat positions in ``[N, L - first]``."""
    idx = bins.index[:, first:].reshape(-1)
    dst = (idx >= 0).nonzero()[:, 0]
    h = bins.run(trunk).last_hidden_state
    return h.reshape(-1, h.shape[-1]).index_select(0, idx[dst]), dst


def classifier_at(model: nn.Module, mode: str, tokens: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                  cols: torch.Tensor) -> torch.Tensor | None:
    """A ``transformers`` sequence or token classifier's head outputs ``[K, labels]`` at the source positions
    ``(rows, cols)``, from one packed pass of its trunk (``model.<base_model_prefix>``, then its dropout and ``score``
    head, as its own forward runs them); ``None`` where the batch should run padded (``mode``, the batch's shape, a
    model without that trunk/head layout, or a position on padding)."""
    trunk = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    head = getattr(model, "score", None)
    if check_packing(mode) == "off" or not isinstance(trunk, nn.Module) or trunk is model or not isinstance(head, nn.Module):
        return None
    bins = plan(mode, trunk, tokens, mask)
    if bins is None:
        return None
    at = bins.index[rows, cols]
    if bool((at < 0).any()):
        return None
    h = bins.run(trunk).last_hidden_state
    h = h.reshape(-1, h.shape[-1]).index_select(0, at)
    drop = getattr(model, "dropout", None)
    return head(drop(h) if isinstance(drop, nn.Dropout) else h)


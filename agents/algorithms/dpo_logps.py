"""Sequence log-probs of a DPO pair batch: one forward of the policy (or the reference) per batch.

A plain :class:`~tokengym.agents.data.pairs.PairBatch` is a ``[2B, P + M]`` stack (chosen rows, then rejected rows);
a :class:`~tokengym.agents.data.pairs.SharedPrefixBatch` stores each pair once as ``[prompt | chosen | rejected after
the common prefix]``, several pairs per row, with a 4D attention mask. Both give the same ``[2B]`` sums.
"""

from __future__ import annotations

from typing import Any

import torch

from tokengym.agents import functional as F
from tokengym.agents.data.pairs import PairBatch, SharedPrefixBatch

__all__ = ["sequence_logps", "shared_prefix_logps"]


def sequence_logps(policy: Any, batch: PairBatch | SharedPrefixBatch) -> torch.Tensor:
    """Summed completion log-probs ``[2B]`` of a batch (chosen first, then rejected): one forward pass.

    ``policy(tokens, mask, P)`` gives per-token log-probs of ``tokens[:, P:]``; prompt columns are
    not part of it and padding columns are masked out of the sum. A :class:`SharedPrefixBatch` gets
    the same numbers from its packed rows (see :func:`shared_prefix_logps`).
    """
    if isinstance(batch, SharedPrefixBatch):
        return shared_prefix_logps(policy, batch)
    logp = policy(batch.tokens, batch.mask, batch.prompt_len)
    return logp.masked_fill(~batch.completion_mask, 0.0).sum(1)


def shared_prefix_logps(policy: Any, b: SharedPrefixBatch) -> torch.Tensor:
    """Summed completion log-probs ``[2B]`` (chosen, then rejected) of a prefix-shared, packed batch: one forward.

    The model gets the batch's 4D additive attention mask and explicit position ids; a token is scored
    from the output of the column before it, except each rejected suffix's first token, predicted from
    its pair's last shared column. Logits are divided by the policy's temperature, as in
    :meth:`Policy.forward`.
    """
    model = policy.model
    out = model(input_ids=b.tokens, attention_mask=b.attention_bias(next(model.parameters()).dtype), position_ids=b.position_ids)
    logits = out.logits
    if policy.temperature != 1.0:
        logits = logits / policy.temperature
    lp = F.token_logprobs(logits[:, :-1], b.tokens[:, 1:])  # lp[:, j]: the token at column j + 1
    B = b.num_pairs
    pair = b.pair[:, 1:].reshape(-1).clamp(min=0)
    zero = lp.new_zeros(())
    chosen = lp.new_zeros(B).index_add(0, pair, torch.where(b.score_chosen[:, 1:], lp, zero).reshape(-1))
    rejected = lp.new_zeros(B).index_add(0, pair, torch.where(b.score_rejected[:, 1:], lp, zero).reshape(-1))
    head = logits[b.first_rejected_at[:, 0], b.first_rejected_at[:, 1]][:, None]  # [B, 1, V]
    first = F.token_logprobs(head, b.first_rejected[:, None])[:, 0]
    return torch.cat([chosen, rejected + torch.where(b.has_rejected_suffix, first, zero)])

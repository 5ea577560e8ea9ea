"""Padding-free forwards for the trainers: the packer of :mod:`tokengym.rewards.packing` (bins of the real tokens,
positions restarting per segment, a 4D mask per segment), and :func:`lm_logprobs`, :meth:`Policy.forward
<tokengym.agents.Policy.forward>` over bins."""

from __future__ import annotations

import torch
from torch import nn

import tokengym.agents.functional as Fn
from tokengym.rewards.packing import (AUTO_FILL, PACKING, Bins, check_packing, classifier_at, head_logits, hidden_at,
                                      honours_mask, pack, place, plan)

__all__ = ["PACKING", "AUTO_FILL", "Bins", "check_packing", "pack", "place", "plan", "honours_mask", "head_logits",
           "lm_logprobs", "hidden_at", "classifier_at"]


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

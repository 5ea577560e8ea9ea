"""``Critic``: a transformer trunk with a scalar value head on the last hidden state of every position."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from torch import nn

from tokengym.agents.engine.models import use_tokengym_attention
from tokengym.rewards.packing import check_packing, hidden_at, place, plan
from tokengym.agents.engine.policy import position_ids
from tokengym.rewards.common import quiet_transformers

__all__ = ["Critic"]


class Critic(nn.Module):
    """Values ``V(s_t)`` for every generated position of a token buffer.

    ``critic(tokens[N, P+M], mask, prompt_len)`` returns ``[N, M + 1]``: column ``t`` is the value of
    the state after the prompt and the first ``t`` generated tokens (read from the hidden state at
    position ``P - 1 + t``), so columns ``0..M-1`` are the values of the states in which actions
    ``0..M-1`` were taken and column ``M`` is the bootstrap value of a truncated episode.

    Args:
        trunk: a ``transformers`` base model returning ``last_hidden_state`` (e.g. ``LlamaModel``).
        hidden_size: width of the trunk's hidden states.
        seed: seeds the value head's initialisation (the global RNG is left alone), so two critics built
            with the same seed are identical.
        packing: ``"off"``, ``"bins"`` or ``"auto"``, as :class:`~tokengym.agents.Policy`'s (PPO sets it from its
            config); packed, the values at padding are 0.

    Build one with :meth:`from_policy` (a separate copy of the policy's trunk by default, as in
    classic RLHF PPO; ``share_trunk=True`` reuses the policy's trunk object).
    """

    def __init__(self, trunk: nn.Module, hidden_size: int, seed: int = 0, packing: str = "off"):
        super().__init__()
        self.trunk = use_tokengym_attention(trunk)
        self.packing = check_packing(packing)  # as Policy.packing: PPO sets it from its config
        self.value_head = nn.Linear(hidden_size, 1)
        gen = torch.Generator().manual_seed(seed)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1), generator=gen)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: Any, share_trunk: bool = False, seed: int = 0) -> "Critic":
        """A critic on a copy of ``policy``'s transformer trunk (or the trunk itself with ``share_trunk``)."""
        base = policy.model.get_decoder() if hasattr(policy.model, "get_decoder") else policy.model.base_model
        trunk = base if share_trunk else copy.deepcopy(base)
        return cls(trunk, policy.model.config.hidden_size, seed=seed).to(policy.device)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        bins = plan(self.packing, self.trunk, tokens, mask)
        if bins is not None:  # values at the real tokens only, 0 at padding
            h, dst = hidden_at(self.trunk, bins, mask, prompt_len - 1)
            v = self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()
            return place(v, dst, tokens.shape[0], tokens.shape[1] - prompt_len + 1)
        out = self.trunk(input_ids=tokens, attention_mask=mask.long(), position_ids=position_ids(mask))
        h = out.last_hidden_state[:, prompt_len - 1 :]
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def save_pretrained(self, path: str) -> None:
        """Trunk via ``save_pretrained`` (safetensors) plus ``value_head.safetensors``."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with quiet_transformers():
            self.trunk.save_pretrained(path, safe_serialization=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}, os.path.join(path, "value_head.safetensors"))
        with open(os.path.join(path, "critic.json"), "w") as f:
            json.dump({"hidden_size": self.value_head.in_features}, f)

    @classmethod
    def from_pretrained(cls, path: str, device: str | torch.device = "cpu") -> "Critic":
        from safetensors.torch import load_file
        from transformers import AutoModel

        with open(os.path.join(path, "critic.json")) as f:
            meta = json.load(f)
        trunk = AutoModel.from_pretrained(path, local_files_only=True, trust_remote_code=False, use_safetensors=True)
        critic = cls(trunk, meta["hidden_size"])
        critic.value_head.load_state_dict(load_file(os.path.join(path, "value_head.safetensors")))
        return critic.to(device)

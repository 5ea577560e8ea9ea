"""What ends an agent turn in a token env: stop tokens and stop strings, matched on token ids.

A turn ends on a token that stops on its own (EOS, the chat template's end-of-turn markers, a stop string that is one
token) or on the last token of a multi-token stop string, when the agent's current turn ends with the string's ids.
Matching ids, not text, keeps the rule exact (tokens in = tokens out) and lets an inference engine be told the same
rule (:class:`~tokengym.envs.rollout_env.StopRule`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tokengym.envs.chat import end_of_turn_ids
from tokengym.envs.rollout_env import StopRule

__all__ = ["StopMatcher"]


class StopMatcher:
    """The stop lookups of a token env, built once from its tokenizer and stop strings.

    Attributes:
        is_stop: bool ``[V]`` on ``device``: tokens that end a turn on their own.
        sequences: the multi-token stop strings' ids, one tensor each on ``device``.
        rule: the same, as a :class:`~tokengym.envs.rollout_env.StopRule` (with the strings' texts).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], vocab_size: int, prompt_len: int,
                 device: torch.device):
        self.prompt_len, self.device = prompt_len, device
        is_stop = torch.zeros(vocab_size, dtype=torch.bool)
        eos = tokenizer.eos_token_id
        for i in [*(eos if isinstance(eos, (list, tuple)) else [eos]), *end_of_turn_ids(tokenizer)]:
            is_stop[int(i)] = True
        self.sequences: list[torch.Tensor] = []
        texts: list[str] = []
        for s in stop_strings:
            ids = tokenizer(s, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"stop string {s!r} encodes to no tokens")
            if len(ids) == 1:
                is_stop[ids[0]] = True
            else:
                self.sequences.append(torch.tensor(ids, device=device))
                texts.append(s)
        self.is_stop = is_stop.to(device)
        self.rule = StopRule(tuple(is_stop.nonzero().flatten().tolist()),
                             tuple(tuple(q.tolist()) for q in self.sequences), tuple(texts))

    def sequence_hit(self, a: torch.Tensor, tokens: torch.Tensor, gen_len: torch.Tensor,
                     turn_start: torch.Tensor) -> torch.Tensor:
        """Bool ``[N]``: rows whose action ``a`` completes a multi-token stop string inside the agent's current turn
        (``tokens`` ``[N, P + M]``, ``gen_len`` and ``turn_start`` the env's, before ``a`` is written)."""
        hit = torch.zeros_like(a, dtype=torch.bool)
        for seq in self.sequences:
            k = seq.numel()
            cols = (gen_len + self.prompt_len).unsqueeze(1) + torch.arange(-(k - 1), 0, device=self.device)
            prev = tokens.gather(1, cols.clamp(min=0))
            # only the agent's current turn counts: an env reply before it never completes a marker
            hit |= (gen_len - turn_start >= k - 1) & (prev == seq[:-1]).all(1) & (a == seq[-1])
        return hit

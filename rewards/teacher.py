"""On-policy distillation's reward: a teacher model grades every token the student samples.

The per-token reward is ``-coef * KL(student || teacher)`` at each action position (discount 0), on the rollout's
action columns like every other per-token reward. Three estimators of that KL:

- ``sampled``: at the sampled token alone, ``log pi_student(a_t) - log pi_teacher(a_t)``. Its expectation over the
  student's own samples is the exact KL, so the reward is non-positive in expectation and 0 where the teacher agrees.
- ``topk``: over the student's ``top_k`` most likely tokens at each position, both distributions renormalised there
  (a KL between two distributions; ``top_k >= V`` is the full vocabulary exactly).
- ``full``: over the whole vocabulary.

``topk`` and ``full`` read both models' logits at every position, so they take the expectation over the token that
``sampled`` estimates from one draw. The math lives here, beside the reward, and ``tokengym.agents.functional``
re-exports it (the rewards never import the agents).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .packing import head_logits, plan

__all__ = ["ESTIMATORS", "sampled_reverse_kl", "reverse_kl", "teacher_token_rewards", "TeacherReward", "vocabulary_name"]

ESTIMATORS = ("sampled", "topk", "full")
"""The per-token reverse-KL estimators of :class:`TeacherReward`."""


def _same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {name_a} has shape {tuple(a.shape)} but {name_b} has shape "
                         f"{tuple(b.shape)}; they must be equal")


def sampled_reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Per-token one-sample estimate of ``KL(student || teacher)`` at tokens the student sampled.

    ``student_logp - teacher_logp``: its expectation over the student's own samples is the exact reverse KL, so
    ``-sampled_reverse_kl`` is on-policy distillation's per-token reward (non-positive in expectation, 0 where the
    teacher agrees). Both arguments are ``[B, T]`` log-probs of the same tokens (the teacher's at the temperature
    it is meant to be read at).

    Example:
        >>> import torch
        >>> sampled_reverse_kl(torch.log(torch.tensor([[0.5, 0.25]])), torch.log(torch.tensor([[0.25, 0.25]])))
        tensor([[0.6931, 0.0000]])
    """
    _same_shape("student_logp", student_logp, "teacher_logp", teacher_logp)
    return student_logp - teacher_logp


def _check_top_k(top_k: Any) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def _check_temperature(teacher_temperature: float) -> None:
    if not (isinstance(teacher_temperature, (int, float)) and math.isfinite(teacher_temperature) and teacher_temperature > 0):
        raise ValueError(f"teacher_temperature must be finite and > 0, got {teacher_temperature!r}")


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, top_k: int | None = None,
               teacher_temperature: float = 1.0) -> Tensor:
    """Per-token ``KL(student || teacher)`` from both models' logits ``[B, T, V]``: exact over the vocabulary, or
    over each position's ``top_k`` most likely student tokens with both distributions renormalised there.

    Renormalising both keeps the top-k value a KL between two distributions (>= 0, and 0 where they agree on the
    set) and makes ``top_k >= V`` the full KL exactly. ``teacher_temperature`` divides the teacher's logits.
    Computed in float64 for float64 inputs, else float32; differentiable w.r.t. both logits.

    Example:
        >>> import torch
        >>> s = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
        >>> t = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))
        >>> reverse_kl(s, t)                  # 0.5 log 2 - 0.25 log 2
        tensor([[0.1733]])
        >>> reverse_kl(s, t, top_k=2)         # over {0, 1}: (2/3, 1/3) against (1/3, 2/3)
        tensor([[0.2310]])
    """
    _same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be [B, T, V] (3-D), got shape {tuple(student_logits.shape)}")
    _check_temperature(teacher_temperature)
    _check_top_k(top_k)
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    s, t = student_logits.to(dtype), teacher_logits.to(dtype) / teacher_temperature
    if top_k is not None and top_k < s.shape[-1]:
        idx = s.detach().topk(top_k, dim=-1).indices
        s, t = s.gather(-1, idx), t.gather(-1, idx)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def teacher_token_rewards(action_mask: Tensor, estimator: str = "sampled", *, student_logp: Tensor | None = None,
                          teacher_logp: Tensor | None = None, student_logits: Tensor | None = None,
                          teacher_logits: Tensor | None = None, top_k: int | None = 20, coef: float = 1.0) -> Tensor:
    """Distillation's per-token rewards ``[B, T]``: ``-coef *`` the estimator's reverse KL on the action columns, 0
    elsewhere. ``sampled`` needs both models' log-probs of the sampled tokens; ``topk`` and ``full`` their logits
    ``[B, T, V]`` (the teacher's already at its temperature). Never a gradient: the reward is a constant."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; valid choices are: {', '.join(map(repr, ESTIMATORS))}")
    with torch.no_grad():
        if estimator == "sampled":
            if student_logp is None or teacher_logp is None:
                raise ValueError("estimator='sampled' needs student_logp and teacher_logp")
            kl = sampled_reverse_kl(student_logp.float(), teacher_logp.float())
        else:
            if student_logits is None or teacher_logits is None:
                raise ValueError(f"estimator={estimator!r} needs student_logits and teacher_logits")
            kl = reverse_kl(student_logits, teacher_logits, top_k if estimator == "topk" else None)
        _same_shape("the reverse KL", kl, "action_mask", action_mask)
        return torch.where(action_mask.bool(), -coef * kl, torch.zeros_like(kl))


def _label_logprobs(logits: Tensor, labels: Tensor, temperature: float, rows: int = 256) -> Tensor:
    """``log_softmax(logits / temperature)[k, labels[k]]`` for ``logits[K, V]``, float32, ``rows`` at a time: never a
    float copy of the whole ``[K, V]`` (a 64 x 128-token SmolLM2 batch's logits alone are 1.6 GB)."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, logits.shape[0], rows):
        x = logits[s : s + rows].float()
        if temperature != 1.0:
            x = x / temperature
        out[s : s + rows] = x.gather(1, labels[s : s + rows, None])[:, 0] - x.logsumexp(-1)
    return out


def vocabulary_name(tokenizer: Any) -> str:
    """``name (N tokens)`` of a tokenizer, for messages that name a vocabulary."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"{name} ({len(tokenizer)} tokens)"


class TeacherReward:
    """A frozen teacher causal LM as a per-token reward on a rollout's action columns.

    Args:
        model: a ``transformers`` causal LM, frozen here (eval mode, no gradients); or a scorer served elsewhere, any
            object with the generation seam's scoring call ``score(sequences, starts)`` (log-probs at temperature 1 of
            each token sequence from ``starts[i]`` on), which serves the ``sampled`` estimator at temperature 1.
        tokenizer: its tokenizer; :meth:`check_student` refuses a student whose vocabulary differs.
        estimator: ``sampled``, ``topk`` or ``full`` (the module docstring).
        top_k: the ``topk`` estimator's support size.
        temperature: divides the teacher's logits (its log-probs are of that distribution).
        coef: the reward's scale.
        packing: ``off``, ``bins`` or ``auto``: the teacher's forward over the real tokens packed into bins.

    Example:
        >>> import torch
        >>> from tokengym.agents.engine.models import load_model
        >>> teacher = TeacherReward(*load_model("tiny"))
        >>> tokens, mask = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
        >>> teacher.logprobs(tokens, mask, prompt_len=2).shape   # the teacher's log-probs of tokens[:, 2:]
        torch.Size([1, 2])
    """

    def __init__(self, model: nn.Module, tokenizer: Any, estimator: str = "sampled", top_k: int = 20,
                 temperature: float = 1.0, coef: float = 1.0, packing: str = "auto"):
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; valid choices are: {', '.join(map(repr, ESTIMATORS))}")
        _check_top_k(top_k)
        _check_temperature(temperature)
        if not (math.isfinite(coef) and coef > 0):
            raise ValueError(f"coef must be finite and > 0, got {coef!r}")
        self.scorer = None
        if isinstance(model, nn.Module):
            model = model.eval().requires_grad_(False)
        elif callable(getattr(model, "score", None)):
            if estimator != "sampled" or temperature != 1.0:
                raise ValueError(f"a teacher behind the scoring call gives the log-probs of the sampled tokens at "
                                 f"temperature 1 only: use estimator='sampled' and temperature 1 (got {estimator!r}, "
                                 f"{temperature})")
            self.scorer, model = model, None
        else:
            raise TypeError(f"model must be a causal LM (torch.nn.Module) or have score(sequences, starts), got "
                            f"{type(model).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.estimator, self.top_k, self.temperature, self.coef, self.packing = estimator, top_k, float(temperature), float(coef), packing

    def check_student(self, tokenizer: Any) -> None:
        """Refuse a student tokenizer whose vocabulary is not the teacher's, in one line naming both: distillation
        compares the two models' log-probs of the same token ids."""
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"the teacher's tokenizer {vocabulary_name(self.tokenizer)} and the student's "
                             f"{vocabulary_name(tokenizer)} differ: distillation scores the student's token ids with "
                             "the teacher, so both need the same vocabulary")

    @torch.no_grad()
    def _head(self, tokens: Tensor, mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor | None]:
        """The model's raw logits where they predict ``tokens[:, prompt_len:]``: packed, ``([K, V], dst)`` at the real
        tokens' flat positions in ``[N, M]``; padded, ``([N, M, V], None)``."""
        m = tokens.shape[1] - prompt_len
        bins = plan(self.packing, self.model, tokens, mask)
        if bins is not None:  # the head runs only where a real token is predicted
            logits, dst = head_logits(self.model, bins, mask, prompt_len)
            return logits[0], dst
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=tokens, attention_mask=mask.long(), position_ids=pos, logits_to_keep=m + 1).logits[:, :-1], None

    @torch.no_grad()
    def logits(self, tokens: Tensor, mask: Tensor, prompt_len: int) -> Tensor:
        """The teacher's logits ``[N, M, V]`` (float32, at its temperature) at the positions predicting
        ``tokens[:, prompt_len:]``; rows' padding positions hold zeros under packing, meaningless values otherwise."""
        n, m = tokens.shape[0], tokens.shape[1] - prompt_len
        out, dst = self._head(tokens, mask, prompt_len)
        if dst is not None:
            out = out.new_zeros(n * m, out.shape[-1]).index_copy(0, dst, out).view(n, m, -1)
        out = out.float()
        return out if self.temperature == 1.0 else out / self.temperature

    @property
    def positions_model(self) -> nn.Module | None:
        """The model whose position limit bounds the rows it scores (a scorer's, when it shows one)."""
        if self.model is not None:
            return self.model
        held = getattr(self.scorer, "model", None) or getattr(getattr(self.scorer, "policy", None), "model", None)
        return held if isinstance(held, nn.Module) else None

    @torch.no_grad()
    def logprobs(self, tokens: Tensor, mask: Tensor, prompt_len: int) -> Tensor:
        """The teacher's log-probs ``[N, M]`` (at its temperature) of the tokens ``tokens[:, prompt_len:]`` (0 at
        padding from a scorer)."""
        if self.scorer is not None:
            return self._scored(tokens, mask, prompt_len)
        n, m = tokens.shape[0], tokens.shape[1] - prompt_len
        logits, dst = self._head(tokens, mask, prompt_len)
        labels = tokens[:, prompt_len:].reshape(-1)
        if dst is None:
            return _label_logprobs(logits.reshape(n * m, -1), labels, self.temperature).view(n, m)
        lp = _label_logprobs(logits, labels[dst], self.temperature)
        return lp.new_zeros(n * m).index_copy(0, dst, lp).view(n, m)

    def _scored(self, tokens: Tensor, mask: Tensor, prompt_len: int) -> Tensor:
        """:meth:`logprobs` through the scorer: each row's real tokens, scored from its first generated one."""
        real = mask.bool()
        seqs = [row[keep].tolist() for row, keep in zip(tokens, real)]
        starts = [max(int(n), 1) for n in real[:, :prompt_len].sum(1).tolist()]
        scores = self.scorer.score(seqs, starts)
        out = torch.zeros(tokens.shape[0], tokens.shape[1] - prompt_len, dtype=torch.float32, device=tokens.device)
        for i, vals in enumerate(scores):
            cols = real[i, prompt_len:].nonzero()[:, 0]
            if len(vals) != len(cols):
                raise ValueError(f"the teacher's scorer returned {len(vals)} log-probs for row {i}, which has "
                                 f"{len(cols)} generated tokens")
            out[i, cols] = torch.tensor(vals, dtype=torch.float32, device=tokens.device)
        return out

    def __call__(self, tokens: Tensor, mask: Tensor, action_mask: Tensor, prompt_len: int,
                 student_logp: Tensor | None = None, student_logits: Tensor | None = None) -> Tensor:
        """Per-token rewards ``[N, M]`` of a rollout's layout (``tokens[N, P + M]``, ``action_mask[N, M]``), given the
        student's log-probs of its tokens (``sampled``) or its logits ``[N, M, V]`` (``topk``, ``full``)."""
        if self.estimator == "sampled":
            return teacher_token_rewards(action_mask, "sampled", student_logp=student_logp, coef=self.coef,
                                         teacher_logp=self.logprobs(tokens, mask, prompt_len))
        return teacher_token_rewards(action_mask, self.estimator, student_logits=student_logits, top_k=self.top_k,
                                     teacher_logits=self.logits(tokens, mask, prompt_len), coef=self.coef)

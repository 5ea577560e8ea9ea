"""On-policy distillation (Agarwal et al. 2024, GKD; Lu et al. / Thinking Machines 2025): the student samples, a
frozen teacher grades every sampled token, and the per-token reward ``-KL(student || teacher)``, with discount 0,
is the advantage of GRPO's importance-sampled, clipped policy-gradient loss.

Reads top to bottom: config -> agent (the teacher, loaded once and frozen) -> ``prepare``: the teacher's log-probs
of the rollout's tokens and the per-token advantages (the teacher's reward; optionally GRPO's group-relative
advantages of the env's own rewards, weighted by ``outcome_coef``, and a per-token length penalty) -> ``loss``:
GRPO's clipped surrogate on them; for the ``topk`` and ``full`` estimators, ``distill_coef * KL(pi_theta ||
teacher)`` per token over the two distributions instead of the teacher's reward, whose gradient is the exact
expectation over the token of the ``sampled`` estimator's per-token policy gradient.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tokengym.agents import functional as F
from tokengym.agents.algorithms.advantages import advantage_estimator
from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.algorithms.losses import LOSSES, policy_loss
from tokengym.agents.algorithms.onpolicy import Minibatch
from tokengym.agents.algorithms.registry import register
from tokengym.agents.engine.resources import check_fits
from tokengym.agents.engine.rollout import Rollout, used_slice
from tokengym.agents.runtime.config_io import first_line
from tokengym.rewards.teacher import ESTIMATORS, TeacherReward, reverse_kl, teacher_token_rewards

__all__ = ["DistillConfig", "DistillAgent", "load_teacher", "past_length"]


@dataclass
class DistillConfig(GRPOConfig):
    """Hyper-parameters of :class:`DistillAgent`: GRPO's, and the teacher's below."""

    teacher: str | None = None
    """The teacher: a run folder (its model/), a model folder, a shipped checkpoint, a GGUF model or a preset; it
    must share the student's tokenizer (tokengym train distill --teacher RUN_OR_MODEL)."""
    estimator: str = "sampled"
    """Per-token reverse KL to the teacher: sampled (at the sampled token: the reward of the policy gradient), topk
    (over the student's top_k tokens, both distributions renormalised there) or full (the vocabulary); topk and full
    add distill_coef * KL(pi_theta || teacher) to the loss instead of the reward (one teacher pass per minibatch)."""
    top_k: int = 20
    """The topk estimator's support: the student's most likely tokens at each position (>= the vocabulary: full)."""
    teacher_temperature: float = 1.0
    """Divides the teacher's logits: its log-probs are of that distribution."""
    distill_coef: float = 1.0
    """Weight of the teacher's per-token reward (sampled) or KL term (topk, full)."""
    outcome_coef: float = 0.0
    """Weight of GRPO's group-relative advantages of the env's own rewards (those of the advantage estimator: outcome,
    process, ...) added to the teacher's per-token ones; 0 = distillation alone, with no group baseline."""
    length_penalty: float = 0.0
    """Subtracted from the advantage of every agent token past length_penalty_after tokens, except the token that
    ends a terminated episode (0 = off; the env's token budget stops every episode in any case)."""
    length_penalty_after: int = 0
    """Agent tokens per episode before length_penalty applies."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if policy_loss(self.loss).sequence_level:
            per_token = [n for n in LOSSES if not policy_loss(n).sequence_level]
            raise ValueError(f"DistillConfig: loss={self.loss!r} takes one advantage per sequence; the teacher's are "
                             f"per token (use loss={' or '.join(map(repr, per_token))})")

    def checks(self) -> dict[str, bool]:
        finite = math.isfinite
        return {**super().checks(), "top_k": self.top_k >= 1,
                "teacher_temperature": finite(self.teacher_temperature) and self.teacher_temperature > 0,
                "distill_coef": finite(self.distill_coef) and self.distill_coef > 0,
                "outcome_coef": finite(self.outcome_coef) and self.outcome_coef >= 0,
                "length_penalty": finite(self.length_penalty) and self.length_penalty >= 0,
                "length_penalty_after": self.length_penalty_after >= 0}

    def choices(self) -> dict[str, Iterable[Any]]:
        return {**super().choices(), "estimator": ESTIMATORS}


def past_length(action_mask: torch.Tensor, terminated: torch.Tensor, after: int) -> torch.Tensor:
    """``[N, M]`` 1 on each row's agent tokens after its first ``after``, except the last agent token of a terminated
    row (its stop token: the one token the length penalty should not discourage)."""
    am = action_mask.bool()
    count = am.long().cumsum(1)
    last = am & (count == count[:, -1:]) & terminated.bool()[:, None]
    return (am & (count > after) & ~last).to(torch.float32)


def _teacher_folder(name: str) -> str:
    """A run folder's ``model/`` (what ``tokengym train`` writes), else ``name`` itself; ``ValueError`` (one line) for
    a run folder without one yet (its ``config.json`` is the run's, which no model loader recognizes)."""
    import json

    inner = os.path.join(name, "model")
    if os.path.isfile(os.path.join(inner, "config.json")):
        return inner
    try:
        with open(os.path.join(name, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return name
    if isinstance(saved, dict) and "algorithm" in saved and "run" in saved:
        raise ValueError(f"teacher {name} is a run with no model/ yet (still training?): wait for it to finish, or "
                         "pass a model folder")
    return name


def load_teacher(teacher: Any, policy: Any, cfg: DistillConfig) -> TeacherReward:
    """The run's :class:`~tokengym.rewards.TeacherReward`: ``teacher`` is a name or folder (loaded on the policy's
    device) or anything with ``.model`` and ``.tokenizer`` (a :class:`~tokengym.agents.Policy`); the config's
    settings apply. A missing teacher, one that cannot load, or one with another vocabulary: one-line ValueError."""
    from tokengym.agents.engine.models import load_model

    if teacher is None:
        raise ValueError("distillation needs a teacher: DistillConfig(teacher=RUN_OR_MODEL) or DistillAgent(..., "
                         "teacher=policy); on the command line, --teacher RUN_OR_MODEL")
    if isinstance(teacher, (str, os.PathLike)):
        folder = _teacher_folder(os.fspath(teacher))
        try:
            model, tok = load_model(folder, device=policy.device)
        except Exception as e:
            raise ValueError(f"cannot load teacher {os.fspath(teacher)!r}: {first_line(e)}") from None
    elif callable(getattr(teacher, "score", None)):  # an engine's scoring call (the generation seam)
        model, tok = teacher, getattr(teacher, "tokenizer", None) or teacher.policy.tokenizer
    elif hasattr(teacher, "model") and hasattr(teacher, "tokenizer"):
        model, tok = teacher.model, teacher.tokenizer
    else:
        raise ValueError(f"teacher must be a model name or folder, a Policy or a generator with score(), got "
                         f"{type(teacher).__name__}")
    if model is policy.model:  # freezing the teacher would freeze the student
        raise ValueError("the teacher is the student's own model: pass a separate copy (Policy.from_pretrained again)")
    out = TeacherReward(model, tok, cfg.estimator, cfg.top_k, cfg.teacher_temperature, cfg.distill_coef, cfg.packing)
    out.check_student(policy.tokenizer)
    if cfg.estimator == "sampled":
        return out
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (model, policy.model)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"estimator={cfg.estimator!r} compares whole distributions, but the teacher's head has "
                         f"{sizes[0]} outputs and the student's {sizes[1]}; use estimator='sampled'")
    return out


class DistillAgent(GRPOAgent):
    """On-policy distillation from a frozen teacher on any token env (see the module docstring).

    Args:
        policy: the student :class:`~tokengym.agents.Policy` (sampling settings are the policy's).
        config: :class:`DistillConfig`.
        run_dir: where to write TensorBoard events and ``metrics.jsonl`` (None = memory only).
        teacher: the teacher, when not ``config.teacher``: a name or folder, a :class:`~tokengym.agents.Policy`, or a
            generator with the generation seam's scoring call (an engine serving the teacher; ``sampled`` only).

    Example:
        >>> import gymnasium as gym, tokengym.envs
        >>> from tokengym.agents import Policy, DistillAgent, DistillConfig
        >>> env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=2)
        >>> agent = DistillAgent(Policy.from_pretrained("tiny"), DistillConfig(steps=2, teacher="tiny-arithmetic"))
        >>> history = agent.learn(env)
        >>> last = history[-1]
        >>> round(last["train/reverse_kl"], 1) > 0
        True
    """

    config_cls = DistillConfig

    def __init__(self, policy, config=None, run_dir: str | None = None, teacher: Any = None):
        super().__init__(policy, config, run_dir)
        self.teacher = load_teacher(teacher if teacher is not None else self.config.teacher, policy, self.config)
        self.needs_logits = self.config.estimator != "sampled"

    @staticmethod
    def needs_process_reward(config) -> bool:
        return advantage_estimator(config.advantage).needs_process_reward and config.outcome_coef > 0

    def why_groups(self) -> str | None:
        if self.config.outcome_coef > 0 and self.config.scale_rewards != "batch":
            return "outcome_coef > 0 mixes in GRPO's group-relative advantages"
        return None

    def check_env(self, env) -> None:
        """GRPO's checks, and the teacher's positions against the env's rows (refused before any rollout)."""
        super().check_env(env)
        try:
            if self.teacher.positions_model is not None:
                check_fits(self.teacher.positions_model, env)
        except ValueError as e:
            raise ValueError(f"the teacher: {e}") from None

    def advantages(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
        """The advantages ``[N, M]`` besides the teacher's: GRPO's times ``outcome_coef``, minus the length penalty."""
        cfg = self.config
        adv = torch.zeros(ro.action_mask.shape, dtype=torch.float32, device=ro.tokens.device)
        if cfg.outcome_coef > 0:
            adv = cfg.outcome_coef * super().advantages(ro, ref_logp)
        if cfg.length_penalty > 0:
            adv = adv - cfg.length_penalty * past_length(ro.action_mask, ro.terminated, cfg.length_penalty_after)
        return adv * ro.action_mask

    @torch.no_grad()
    def teacher_logprobs(self, ro: Rollout) -> torch.Tensor:
        """The teacher's log-probs ``[N, M]`` of the rollout's tokens (over the used columns, zero-padded)."""
        tokens, mask, p, m = used_slice(ro)
        with self._autocast(ro.tokens.device):
            lp = self.teacher.logprobs(tokens, mask, p)
        return torch.nn.functional.pad(lp, (0, ro.action_mask.shape[1] - m))

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None):
        """GRPO's batch; for ``sampled``, the teacher's per-token reward added to the advantages (from the sampler's
        log-probs, those of the distribution the tokens were drawn from)."""
        batch, stats = super().prepare(ro, old_logp, ref_logp)
        if self.config.estimator == "sampled":
            batch["teacher_logp"] = t = self.teacher_logprobs(ro)
            batch["distill_kl"] = torch.where(ro.action_mask.bool(), ro.logprobs.float() - t, 0.0)
            batch["adv"] = batch["adv"] + teacher_token_rewards(batch["mask"], "sampled", student_logp=ro.logprobs,
                                                                teacher_logp=t, coef=self.config.distill_coef)
        return batch, stats

    def forward_extra(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int, m: int) -> dict[str, torch.Tensor]:
        """``topk``/``full``: the teacher's logits over the minibatch (no gradient) and its log-probs of the tokens."""
        if not self.needs_logits:
            return {}
        logits = self.teacher.logits(tokens, mask, prompt_len)
        return {"teacher_logits": logits,
                "teacher_logp": torch.log_softmax(logits, -1).gather(2, tokens[:, prompt_len:, None])[..., 0]}

    def loss(self, mb: Minibatch, batch: dict[str, torch.Tensor]):
        """GRPO's terms, plus ``distill_coef * KL(pi_theta || teacher)`` for ``topk``/``full``; logs the per-token
        reverse KL (``train/reverse_kl``) and the teacher's log-prob of the student's tokens (``train/teacher_logp``),
        each averaged over tokens as ``aggregation`` averages the loss."""
        cfg = self.config
        terms, stats = super().loss(mb, batch)
        am = mb.take(batch["mask"])
        if self.needs_logits:
            kl = reverse_kl(mb.logits, mb.extra["teacher_logits"], cfg.top_k if cfg.estimator == "topk" else None)
            terms.append((cfg.distill_coef * F.masked_aggregate(kl, am, cfg.aggregation), cfg.aggregation))
            kl, teacher_logp = kl.detach(), mb.extra["teacher_logp"]
        else:
            kl, teacher_logp = mb.take(batch["distill_kl"]), mb.take(batch["teacher_logp"])
        # aggregated as the loss is, so that data-parallel ranks' shares combine into the whole batch's value
        stats["reverse_kl"] = F.masked_aggregate(kl, am, cfg.aggregation)
        stats["teacher_logp"] = F.masked_aggregate(teacher_logp, am, cfg.aggregation)
        return terms, stats


register("distill", DistillConfig, "On-policy distillation: a teacher's per-token reverse KL as the reward",
         agent=DistillAgent, min_group=1, data_parallel=True)

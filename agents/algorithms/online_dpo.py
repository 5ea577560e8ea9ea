"""Online / iterative DPO: preference pairs mined from the policy's own samples, round after round.

The offline learner (:class:`~tokengym.agents.algorithms.dpo.DPOLearner`) trains on a fixed set of pairs; the
functions here make a fresh set each round with the policy as it is at that round's start and hand it
to ``learner.fit``:

* :func:`iterative_dpo` ("RLHF Workflow", Dong et al. 2024): the (best, worst) completion of each
  group of a ``group_size=G`` env, ranked by the env's reward.
* :func:`spin` (SPIN, Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong
  Language Models"): the task's reference solution (chosen) against the policy's own sample of the same
  prompt (rejected, :func:`spin_pairs`); no reward is needed, only reference solutions. The opponent
  is the previous iterate: every round's reference model is the policy at that round's start. SPIN's
  loss is DPO's sigmoid loss; :class:`SPINConfig` holds the DPO settings and the rounds.

Rounds are the unit of resume: after ``learner.load_state_dict`` of a state saved in the round
callback, a call with the same arguments runs the remaining rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.data.pairs import PairData, mine_pairs
from tokengym.agents.engine.rollout import collect, evaluate
from tokengym.agents.algorithms.sft import make_batch
from tokengym.envs.tasks.base import fresh_samples
from tokengym.agents.algorithms.registry import register

__all__ = ["iterative_dpo", "SPINConfig", "spin_pairs", "spin"]


def _end_round(learner: DPOLearner, r: int, rec: dict[str, Any], eval_env: Any, eval_samples: list | None,
               records: list, callback: Callable[[dict[str, float]], Any] | None) -> bool:
    """Close round ``r`` of a round loop: greedy held-out metrics, the resume marker, the log record, the callback;
    False when the callback asks to stop."""
    if eval_env is not None and eval_samples:
        learner.policy.eval()
        rec.update({f"eval/{k}": v for k, v in evaluate(learner.policy, eval_env, eval_samples, greedy=True).items()})
    learner._round = r + 1
    record = learner.logger.log(learner.global_step, rec)
    records.append(record)
    return not (callback is not None and callback(record) is False)


def iterative_dpo(
    learner: DPOLearner,
    env: Any,
    rounds: int = 2,
    batches_per_round: int = 1,
    reset_ref: bool = True,
    min_gap: float = 0.0,
    score: str = "return",
    eval_env: Any = None,
    eval_samples: list | None = None,
    callback: Callable[[dict[str, float]], Any] | None = None,
) -> list[dict[str, float]]:
    """Online (iterative) DPO: sample, rank, pair, train; ``rounds`` times.

    Each round: ``batches_per_round`` rollouts of a ``group_size=G`` env with the current policy (G
    sampled completions per prompt, scored by the env's reward) -> the (best, worst) completion of every
    group with a reward gap (:func:`~tokengym.agents.data.pairs.mine_pairs`; groups without a gap are
    skipped) -> ``learner.fit`` on those pairs. With ``reset_ref`` the reference of each round is the
    policy at the round's start (a trust region per round); otherwise it stays the initial policy.

    Mined pairs are often near-identical (a correct and a wrong sample that differ in one digit): plain
    DPO then tends to lower the chosen likelihood too; ``DPOConfig(dpop_lambda=5.0)`` (DPO-Positive)
    is what made the env's reward rise on the tiny arithmetic warm start (see ``DPOConfig``).

    Returns one record per round (also logged to the learner's run): ``round``, ``reward/mean`` and
    ``reward/accuracy`` of the round's samples (the policy *before* the round's update), ``pairs/count``,
    ``pairs/skipped_groups_frac``, and greedy ``eval/*`` after the round when ``eval_env`` and
    ``eval_samples`` are given. ``callback(record)`` is called after every round; returning ``False``
    stops there. Resume is per round: after ``learner.load_state_dict`` of a state saved in the callback
    (and the env's own ``load_state_dict``), a call with the same arguments runs the remaining rounds.
    """
    if rounds < 1 or batches_per_round < 1:
        raise ValueError(f"rounds and batches_per_round must be >= 1, got {rounds}, {batches_per_round}")
    if env.group_size < 2:
        raise ValueError(f"iterative DPO needs groups: create the env with group_size >= 2 (got {env.group_size})")
    if not reset_ref and learner.ref is None and rounds > 1:
        raise ValueError("reset_ref=False keeps the initial policy as reference, but this learner has no reference model "
                         "(precompute_ref=True computes reference log-probs from the policy at each fit); pass ref= to "
                         "DPOLearner or use reset_ref=True")
    policy, cfg = learner.policy, learner.config
    records = []
    start, learner._resume_round = learner._resume_round or 0, None  # rounds already done (resume)
    if start:
        learner._resume_fit = None  # the unit of resume is the round: the saved fit had finished
    elif learner.global_step == 0:
        policy.seed(cfg.seed)
    learner._round = start
    first = start == 0
    for r in range(start, rounds):
        if reset_ref and r > 0:
            learner.reset_reference()
        policy.eval()
        parts, rewards, n_groups = [], [], 0
        for _ in range(batches_per_round):
            ro = collect(env, policy, seed=cfg.seed if first else None)
            first = False
            parts.append(mine_pairs(ro, min_gap=min_gap, score=score))
            rewards.append(ro.rewards.sum(1) if score == "return" else ro.outcome)
            n_groups += ro.num_episodes // ro.group_size
        data = PairData.concat([p for p in parts if len(p)]) if any(len(p) for p in parts) else None
        rw = torch.cat(rewards).float()
        rec = {"round": r, "reward/mean": rw.mean(), "reward/accuracy": (rw >= 1.0 - 1e-6).float().mean(),
               "pairs/count": 0 if data is None else len(data),
               "pairs/skipped_groups_frac": 1.0 - (0 if data is None else len(data)) / n_groups}
        if data is not None:
            learner.fit(data)
        if not _end_round(learner, r, rec, eval_env, eval_samples, records, callback):
            break
    return records


# ====================================================================== SPIN
@dataclass
class SPINConfig(DPOConfig):
    """:class:`~tokengym.agents.algorithms.dpo.DPOConfig` plus SPIN's rounds, with DPO defaults that suit SPIN's pairs.

    The rejected completions are the policy's own samples, mostly wrong in one place: plain DPO at the
    offline default lr 1e-4 collapses on such pairs (``bench/RESULTS.md``), so SPIN takes a smaller step.
    """

    lr: float = 1e-5  # smaller than DPO's: the rejected completions are the policy's own samples
    rounds: int = 3
    """Self-play rounds: each mines fresh pairs with the policy as it is at the round's start."""
    prompts_per_round: int = 512
    """Prompts per round, one policy sample each (a sample that reproduces the reference makes no pair)."""

    def checks(self) -> dict[str, bool]:
        return {"rounds": self.rounds >= 1, "prompts_per_round": self.prompts_per_round >= 1}


def _draw_prompts(task: Any, n: int, seed: int | Sequence[int], exclude: set[str]) -> list[dict[str, Any]]:
    """``n`` samples of ``task`` from ``default_rng(seed)``, skipping prompts in ``exclude``; all with a reference solution."""
    out = fresh_samples(task, n, np.random.default_rng(seed), exclude)
    missing = [i for i, s in enumerate(out) if not isinstance(s.get("solution"), str)]
    if missing:
        raise ValueError(f"SPIN needs reference solutions: samples of task {getattr(task, 'name', type(task).__name__)!r} "
                         "have no 'solution' text (chosen completions are the task's reference solutions)")
    return out


def _check_spin_env(env: Any) -> None:
    if env.group_size != 1:
        raise ValueError(f"SPIN samples one completion per prompt: create the env with group_size=1 (got {env.group_size})")
    if getattr(env, "multi_turn", False):
        raise ValueError("SPIN pairs single-turn completions; this env's task is multi-turn")


def spin_pairs(policy: Any, env: Any, n_prompts: int, seed: int | Sequence[int] = 0,
               exclude_prompts: Iterable[str] = ()) -> PairData:
    """SPIN's pairs on ``n_prompts`` prompts of ``env.task``: (reference solution, the policy's own sample).

    Prompts come from ``numpy.random.default_rng(seed)`` (anything it takes), skipping
    ``exclude_prompts``. The rejected completion is one sample of ``policy`` (its own sampler and
    generator) on ``env``, a ``group_size=1`` env, as the policy generated it (its tokens, never
    re-tokenized); the chosen one is the reference solution laid out as the SFT warm start lays it out
    (:func:`~tokengym.agents.algorithms.sft.make_batch`: solution, then EOS). A sample that reproduces the
    reference carries no preference and is dropped, so the result may be empty. Records carry
    ``prompt``, ``chosen``, ``rejected`` (texts) and ``rejected_reward``.
    """
    _check_spin_env(env)
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    samples = _draw_prompts(env.task, n_prompts, seed, set(exclude_prompts))
    P, n = env.max_prompt_len, env.num_envs
    prompts, chosen, rejected, records = [], [], [], []
    policy.eval()
    for start in range(0, len(samples), n):
        chunk = samples[start:start + n]
        ro = collect(env, policy, samples=chunk + chunk[:1] * (n - len(chunk)))
        ref = make_batch(chunk, policy.tokenizer, P)
        for i, s in enumerate(chunk):
            c = ref.tokens[i, P:][ref.mask[i, P:]].tolist()
            r = ro.tokens[i, P:][ro.attention_mask[i, P:].bool()].cpu().tolist()
            if c == r or ro.completions[i] == s["solution"]:
                continue
            prompts.append(ro.tokens[i, :P][ro.attention_mask[i, :P].bool()].cpu().tolist())
            chosen.append(c)
            rejected.append(r)
            records.append({"prompt": s["prompt"], "chosen": s["solution"], "rejected": ro.completions[i],
                            "rejected_reward": float(ro.outcome[i])})
    pad = int(policy.tokenizer.pad_token_id)
    if not records:
        return PairData(torch.full((0, 1), pad), torch.zeros((0, 1), dtype=torch.bool), torch.full((2, 0, 1), pad),
                        torch.ones((2, 0), dtype=torch.long), pad)
    return PairData.from_token_ids(prompts, chosen, rejected, pad, records)


def spin(
    learner: DPOLearner,
    env: Any,
    rounds: int | None = None,
    prompts_per_round: int | None = None,
    exclude_prompts: Iterable[str] = (),
    eval_env: Any = None,
    eval_samples: list | None = None,
    callback: Callable[[dict[str, float]], Any] | None = None,
) -> list[dict[str, float]]:
    """Self-play fine-tuning (SPIN): ``rounds`` rounds of (reference solution vs own sample) DPO.

    Each round: the policy as it is now becomes the reference (``learner.reset_reference()``: the
    opponent is the previous iterate), :func:`spin_pairs` on ``prompts_per_round`` fresh prompts of
    ``env`` (a ``group_size=1`` env; round ``r`` draws from seed ``(config.seed, r)``, skipping
    ``exclude_prompts`` and the prompts of ``eval_samples``), then ``learner.fit`` on those pairs (a
    round without pairs, where every sample reproduced its reference, trains nothing).
    ``rounds`` / ``prompts_per_round`` default to the learner's :class:`SPINConfig` (else 3 / 512).

    Returns one record per round (also logged to the learner's run): ``round``, ``pairs/count``,
    ``pairs/matched_frac`` (prompts whose sample was the reference), and greedy ``eval/*`` after the
    round when ``eval_env`` and ``eval_samples`` are given. ``callback(record)`` is called after every
    round; returning ``False`` stops there. Resume is per round, as in :func:`iterative_dpo`.
    """
    cfg = learner.config
    spin_cfg = cfg if isinstance(cfg, SPINConfig) else SPINConfig
    if rounds is None:
        rounds = spin_cfg.rounds
    if prompts_per_round is None:
        prompts_per_round = spin_cfg.prompts_per_round
    if rounds < 1 or prompts_per_round < 1:
        raise ValueError(f"rounds and prompts_per_round must be >= 1, got {rounds}, {prompts_per_round}")
    _check_spin_env(env)
    exclude = set(exclude_prompts) | {s["prompt"] for s in eval_samples or ()}
    policy = learner.policy
    records = []
    start, learner._resume_round = learner._resume_round or 0, None  # rounds already done (resume)
    if start:
        learner._resume_fit = None  # the unit of resume is the round: the saved fit had finished
    elif learner.global_step == 0:
        policy.seed(cfg.seed)
    learner._round = start
    for r in range(start, rounds):
        learner.reset_reference()
        data = spin_pairs(policy, env, prompts_per_round, seed=(cfg.seed, r), exclude_prompts=exclude)
        if len(data):
            learner.fit(data)
        rec = {"round": r, "pairs/count": len(data), "pairs/matched_frac": 1.0 - len(data) / prompts_per_round}
        if not _end_round(learner, r, rec, eval_env, eval_samples, records, callback):
            break
    return records


register("spin", SPINConfig, "SPIN: self-play DPO rounds, the task's reference solution against the model's own sample",
         run_fields=frozenset({"temperature"}), resumable=False)

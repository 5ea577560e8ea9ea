"""Online / iterative DPO: preference pairs mined from the policy's own samples, round after round.

The offline learner (:class:`~tokengym.agents.dpo.DPOLearner`) trains on a fixed set of pairs; the
functions here make a fresh set each round with the policy as it is at that round's start and hand it
to ``learner.fit``:

* :func:`iterative_dpo` ("RLHF Workflow", Dong et al. 2024): the (best, worst) completion of each
  group of a ``group_size=G`` env, ranked by the env's reward.

Rounds are the unit of resume: after ``learner.load_state_dict`` of a state saved in the round
callback, a call with the same arguments runs the remaining rounds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tokengym.agents.dpo import DPOLearner
from tokengym.agents.pairs import PairData, mine_pairs
from tokengym.agents.rollout import collect, evaluate

__all__ = ["iterative_dpo"]


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
    group with a reward gap (:func:`~tokengym.agents.pairs.mine_pairs`; groups without a gap are
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
        if eval_env is not None and eval_samples:
            policy.eval()
            rec.update({f"eval/{k}": v for k, v in evaluate(policy, eval_env, eval_samples, greedy=True).items()})
        learner._round = r + 1
        record = learner.logger.log(learner.global_step, rec)
        records.append(record)
        if callback is not None and callback(record) is False:
            break
    return records

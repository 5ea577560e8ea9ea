"""Training data for learned rewards that needs the environments or a policy.

* :func:`sample_solutions`: a policy's sampled completions of task prompts, judged by the task's verifier.
* :func:`sampled_pairs`: preference pairs "reference solution (chosen) vs the policy's own wrong sample
  (rejected)": negatives from the distribution a reward model will score during RL.
* :func:`on_policy_pairs`: pairs within groups of a policy's samples of the same prompt, "a verifier-correct
  sample (or the reference when none is) vs a verifier-wrong one": the ranking PPO asks of a reward model.
* :func:`arithmetic_step_labels`: step-labelled solutions for a learned PRM, with the labels of the
  rule-based checker (:class:`~tokengym.rewards.ArithmeticStepReward`) on reference, corrupted and
  (optionally) a policy's sampled solutions.

Data that needs neither (reference vs corrupted pairs and step labels) is the task's own
(:meth:`~tokengym.envs.tasks.Task.preference_pairs`, :meth:`~tokengym.envs.tasks.Task.step_labels`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tokengym.agents.engine.rollout import collect
from tokengym.envs.tasks import arithmetic_data
from tokengym.envs.tasks.base import fresh_samples
from tokengym.envs.vector_env import TokenVectorEnv

__all__ = ["sample_solutions", "sampled_pairs", "on_policy_pairs", "arithmetic_step_labels"]


def sample_solutions(policy: Any, task: Any, n: int, seed: int = 0, exclude_prompts: Iterable[str] = (),
                     num_envs: int = 256, max_new_tokens: int | None = None) -> list[dict[str, Any]]:
    """``n`` sampled completions of fresh prompts of ``task``, one per prompt, judged by the task's reward.

    Each record is the task sample (``prompt``, ``solution``, ``answer``, ...) plus ``completion``
    (decoded text), ``reward`` (the task's outcome reward), ``correct`` (``reward >= 1``) and
    ``truncated``. Sampling uses the policy's own settings and is seeded by ``seed`` (which also draws the
    prompts); the policy's generator state is restored afterwards.

    Example:
        >>> from tokengym.agents import Policy
        >>> from tokengym.envs.tasks import ArithmeticTask
        >>> recs = sample_solutions(Policy.from_pretrained("tiny"), ArithmeticTask(), 4, num_envs=4)
        >>> len(recs), sorted(recs[0])
        (4, ['answer', 'completion', 'correct', 'prompt', 'reward', 'solution', 'truncated'])
    """
    if n < 1 or num_envs < 1:
        raise ValueError(f"n and num_envs must be >= 1, got {n}, {num_envs}")
    rng = np.random.default_rng(seed)
    prompts = fresh_samples(task, n, rng, set(exclude_prompts))
    env = TokenVectorEnv(min(num_envs, n), task, tokenizer=policy.tokenizer, max_new_tokens=max_new_tokens)
    state = policy.generator.get_state()
    policy.seed(seed)
    out: list[dict[str, Any]] = []
    try:
        for start in range(0, n, env.num_envs):
            chunk = prompts[start : start + env.num_envs]
            chunk = chunk + chunk[:1] * (env.num_envs - len(chunk))
            ro = collect(env, policy, samples=chunk)
            for i, s in enumerate(chunk[: min(env.num_envs, n - start)]):
                r = float(ro.outcome[i])
                out.append({**s, "completion": ro.completions[i], "reward": r, "correct": r >= 1.0 - 1e-6,
                            "truncated": bool(ro.truncated[i])})
    finally:
        policy.generator.set_state(state)
    return out


def sampled_pairs(policy: Any, task: Any, n: int, seed: int = 0, exclude_prompts: Iterable[str] = (),
                  num_envs: int = 256, max_draws: int = 20) -> list[dict[str, Any]]:
    """``n`` pairs "reference solution (chosen) vs a wrong sample of ``policy`` (rejected)".

    Prompts whose sample is correct give no pair; sampling goes on (up to ``max_draws`` rounds) until
    ``n`` pairs are found. Records carry ``answer`` and ``kind="sampled"``, like
    :func:`~tokengym.agents.data.pairs.arithmetic_pairs`, so both kinds can be mixed.
    """
    pairs: list[dict[str, Any]] = []
    seen = set(exclude_prompts)
    for draw in range(max_draws):
        recs = sample_solutions(policy, task, max(2 * (n - len(pairs)), 16), seed + 7919 * draw, seen, num_envs)
        for r in recs:
            seen.add(r["prompt"])
            if not r["correct"] and r["completion"].strip() and r["completion"] != r["solution"]:
                pairs.append({"prompt": r["prompt"], "chosen": r["solution"], "rejected": r["completion"],
                              "answer": r.get("answer"), "kind": "sampled"})
        if len(pairs) >= n:
            return pairs[:n]
    raise RuntimeError(f"only {len(pairs)} of {n} wrong samples after {max_draws} rounds: the policy is almost always right")


def on_policy_pairs(policy: Any, task: Any, n_prompts: int, group_size: int = 8, pairs_per_prompt: int = 4, seed: int = 0,
                    exclude_prompts: Iterable[str] = (), num_envs: int = 256,
                    progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Pairs of the policy's own samples of one prompt: a verifier-correct one (chosen) vs a wrong one (rejected).

    ``n_prompts`` fresh prompts (none from ``exclude_prompts``) are each sampled ``group_size`` times
    and judged by the task's reward (correct = reward >= 1). A prompt with at least one wrong sample
    gives up to ``pairs_per_prompt`` distinct (chosen, rejected) pairs of distinct texts, drawn
    without replacement; its chosen side is a correct sample, or the task's reference solution (the
    same format, e.g. ``"63+51=114\\n114+26=140\\nA: 140"``) when none of its samples is correct. Prompts
    the policy always solves give none. Both sides of most pairs are then what a reward model meets
    during RL from this policy, and they differ where the policy really slips (on Arithmetic: a carry),
    unlike bundled corruptions (random digits) or "reference vs wrong sample" pairs, which the tiny
    warm start's RM could not turn into a ranking of its samples (see ``tests/agents/data/test_rlhf_pipeline.py``).

    Sampling uses the policy's own settings, is seeded by ``seed`` (which also draws the prompts) and
    restores the policy's generator state afterwards. ``progress(done, n_prompts)`` is called after each rollout
    batch (the mining takes minutes on a large ``n_prompts``). Records carry ``prompt``, ``chosen``, ``rejected``,
    ``answer``, ``kind="on_policy"`` and ``chosen_source`` (``"sample"`` or ``"reference"``), in prompt order.

    Example:
        >>> from tokengym.agents import Policy
        >>> from tokengym.envs.tasks import ArithmeticTask
        >>> pairs = on_policy_pairs(Policy.from_pretrained("tiny"), ArithmeticTask(), 4, group_size=4, num_envs=16)
        >>> sorted(pairs[0]), pairs[0]["chosen_source"]  # an untrained policy is never right
        (['answer', 'chosen', 'chosen_source', 'kind', 'prompt', 'rejected'], 'reference')
    """
    if n_prompts < 1 or group_size < 2 or pairs_per_prompt < 1 or num_envs < group_size:
        raise ValueError(f"need n_prompts >= 1, group_size >= 2, pairs_per_prompt >= 1 and num_envs >= group_size, "
                         f"got {n_prompts}, {group_size}, {pairs_per_prompt}, {num_envs}")
    rng = np.random.default_rng(seed)
    prompts = fresh_samples(task, n_prompts, rng, set(exclude_prompts))
    env = TokenVectorEnv(min(num_envs // group_size, n_prompts) * group_size, task, tokenizer=policy.tokenizer, group_size=group_size)
    per_batch = env.n_groups
    state = policy.generator.get_state()
    policy.seed(seed)
    pairs: list[dict[str, Any]] = []
    if progress is not None:
        progress(0, n_prompts)
    try:
        for start in range(0, n_prompts, per_batch):
            chunk = prompts[start : start + per_batch]
            ro = collect(env, policy, samples=chunk + chunk[:1] * (per_batch - len(chunk)))
            correct = (ro.outcome >= 1.0 - 1e-6).view(per_batch, group_size).tolist()
            for g, s in enumerate(chunk):
                texts = ro.completions[g * group_size : (g + 1) * group_size]
                good = sorted({t for t, ok in zip(texts, correct[g]) if ok})
                bad = sorted({t for t, ok in zip(texts, correct[g]) if not ok})
                if not bad:
                    continue
                source = "sample" if good else "reference"
                good = good or [s["solution"]]
                combos = [(c, r) for c in good for r in bad]
                for k in rng.permutation(len(combos))[:pairs_per_prompt]:
                    pairs.append({"prompt": s["prompt"], "chosen": combos[k][0], "rejected": combos[k][1],
                                  "answer": s.get("answer"), "kind": "on_policy", "chosen_source": source})
            if progress is not None:
                progress(min(start + per_batch, n_prompts), n_prompts)
    finally:
        policy.generator.set_state(state)
    return pairs


def arithmetic_step_labels(task: Any, n: int, seed: int = 0, policy: Any = None, sampled_fraction: float = 0.5,
                           reference_fraction: float = 0.2, kinds: Sequence[str] = ("step_digit", "step_operand", "answer_digit"),
                           exclude_prompts: Iterable[str] = ()) -> list[dict[str, Any]]:
    """``n`` step-labelled arithmetic solutions for :func:`tokengym.rewards.train_prm`, some of them a policy's.

    With ``policy``, ``sampled_fraction`` of them are its samples (the mistakes a policy really makes, labelled by
    the rule-based checker); the rest are :func:`tokengym.envs.tasks.arithmetic_data.arithmetic_step_labels`
    (``reference_fraction`` reference solutions, corrupted ones of ``kinds``). Without ``policy`` this is
    ``task.step_labels(n, seed, exclude_prompts)`` (with the default fractions and kinds).

    Returns:
        dicts with ``prompt``, ``steps`` (list of str), ``labels`` (0/1 per step), ``answer`` and
        ``source`` (``"reference"``, ``"sampled"`` or the corruption kind).

    Example:
        >>> from tokengym.envs.tasks import ArithmeticTask
        >>> ex = arithmetic_step_labels(ArithmeticTask(n_operands=3, operators="+"), 10, seed=1)
        >>> sorted(ex[0]), all(len(e["steps"]) == len(e["labels"]) for e in ex)
        (['answer', 'labels', 'prompt', 'source', 'steps'], True)
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not (0 <= sampled_fraction <= 1 and 0 <= reference_fraction <= 1 and sampled_fraction + reference_fraction <= 1):
        raise ValueError(f"sampled_fraction and reference_fraction must be in [0, 1] and sum to at most 1, "
                         f"got {sampled_fraction}, {reference_fraction}")
    bad = [k for k in kinds if k not in arithmetic_data.CORRUPTIONS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {sorted(arithmetic_data.CORRUPTIONS)}, got {list(kinds)!r}")
    exclude = set(exclude_prompts)
    n_sampled = round(sampled_fraction * n) if policy is not None else 0
    sampled = sample_solutions(policy, task, n_sampled, seed=seed + 1, exclude_prompts=exclude) if n_sampled else []
    return arithmetic_data.arithmetic_step_labels(task, n, seed=seed, exclude_prompts=exclude, reference_fraction=reference_fraction,
                                                  kinds=kinds, sampled=sampled)

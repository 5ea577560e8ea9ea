"""Builders of the offline ``tokengym train`` algorithms (DPO, SPIN, SFT, reward models, PRMs; each registers
itself in :mod:`tokengym.agents.algorithms`). Each loads and checks everything its run needs, raising :class:`~tokengym.agents.runtime.runs.UsageError`,
and writes nothing; the job it returns trains in the created run folder (see :mod:`tokengym.agents.cli.train`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np

from tokengym.agents.runtime import runs as R
from tokengym.agents.cli.runner import (Job, Progress, RunConfig, Trainer, eval_setup, first_line, load_policy, make_agent,
                                        make_env, phase_progress, save_model, summary)


def heldout_prompts(run: RunConfig, task: Any) -> set[str]:
    """The prompts of the run's held-out evaluation samples (none when ``eval_prompts`` is 0): the data a run
    generates for training (pairs, step labels) must not contain them."""
    from tokengym.agents.engine.rollout import heldout_samples

    return {s["prompt"] for s in heldout_samples(task, run.eval_prompts)} if run.eval_prompts > 0 else set()


def preference_pairs(run: RunConfig, task: Any, exclude: set[str]) -> list[dict[str, Any]]:
    """The run's pairs: the ``pairs`` JSONL, or bundled Arithmetic pairs (prompts in ``exclude`` left out)."""
    from tokengym.agents.data.pairs import load_pairs

    if run.pairs == ON_POLICY:
        return on_policy(run, task, exclude)
    if run.pairs is not None:
        return R.read_data_file(run.pairs, "pairs", "pairs", load_pairs)
    try:  # the task's bundled pairs (Arithmetic's corrupted solutions)
        return task.preference_pairs(run.num_pairs, seed=0, exclude_prompts=exclude)
    except NotImplementedError as e:
        raise R.UsageError(str(e)) from None


ON_POLICY = "on-policy"
LIKELIHOOD_RM_BETA = 0.5
"""Scale of the likelihood reward model's log-likelihood (the recipe of ``tests/agents/data/test_rlhf_pipeline.py``)."""


def on_policy(run: RunConfig, task: Any, exclude: set[str]) -> list[dict[str, Any]]:
    """``--pairs on-policy``: the run's model's own correct vs wrong samples of ``num_pairs`` bundled Arithmetic prompts."""
    from tokengym.agents.data.reward_data import on_policy_pairs

    if not task.has_bundled_data("preference_pairs"):
        raise R.UsageError(f"--pairs {ON_POLICY} needs a task with a verifier and reference solutions (Arithmetic), not {run.env}")
    pairs = on_policy_pairs(load_policy(run, 0), task, run.num_pairs, seed=0, exclude_prompts=exclude,
                            progress=phase_progress(run, "mining on-policy pairs", "prompts sampled"))
    if len(pairs) < 2:
        raise R.UsageError(f"the model's samples of {run.num_pairs} prompts gave {len(pairs)} pairs; raise --num-pairs")
    return pairs


def build_dpo(run: RunConfig, cfg: Any) -> Job:
    from tokengym.agents.algorithms.dpo import DPOLearner

    policy = load_policy(run, cfg.seed)
    eval_env, samples = eval_setup(run, policy.tokenizer)
    task = (eval_env or make_env(run, 1, tokenizer=policy.tokenizer)).task
    pairs = preference_pairs(run, task, heldout_prompts(run, task))
    n_eval = len(pairs) // 20  # 5% for held-out preference accuracy; none below 20 pairs
    learner = make_agent(DPOLearner, policy, cfg)
    try:  # tokenized now: chat messages without a template, empty or identical completions fail here
        train_data = learner.prepare(pairs[n_eval:])
        eval_data = learner.prepare(pairs[:n_eval]) if n_eval else None
    except ValueError as e:
        raise R.UsageError(f"pairs: {first_line(e)}") from None
    total = learner.fit_steps(train_data)

    def job(run_dir: str, resume: bool) -> dict[str, Any]:
        learner.fit_in_folder(Trainer(run, run_dir, resume, total, learner), train_data, eval_data, eval_env, samples)
        return summary(learner.logger.history)

    return job


def build_sft(run: RunConfig, cfg: Any) -> Job:
    """SFT through :class:`Trainer`: its checkpoints every ``save_every`` steps and ``--resume`` (exact)."""
    from tokengym.agents.algorithms.sft import SFTLearner

    policy = load_policy(run, cfg.seed)
    task = make_env(run, 1, tokenizer=policy.tokenizer).task
    if not task.batch(np.random.default_rng(0), 1)[0].get("solution"):
        raise R.UsageError(f"sft needs reference solutions, and {run.env}'s samples have no 'solution' field")
    try:  # (a task whose rows are past the model's positions: one line)
        learner = SFTLearner(policy, task, dataclasses.replace(cfg, run_dir=None))  # the Trainer gives it the run's logger
    except ValueError as e:
        raise R.UsageError(first_line(e)) from None

    def job(run_dir: str, resume: bool) -> dict[str, Any]:
        learner.fit_in_folder(Trainer(run, run_dir, resume, cfg.steps, learner), log=lambda step, metrics: None)
        out = summary(learner.logger.history)
        if learner.stopped_early():  # --stop-at-accuracy ended it: say where
            out["stopped"] = (f"stopped at step {learner.global_step} of {cfg.steps}: held-out greedy accuracy "
                              f"{learner.hist['eval'][-1]['accuracy']:.1%} reached stop_at_accuracy {cfg.stop_at_accuracy:.1%}")
        return out

    return job


def _fit_classifier(run: RunConfig, total: int, fit: Callable, scorer: Any, key: str, label: str) -> Job:
    """The job that trains a reward model / PRM with ``fit(callback)``, logging to the run, and saves ``scorer``."""

    def job(run_dir: str, resume: bool) -> dict[str, Any]:
        from tokengym.agents.runtime.logger import RunLogger

        logger = RunLogger(run_dir, report_to=run.report_to)
        progress = Progress(total, 0, run.progress, os.path.basename(run_dir))

        def callback(record: dict[str, Any]) -> bool:
            progress.update(logger.log(int(record["step"]), {k: v for k, v in record.items() if k != "step"}))
            return True

        fit(callback)
        progress.close()
        logger.close()
        save_model(scorer, run_dir)
        values = [r[key] for r in logger.history if r.get(key) is not None]
        return {"label": label, "final": values[-1]} if values else {}

    return job


def _text_pairs(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs a reward model can score: plain strings in each of prompt, chosen and rejected."""
    for i, p in enumerate(pairs):
        for c in ("prompt", "chosen", "rejected"):
            if not isinstance(p[c], str):
                raise R.UsageError(f"pair {i}: {c!r} holds chat messages; reward models train on plain-text pairs")
    return pairs


def build_rm(run: RunConfig, cfg: Any) -> Job:
    import math

    from tokengym.rewards import RewardModel, train_reward_model
    from tokengym.rewards.reward_model import check_pairs_fit

    if run.rm_kind not in ("sequence", "likelihood"):
        raise R.UsageError(f"rm_kind must be 'sequence' or 'likelihood', got {run.rm_kind!r}")
    if run.rm_kind == "likelihood":
        from tokengym.agents.engine.models import frozen_copy
        from tokengym.rewards import LikelihoodRewardModel

        policy = load_policy(run, cfg.seed)
        model, tok = policy.model, policy.tokenizer
        target: Any = LikelihoodRewardModel(model, tok, beta=LIKELIHOOD_RM_BETA, reference=frozen_copy(model),
                                            max_length=cfg.max_length)  # trained as DPO's implicit reward
        scorer: Any = LikelihoodRewardModel(model, tok, beta=LIKELIHOOD_RM_BETA, max_length=cfg.max_length)  # saved, scores without it
    else:
        model, tok = _classifier(run, "sequence", cfg.seed)
        scorer = RewardModel(model, tok, max_length=cfg.max_length)
        target = model
    task = make_env(run, 1, tokenizer=tok).task
    pairs = _text_pairs(preference_pairs(run, task, heldout_prompts(run, task)))
    try:  # a row past the model's positions: one line now, not an IndexError (or garbage) in the run
        check_pairs_fit(target if run.rm_kind == "likelihood" else scorer, pairs)
    except ValueError as e:
        raise R.UsageError(str(e)) from None
    _check_held_out(pairs, cfg, f"--pairs {run.pairs}" if run.pairs else f"the {len(pairs)} bundled pairs", "pairs")

    def fit(callback: Callable) -> list[dict[str, Any]]:
        history = train_reward_model(target, None if run.rm_kind == "likelihood" else tok, pairs, cfg, callback=callback)
        normalize_on_samples(run, scorer)
        return history

    total = cfg.epochs * math.ceil(len(pairs) * (1 - cfg.val_fraction) / cfg.batch_size)
    return _fit_classifier(run, total, fit, scorer, "eval/accuracy", "held-out pairwise accuracy")


def _check_held_out(rows: list[dict[str, Any]], cfg: Any, source: str, what: str) -> None:
    """The held-out split (``val_fraction`` of the prompts, whole prompts only) needs rows of two prompts or more: a
    :class:`UsageError` naming the data and the way out, before the run folder is made."""
    from tokengym.rewards.reward_model import split_rows

    if cfg.val_fraction <= 0 or not rows:  # (no rows: refused where they are read)
        return
    try:
        split_rows(rows, cfg.val_fraction, cfg.seed)
    except ValueError:
        raise R.UsageError(f"{source}: all {len(rows)} {what} share one prompt, and the held-out split (val_fraction="
                           f"{cfg.val_fraction:g}) holds out whole prompts, so no prompt is seen in both training and "
                           f"evaluation: it needs {what} of at least 2 prompts; add {what} of other prompts, or pass "
                           "--val-fraction 0 (no held-out accuracy)") from None


def normalize_on_samples(run: RunConfig, rm: Any, n: int = 256) -> None:
    """Shift and scale ``rm`` so that ``n`` samples of the run's starting model score mean 0, std 1.

    Bradley-Terry fixes only score differences; PPO's critic and KL penalty (and GRPO's ``scale_rewards="none"``)
    need a known scale, and the policy that will be trained starts from these samples.
    """
    from tokengym.agents.engine.rollout import collect

    policy = load_policy(run, 0)
    ro = collect(make_env(run, n, tokenizer=policy.tokenizer), policy, seed=1)
    rm.normalize([s["prompt"] for s in ro.samples], ro.completions)


def build_prm(run: RunConfig, cfg: Any) -> Job:
    import math

    from tokengym.rewards import LearnedPRM, train_prm
    from tokengym.rewards.learned_prm import check_step_labels

    model, tok = _classifier(run, "token", cfg.seed)
    task = make_env(run, 1, tokenizer=tok).task
    if run.step_labels is not None:
        examples: Any = R.read_data_file(run.step_labels, "step_labels", "step labels", check_step_labels)
    else:  # the task's bundled step labels (Arithmetic's corrupted solutions)
        try:
            examples = task.step_labels(run.num_pairs, seed=cfg.seed, exclude_prompts=heldout_prompts(run, task))
        except NotImplementedError as e:
            raise R.UsageError(str(e)) from None
    _check_held_out(examples, cfg, f"--step-labels {run.step_labels}" if run.step_labels is not None else
                    f"the {len(examples)} bundled step labels", "examples")
    total = cfg.epochs * math.ceil(len(examples) * (1 - cfg.val_fraction) / cfg.batch_size)
    return _fit_classifier(run, total, lambda cb: train_prm(model, tok, examples, cfg, callback=cb),
                           LearnedPRM(model, tok, delimiter=cfg.delimiter), "eval/step_accuracy", "held-out step accuracy")


def _classifier(run: RunConfig, head: str, seed: int):
    from tokengym.agents.engine.models import load_classifier

    try:
        return load_classifier(run.model, head=head, device=run.device, seed=seed)
    except (FileNotFoundError, ValueError, OSError, ImportError) as e:
        raise R.UsageError(f"cannot load model {run.model!r}: {first_line(e)}") from None


def build_spin(run: RunConfig, cfg: Any) -> Job:
    """SPIN: ``cfg.rounds`` rounds of DPO on (reference solution, the policy's own sample) pairs."""
    from tokengym.agents.algorithms.dpo import DPOLearner
    from tokengym.agents.runtime.logger import RunLogger
    from tokengym.agents.algorithms.online_dpo import spin
    from tokengym.agents.engine.rollout import evaluate

    policy = load_policy(run, cfg.seed)
    eval_env, samples = eval_setup(run, policy.tokenizer)
    env = make_env(run, min(cfg.prompts_per_round, 256), tokenizer=policy.tokenizer)
    if not env.task.batch(np.random.default_rng(0), 1)[0].get("solution"):
        raise R.UsageError(f"spin needs reference solutions, and {run.env}'s samples have no 'solution' field")
    learner = make_agent(DPOLearner, policy, cfg)

    def job(run_dir: str, resume: bool) -> dict[str, Any]:
        learner.logger.close()
        learner.logger = RunLogger(run_dir, report_to=run.report_to)
        progress = Progress(cfg.rounds, 0, run.progress, os.path.basename(run_dir))
        if eval_env is not None:
            policy.eval()
            learner.logger.log(0, {f"eval/{k}": v for k, v in evaluate(policy, eval_env, samples, greedy=True).items()})
        spin(learner, env, eval_env=eval_env, eval_samples=samples,
             callback=lambda rec: progress.update({**rec, "step": rec["round"] + 1}))
        progress.close()
        learner.logger.close()
        save_model(policy, run_dir)
        return summary(learner.logger.history)

    return job


BUILDERS: dict[str, Callable[[RunConfig, Any], Job]] = {
    "dpo": build_dpo, "spin": build_spin, "sft": build_sft, "rm": build_rm, "prm": build_prm}
"""The run builders of the bundled offline algorithms (registered in their own modules, built here)."""

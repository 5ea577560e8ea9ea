"""The training loop of :class:`~tokengym.agents.algorithms.dpo.DPOLearner`: ``fit`` (epochs of shuffled minibatches,
log, evaluate), its exact resume position, and the run folder ``tokengym train dpo`` and ``fit(run_dir=...)`` write.

A fit's position (steps, the current epoch's permutation and batch, the log window, precomputed reference log-probs)
is a plain dict the learner's ``state_dict`` saves; a ``fit`` after ``load_state_dict`` on the same pairs (checked by
a digest of them) runs only the remaining steps.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from tokengym.agents.data.pairs import PairData
from tokengym.agents.engine.rollout import evaluate

__all__ = ["DPOFit"]


def _fingerprint(data: PairData) -> str:
    """A digest of the tokenized pairs: a resumed ``fit`` checks it is given the pairs it was interrupted on."""
    h = hashlib.blake2b(digest_size=16)
    extra = () if data.completion_agent is None else (data.agent_mask,)  # multi-turn pairs: which tokens are scored
    for t in (data.prompts, data.prompt_mask, data.completions, data.completion_lens, *extra):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


class DPOFit:
    """Mixin of :class:`~tokengym.agents.algorithms.dpo.DPOLearner`: :meth:`fit` and its run folder.

    Uses the learner's ``policy``, ``config``, ``ref``, ``logger``, ``optim``, ``dp``, ``global_step``, ``epoch``,
    ``_shuffle``, ``_fit`` / ``_resume_fit`` (the position saved and restored), and its :meth:`prepare`, ``_batch``,
    ``_ref_batch``, :meth:`reference_logps`, ``_loss`` and ``_evaluate_all``.
    """

    def _start_fit(self, data: PairData, eval_data: PairData | None) -> dict[str, Any]:
        """The position of a new fit over ``data``, or of the interrupted one that ``load_state_dict`` restored."""
        cfg = self.config
        resume, self._resume_fit = self._resume_fit, None
        per_epoch = math.ceil(len(data) / cfg.batch_size)
        total = self.fit_steps(data)
        digest = _fingerprint(data)
        if resume is not None and resume["pairs"] == digest:
            if resume["total"] != total:
                raise ValueError(f"the restored fit ran {resume['total']} steps but this config gives {total}: "
                                 "resume with the config it was saved with")
            return resume
        if resume is not None and resume["step"] < resume["total"]:
            raise ValueError(f"fit() was interrupted after {resume['step']} of {resume['total']} steps on other pairs "
                             f"({resume['n']} pairs, got {len(data)}): pass the same pairs to resume it")
        precompute = self.ref is None or cfg.precompute_ref
        return {
            "pairs": digest, "n": len(data), "step": 0, "total": total, "pos": per_epoch, "order": None,
            "window": {}, "count": 0,
            "ref_cache": self.reference_logps(data) if precompute else None,
            "eval_ref": self.reference_logps(eval_data, cfg.eval_batch_size) if precompute and eval_data is not None else None,
        }

    def fit_steps(self, data: PairData) -> int:
        """Optimiser steps of one fit over ``data``: ``config.steps``, else ``epochs`` passes of ``batch_size`` pairs."""
        cfg = self.config
        return cfg.steps if cfg.steps is not None else cfg.epochs * math.ceil(len(data) / cfg.batch_size)

    def fit(
        self,
        pairs: Any,
        eval_pairs: Any = None,
        eval_env: Any = None,
        eval_samples: list | None = None,
        callback: Callable[[dict[str, float]], Any] | None = None,
        *,
        run_dir: str | None = None,
        resume: bool = False,
        save_every: int = 10,
    ) -> list[dict[str, float]]:
        """Train on ``pairs``; return the records logged during this call.

        After :meth:`load_state_dict` of a state saved during a ``fit`` on the same pairs, this call runs
        only that fit's remaining steps (the same batches, learning rates and records as one
        uninterrupted call; pass the same ``eval_*`` arguments too).

        Args:
            pairs: a :class:`PairData`, or text pairs / a JSONL path / a ``datasets.Dataset``
                (see :func:`tokengym.agents.data.pairs.load_pairs`).
            eval_pairs: held-out pairs; their preference accuracy, margins and loss are logged under
                ``eval/`` every ``eval_every`` steps and after the last step.
            eval_env, eval_samples: a ``group_size=1`` env and prompts (e.g.
                :func:`~tokengym.agents.engine.rollout.heldout_samples`) for greedy accuracy, logged with the evals.
            callback: called with every training record, after the evaluation due at that step;
                returning ``False`` stops right there (a checkpoint saved in it resumes exactly).
            run_dir: write the folder ``tokengym train dpo`` writes (``config.json`` recording ``eval_env``'s env,
                ``metrics.jsonl`` with held-out metrics at step 0 too, checkpoints every ``save_every`` steps,
                ``model/``), so that ``tokengym eval/plot/sample --run`` work on it. A folder that is not empty is
                refused unless ``resume=True``, which continues it from its newest checkpoint as ``--resume`` does
                (on the same pairs and config; a missing or empty folder starts the run).
        """
        if run_dir is not None:
            from tokengym.agents.runtime.run_config import RunConfig
            from tokengym.agents.runtime.session import jsonable, python_run, run_in_folder

            data = self.prepare(pairs)
            settings = RunConfig(save_every=save_every, progress=False)  # no progress bar from Python
            config = {"algorithm": "dpo", "preset": None, "config": jsonable(asdict(self.config)),
                      "run": python_run(eval_env, self.policy, eval_samples, settings, rollout=False)}
            return run_in_folder(run_dir, resume, config, self, None, self.fit_steps(data), settings=settings,
                                 body=lambda trainer: self.fit_in_folder(trainer, data, eval_pairs, eval_env, eval_samples, callback))
        cfg = self.config
        data = self.prepare(pairs)
        eval_data = self.prepare(eval_pairs) if eval_pairs is not None else None
        evaluates = eval_data is not None or (eval_env is not None and bool(eval_samples))
        self.share_prefix  # resolve the packing check before any reference context is entered
        self._fit = run = self._start_fit(data, eval_data)
        n, bs, total = len(data), cfg.batch_size, run["total"]
        per_epoch = math.ceil(n / bs)
        history_start = len(self.logger.history)
        if total == 0 and evaluates:
            self.logger.log(self.global_step, self._evaluate_all(eval_data, run["eval_ref"], eval_env, eval_samples))
        self.policy.train()
        t_window, tok_window, pairs_window = 0.0, 0, 0
        while run["step"] < total:
            if run["pos"] >= per_epoch:  # new epoch
                run["order"] = torch.randperm(n, generator=self._shuffle) if cfg.shuffle else torch.arange(n)
                run["pos"] = 0
                self.epoch += 1
            t0 = time.perf_counter()
            idx, share = self.dp.shard(run["order"][run["pos"] * bs:(run["pos"] + 1) * bs])  # share = 1 in one process
            batch = self._batch(data, idx)
            self.optim.set_lr(run["step"], total)
            ref_seq = self._ref_batch(batch, run["ref_cache"])
            loss, stats = self._loss(batch, ref_seq)
            self.optim.zero_grad()
            (loss * share).backward()
            norm = self.optim.step()["grad_norm"]  # summed over ranks, clipped, stepped
            if data.truncated is not None:  # the fraction of the step's pairs a length limit cut
                stats["truncated"] = data.truncated[idx].float().mean()
            stats = self.dp.weighted(stats, share)  # global means of the batch's statistics
            run["pos"] += 1
            run["step"] += 1
            self.global_step += 1
            stats["grad_norm"] = norm
            window = run["window"]
            for k, v in stats.items():
                window[k] = window.get(k, 0.0) + float(v)
            run["count"] += 1
            t_window += time.perf_counter() - t0
            tok_window += batch.num_tokens
            pairs_window += batch.num_pairs
            record = None
            if run["count"] == cfg.log_every or run["step"] == total:
                count = run["count"]
                metrics = {(k if "/" in k else f"train/{k}"): v / count for k, v in window.items()}
                metrics.update({"train/lr": self.optim.lr, "epoch": self.epoch - 1 + run["pos"] / per_epoch,
                                "perf/tokens_per_s": tok_window / max(t_window, 1e-9),
                                "perf/pairs_per_s": pairs_window / max(t_window, 1e-9)})
                run["window"], run["count"] = {}, 0
                t_window, tok_window, pairs_window = 0.0, 0, 0
                record = self.logger.log(self.global_step, metrics)
            if evaluates and (run["step"] == total or (cfg.eval_every and self.global_step % cfg.eval_every == 0)):
                self.logger.log(self.global_step, self._evaluate_all(eval_data, run["eval_ref"], eval_env, eval_samples))
                self.policy.train()
            if record is not None and callback is not None and callback(record) is False:
                break
        self.policy.eval()
        return self.logger.history[history_start:]

    def fit_in_folder(self, trainer: Any, pairs: Any, eval_pairs: Any = None, eval_env: Any = None,
                      eval_samples: list | None = None, callback: Callable[[dict[str, float]], Any] | None = None) -> None:
        """The fit in its run folder (``tokengym train dpo`` and ``fit(run_dir=...)``): held-out greedy metrics at
        step 0 of a new run, :meth:`fit` with the trainer's checkpoints, then the final checkpoint and ``model/``."""
        from tokengym.agents.algorithms.onpolicy import both
        from tokengym.agents.runtime.session import initial_eval

        initial_eval(trainer, self, eval_env, eval_samples, evaluate)
        self.fit(pairs, eval_pairs, eval_env, eval_samples, callback=both(trainer.callback, callback))
        trainer.finish()


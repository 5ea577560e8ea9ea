"""The run half of :class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`: ``learn`` (the schedule of outer
iterations and steps, evaluation, logging, a run folder) and the checkpoint state that resumes it exactly.

:class:`RunMixin` is mixed into ``OnPolicyAgent``: ``checkpoint_modules``, ``extra_state`` and ``load_extra_state``
are hooks that subclasses override (PPO's critic and KL controller).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import torch

from tokengym.agents.engine.policy import make_reference
from tokengym.agents.engine.rollout import evaluate, evaluate_at_k
from tokengym.envs.rollout_env import check_rollout_env

__all__ = ["RunMixin", "both", "EVAL_SAMPLING_SEED"]

EVAL_SAMPLING_SEED = 10_007
"""Added to the run's seed to seed the held-out sampled evaluation (``eval_k``): a stream apart from training's."""


def both(first: Callable, then: Callable | None) -> Callable:
    """A step callback calling ``first`` then ``then`` (if any); ``False`` from either stops the run."""
    return first if then is None else (lambda record: first(record) is not False and then(record) is not False)


class RunMixin:
    """Training runs and checkpoint state of an ``OnPolicyAgent`` (which supplies ``config``, ``policy``, ``ref``,
    ``optim``, ``logger``, ``global_step``, ``_shuffle``, ``_engines``, ``_source``, ``_async_state``,
    ``_resume_step``, ``step``, ``check_env``, ``make_source``, ``rollout_backend`` and ``train_mode``)."""

    @property
    def total_steps(self) -> int:
        return self.config.iterations * self.config.steps

    # ------------------------------------------------------------------ checkpoint state
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """Modules whose weights a checkpoint holds: the policy, and a frozen reference copy when there is one."""
        mods = {"policy": self.policy.model}
        if isinstance(getattr(self.ref, "model", None), torch.nn.Module):  # a LoRA reference has no weights of its own
            mods["ref"] = self.ref.model
        return mods

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Everything but module weights needed to continue exactly (``torch.load(weights_only=True)``-safe); in
        async modes also the rollout workers' state (:meth:`RolloutWorkers.state_dict`)."""
        state = {"global_step": self.global_step, **self.optim.state_dict(), **self.extra_state(),
                 "shuffle_rng": self._shuffle.get_state(), "policy_rng": self.policy.generator.get_state()}
        if self.config.async_mode != "off":
            state["async"] = self._source.state_dict() if self._source is not None else self._async_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next :meth:`learn` call runs the rest of the interrupted schedule."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"{type(self).__name__} state is missing {missing}; pass what {type(self).__name__}.state_dict() returned")
        self.global_step = int(state["global_step"])
        self.optim.load_state_dict(state)
        self.load_extra_state(state)
        self._shuffle.set_state(state["shuffle_rng"])
        self.policy.generator.set_state(state["policy_rng"])
        self._async_state = state.get("async")
        self._resume_step = self.global_step
        self._engines.stale = True  # an engine started before holds other weights: reload them before it samples

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)

    # ------------------------------------------------------------------ runs
    def learn(self, env, eval_env=None, eval_samples: list | None = None,
              callback: Callable[[dict[str, float]], Any] | None = None, *, run_dir: str | None = None,
              resume: bool = False, save_every: int = 10) -> list[dict[str, float]]:
        """Train on ``env``; return the records logged.

        ``callback(record)`` is called once per step; returning ``False`` stops after that step. The first call
        after :meth:`load_state_dict` runs only the rest of the interrupted schedule. With ``eval_env``
        (group_size 1) and ``eval_samples`` (e.g. :func:`heldout_samples`), greedy held-out accuracy (with ``eval_k``
        also pass@k, maj@k and mean@k) is logged every ``eval_every`` steps and after the last step (and before the
        first, with ``run_dir``).

        ``run_dir``: write the folder ``tokengym train`` writes (``config.json``, ``metrics.jsonl``, checkpoints every
        ``save_every`` steps, ``model/``), so that ``tokengym eval/plot/sample --run`` work on it. A folder that is
        not empty is refused unless ``resume=True``, which continues it from its newest checkpoint as ``--resume``
        does (and starts it when it does not exist yet).
        """
        check_rollout_env(env, f"{type(self).__name__}.learn()")
        if run_dir is not None:
            from tokengym.agents.algorithms.registry import name_of
            from tokengym.agents.runtime.run_config import RunConfig
            from tokengym.agents.runtime.session import jsonable, python_run, run_in_folder

            settings = RunConfig(save_every=save_every, progress=False)  # no progress bar from Python
            config = {"algorithm": name_of(type(self)), "preset": None, "config": jsonable(asdict(self.config)),
                      "run": python_run(env, self.policy, eval_samples, settings)}
            return run_in_folder(run_dir, resume, config, self, env, self.total_steps, settings=settings,
                                 body=lambda trainer: self.train_in_folder(trainer, env, eval_env, eval_samples, callback))
        cfg = self.config
        cfg.__post_init__()  # settings changed after the config was built are checked as when it was built
        self.check_env(env)
        if self.global_step == 0:
            self.policy.seed(cfg.seed)
        self._source = self.make_source(env)
        interrupted = False
        try:
            history = self._learn(env, eval_env, eval_samples, callback)
            if cfg.async_mode != "off":  # a later learn() call continues the workers' streams
                self._async_state = self._source.state_dict()
            return history
        except KeyboardInterrupt:  # Ctrl-C: close without waiting for a weight sync in flight
            interrupted = True
            raise
        finally:
            source, self._source = self._source, None
            source.close(True) if interrupted else source.close()  # (a source of one's own may take no argument)

    def _learn(self, env, eval_env, eval_samples, callback) -> list[dict[str, float]]:
        cfg = self.config
        start = len(self.logger.history)
        done, self._resume_step = self._resume_step or 0, None  # steps of this schedule already taken (resume)
        evaluating = eval_env is not None and bool(eval_samples)
        for it in range(cfg.iterations):
            if done >= (it + 1) * cfg.steps:
                continue
            if self.ref is not None and cfg.reset_ref and done <= it * cfg.steps:
                self.ref = make_reference(self.policy)
            for _ in range(cfg.steps - max(0, done - it * cfg.steps)):
                metrics = self.step(env, it)
                if evaluating and cfg.eval_every and self.global_step % cfg.eval_every == 0:
                    metrics.update(self.evaluate(eval_env, eval_samples))
                record = self.logger.log(self.global_step, metrics)
                if callback is not None and callback(record) is False:
                    return self.logger.history[start:]
        if evaluating and not (cfg.eval_every and self.global_step % cfg.eval_every == 0):
            self.logger.log(self.global_step, self.evaluate(eval_env, eval_samples))
        return self.logger.history[start:]

    def train_in_folder(self, trainer, env, eval_env=None, eval_samples: list | None = None,
                        callback: Callable[[dict[str, float]], Any] | None = None) -> None:
        """The run in its folder (``tokengym train`` and ``learn(run_dir=...)``): held-out metrics at step 0 of a new
        run, :meth:`learn` with the trainer's checkpoints, then the final checkpoint and ``model/``."""
        from tokengym.agents.runtime.session import initial_eval

        initial_eval(trainer, self, eval_env, eval_samples, lambda policy, env, samples, greedy: self.heldout_metrics(env, samples))
        self.learn(env, eval_env, eval_samples, callback=both(trainer.callback, callback))
        trainer.finish()

    def evaluate(self, eval_env, samples: list) -> dict[str, float]:
        """Held-out metrics of ``samples`` under ``eval/``: :meth:`heldout_metrics`."""
        return {f"eval/{k}": v for k, v in self.heldout_metrics(eval_env, samples).items()}

    def heldout_metrics(self, eval_env, samples: list) -> dict[str, float]:
        """Greedy metrics of ``samples`` (``accuracy``, ...) and, with ``eval_k``, ``pass@k``, ``maj@k`` and
        ``mean@k`` of :meth:`evaluate_at_k`."""
        self.train_mode(False)
        out = evaluate(self.rollout_backend(eval_env), eval_env, samples, greedy=True)
        if self.config.eval_k:
            out.update((name, v) for name, v in self.evaluate_at_k(eval_env, samples).items() if "@" in name)
        return out

    def evaluate_at_k(self, eval_env, samples: list) -> dict[str, Any]:
        """:func:`~tokengym.agents.engine.rollout.evaluate_at_k` of ``samples`` with ``eval_k`` and its n, sampled
        at the policy's temperature from the seed ``seed + EVAL_SAMPLING_SEED`` as rows 0.. of a one-process batch;
        the policy's generator and row offset are restored afterwards, so that training samples what it would have
        without this evaluation. Same weights, same results: a call after the run recomputes its last evaluation."""
        cfg, policy = self.config, self.policy
        if not cfg.eval_k:
            raise ValueError(f"{type(self).__name__}.evaluate_at_k() needs eval_k >= 1 in its config (0 = off)")
        state, offset = policy.generator.get_state(), policy.row_offset
        self.train_mode(False)
        try:
            policy.seed(cfg.seed + EVAL_SAMPLING_SEED)
            policy.row_offset = 0
            return evaluate_at_k(self.rollout_backend(eval_env), eval_env, samples, n=cfg.eval_samples_per_prompt,
                                 k=cfg.eval_k)
        finally:
            policy.generator.set_state(state)
            policy.row_offset = offset

"""The on-policy update skeleton that GRPO, RLOO, REINFORCE++ and PPO share.

One sampling step: rollout (less the groups of episodes its reward flagged :data:`~tokengym.rewards.protocols.DROP`)
-> optional recomputed pi_old and reference log-probs -> the data-parallel
gather -> the algorithm's :meth:`~OnPolicyAgent.prepare` (advantages, returns) -> ``mu`` epochs over
shuffled minibatches: forward, the algorithm's :meth:`~OnPolicyAgent.loss` terms, backward, gradient
sync, clipping, optimiser steps -> metrics, evaluation, logging. Checkpoint state (exact resume), the
learning-rate schedule and the reference reset of outer iterations live here too.

An algorithm is a config dataclass extending :class:`~tokengym.agents.algorithms.onpolicy_config.OnPolicyConfig`,
``prepare`` and ``loss``; ``agents/algorithms/rloo.py`` is a complete one.

:class:`OnPolicyAgent` holds the hooks and :meth:`~OnPolicyAgent.step`; its parts live beside it:
``onpolicy_update`` (the frozen batch and the minibatch update), ``onpolicy_rollout`` (rollouts, the inference
engine, the rollout source) and ``onpolicy_run`` (``learn`` and the checkpoint state).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tokengym.agents import variants as V
from tokengym.agents.runtime.config import check_learner_args
from tokengym.agents.runtime.distributed import LOCAL
from tokengym.agents.runtime.logger import RunLogger
from tokengym.agents.engine.models import enable_checkpointing
from tokengym.agents.runtime.optim import OptimizerStep, adamw
from tokengym.agents.algorithms.onpolicy_config import OnPolicyConfig
from tokengym.agents.algorithms.onpolicy_rollout import EngineSlot, RolloutMixin
from tokengym.agents.algorithms.onpolicy_run import RunMixin, both
from tokengym.agents.algorithms.onpolicy_update import Minibatch, NonFiniteLoss, UpdateMixin
from tokengym.agents.engine.policy import make_reference
from tokengym.agents.engine.rollout import Rollout
from tokengym.agents.engine.rollout_data import drop_flagged, reward_counters
from tokengym.agents.engine.sources import RolloutSource
from tokengym.envs.masks import mask_metrics
from tokengym.rewards.packing import set_packing

__all__ = ["NonFiniteLoss", "OnPolicyAgent", "OnPolicyConfig", "Minibatch", "both"]


class OnPolicyAgent(RunMixin, RolloutMixin, UpdateMixin):
    """Rollout, update, log and resume; subclasses supply ``prepare`` and ``loss`` (see the module docstring).

    Class attributes a subclass sets: ``config_cls`` (its :class:`OnPolicyConfig` subclass) and, when it keeps
    more than the policy's optimiser, ``optimizer_names`` (checkpoint keys, in step order) and ``grad_norm_names``
    (their logged norms); ``optim`` (:class:`~tokengym.agents.runtime.optim.OptimizerStep`) steps them all. The
    config's :class:`OnPolicyConfig` fields are read here.
    """

    config_cls: type[OnPolicyConfig]
    update_passes: int = 1
    """Model passes of an update per row (PPO's policy and critic: 2), for the memory check of a run."""
    optimizer_names: tuple[str, ...] = ("optimizer",)
    grad_norm_names: tuple[str, ...] = ("grad_norm",)
    log_iteration: bool = True
    """Log the outer iteration on every record, also with ``iterations = 1`` (False: only with more than one)."""
    needs_logits: bool = False
    """The loss reads the policy's logits ``[B, m, V]`` (:attr:`Minibatch.logits`), not only the sampled tokens'
    log-probs (every row then takes part in the backward: no inert rows are skipped)."""

    def __init__(self, policy, config=None, run_dir: str | None = None):
        check_learner_args(type(self).__name__, policy, config, self.config_cls)
        self.policy = policy
        self.config = cfg = config if config is not None else self.config_cls()
        set_packing(cfg.packing, policy)  # the update's forwards, and the reference's (make_reference copies it)
        self.logger = RunLogger(run_dir)
        self.optim = OptimizerStep(self.make_optimizers(), cfg.lr, schedule=cfg.lr_scheduler_type, warmup=cfg.warmup_steps,
                                   max_grad_norm=cfg.max_grad_norm, sync=lambda params: self.dp.sync_gradients(params),
                                   names=self.optimizer_names, norm_names=self.grad_norm_names)
        if cfg.gradient_checkpointing:
            enable_checkpointing(*self.checkpointed_modules())
        self.ref = make_reference(policy) if self.uses_reference() else None  # no KL: no reference at all
        self.global_step = 0
        self._resume_step: int | None = None  # set by load_state_dict: learn() continues its schedule from here
        self._shuffle = torch.Generator().manual_seed(cfg.seed)
        self.dp = LOCAL  # data parallel: set by distributed.prepare under torchrun
        self._engines = EngineSlot()  # an engine backend's inference engine (rollout_backend)
        self._source: RolloutSource | None = None  # where rollouts come from, while learn() runs (make_source)
        self._async_state: dict[str, Any] | None = None  # async: the workers' checkpointed state, until learn() starts them
        self._async_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ what an algorithm supplies
    @staticmethod
    def needs_process_reward(config) -> bool:
        """Whether ``config`` asks for per-step (PRM) rewards, so a run's env must compute them."""
        return False

    def uses_reference(self) -> bool:
        """Whether a frozen reference policy is needed (a KL term)."""
        return False

    def make_optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimiser per name in ``optimizer_names``; the first one's learning rate follows the schedule."""
        cfg = self.config
        return [adamw(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimisers of :attr:`optim` (the one step: sync, clip, step), in ``optimizer_names`` order."""
        return self.optim.optimizers

    def checkpointed_modules(self) -> tuple[torch.nn.Module, ...]:
        """Modules that recompute activations in backward under ``gradient_checkpointing``."""
        return (self.policy.model,)

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(batch, stats)``: the frozen per-row/per-token tensors the loss needs (``adv``, ...) and their statistics."""
        raise NotImplementedError

    def loss(self, mb: Minibatch, batch: dict[str, torch.Tensor]) -> tuple[list[tuple[torch.Tensor, str]], dict[str, Any]]:
        """``(terms, stats)``: loss terms as ``(value, aggregation)`` pairs, added in order (the aggregation
        weights each term's share under data parallelism), and the minibatch's statistics."""
        raise NotImplementedError

    def inert_rows(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor | None:
        """Bool ``[B]``: rows that add exactly nothing to the loss or its gradient (skipped in backward); None = none."""
        return None

    def forward_extra(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int, m: int) -> dict[str, torch.Tensor]:
        """Further forward passes of a minibatch (PPO's critic)."""
        return {}

    def rollout_metrics(self, ro: Rollout, batch: dict[str, torch.Tensor], seconds: float) -> dict[str, Any]:
        """Metrics of the step's rollout."""
        return {}

    def after_update(self, ro: Rollout, stats: dict[str, Any]) -> None:
        """Called once per step after the update (PPO's adaptive KL)."""

    # ------------------------------------------------------------------ the step's parts
    def _autocast(self, device: torch.device | str):
        """bf16 autocast on ``device`` when ``config.bf16`` (a no-op context otherwise)."""
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=self.config.bf16)

    def train_mode(self, on: bool) -> None:
        self.policy.train(on)

    # ------------------------------------------------------------------ loop
    def step(self, env, iteration: int = 0) -> dict[str, Any]:
        """One sampling step: rollout, advantages, ``mu`` epochs of minibatch updates; returns its metrics."""
        cfg = self.config
        t_start = time.perf_counter()
        ro, timing = self._rollout(env)
        counters = reward_counters(ro)  # e.g. judge/errors, over every episode sampled
        ro, dropped = drop_flagged(ro)  # episodes the reward could not score, with their groups
        if dropped:
            counters["reward/dropped_rows"] = float(dropped)
        # unmasked training of a masked rollout scores pi_old as the trainer sees it, over the whole vocabulary
        recompute = not cfg.reuse_rollout_logprobs or (ro.token_masks is not None and cfg.mask_training == "unmasked")
        # one epoch of one minibatch: the update's own forward runs at pi_old's weights, so it gives pi_old (no pass)
        from_update = recompute and cfg.mu == 1 and cfg.minibatches == 1
        old_logp = self._logprobs(self.policy, ro) if recompute and not from_update else None
        ref_logp = self._logprobs(self.ref, ro) if self.ref is not None else None
        ro, old_logp, ref_logp = self.dp.gather(ro, old_logp, ref_logp)  # data parallel: the global batch
        old_logp = ro.logprobs if old_logp is None else old_logp
        batch, stats = self.frozen_batch(ro, old_logp, ref_logp, correct=not from_update)
        if recompute and not from_update:  # the backend's log-probs against the trainer's pi_old, over the whole batch
            stats.update({f"mismatch/{k}": v for k, v in V.logprob_mismatch(ro.logprobs, old_logp, ro.action_mask).items()})
        t_up = time.perf_counter()
        lr = self.optim.set_lr(self.global_step, self.total_steps)  # from global_step: a resumed run continues it
        metrics = self._update(ro, batch, self.loss_kinds(), measure_mismatch=not recompute or from_update,
                               old_from_forward=from_update)
        metrics["train/lr"] = lr
        timing["time/update"] = time.perf_counter() - t_up
        self.after_update(ro, stats)
        self.global_step += 1
        if self._source is not None:  # the new version to the workers, while the learner goes on (settled
            self._source.publish(self.global_step, wait=False)  # before its next optimiser step)
            metrics.update(self._async_metrics)
        metrics.update(stats, **timing)
        metrics.update(self.rollout_metrics(ro, batch, time.perf_counter() - t_start), **counters)
        if ro.token_masks is not None:
            metrics.update(mask_metrics(ro.token_masks, ro.action_mask))
        if self.log_iteration or cfg.iterations > 1:
            metrics["iteration"] = iteration
        return metrics

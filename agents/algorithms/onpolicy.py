"""The on-policy update skeleton that GRPO, RLOO, REINFORCE++ and PPO share.

One sampling step: rollout -> optional recomputed pi_old and reference log-probs -> the data-parallel
gather -> the algorithm's :meth:`~OnPolicyAgent.prepare` (advantages, returns) -> ``mu`` epochs over
shuffled minibatches: forward, the algorithm's :meth:`~OnPolicyAgent.loss` terms, backward, gradient
sync, clipping, optimiser steps -> metrics, evaluation, logging. Checkpoint state (exact resume), the
learning-rate schedule and the reference reset of outer iterations live here too.

An algorithm is a config dataclass extending :class:`~tokengym.agents.algorithms.onpolicy_config.OnPolicyConfig`,
``prepare`` and ``loss``; ``agents/algorithms/rloo.py`` is a complete one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from tokengym.agents import variants as V
from tokengym.agents.runtime.config import check_learner_args
from tokengym.agents.runtime.distributed import LOCAL, aggregation_weights
from tokengym.agents.runtime.logger import RunLogger
from tokengym.agents.engine.models import enable_checkpointing
from tokengym.agents.runtime.optim import OptimizerStep, adamw
from tokengym.agents.algorithms.onpolicy_config import OnPolicyConfig
from tokengym.agents.engine.generation import make_sampler
from tokengym.agents.engine.policy import make_reference
from tokengym.agents.engine.resources import check_fits
from tokengym.envs.masks import mask_metrics
from tokengym.agents.engine.rollout import Rollout, collect, evaluate, trimmed_logprobs, used_slice
from tokengym.agents.engine.sources import RolloutSource, check_source, make_source
from tokengym.envs.rollout_env import check_rollout_env

__all__ = ["NonFiniteLoss", "OnPolicyAgent", "OnPolicyConfig", "Minibatch", "both"]


TOKEN_MEAN_STATS = frozenset({"entropy", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean"})
"""Loss statistics that are means over a minibatch's agent tokens whatever the loss's aggregation
(:func:`~tokengym.agents.functional.policy_loss`'s, the entropy): data parallel combines them by token shares."""


class NonFiniteLoss(RuntimeError):
    """An update's loss was NaN or infinite: training stops before the weights change (the message says the step)."""


def both(first: Callable, then: Callable | None) -> Callable:
    """A step callback calling ``first`` then ``then`` (if any); ``False`` from either stops the run."""
    return first if then is None else (lambda record: first(record) is not False and then(record) is not False)


@dataclass
class Minibatch:
    """What :meth:`OnPolicyAgent.loss` sees: one minibatch, trimmed to its used columns."""

    rows: torch.Tensor
    """Indices of the minibatch's rows in the rollout."""
    m: int
    """Generated columns kept (columns that are padding in every row are dropped)."""
    action_mask: torch.Tensor
    """``[B, m]`` 1 on the agent's tokens."""
    logp: torch.Tensor
    """``[B, m]`` log-probs of the sampled tokens under the current policy (with autograd)."""
    entropy: torch.Tensor
    """``[B, m]`` the policy's entropy at each position."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Outputs of :meth:`OnPolicyAgent.forward_extra` (PPO's values)."""
    logits: torch.Tensor | None = None
    """``[B, m, V]`` the policy's logits at the sampling temperature (with autograd), when the agent's
    :attr:`~OnPolicyAgent.needs_logits` asks for them (distillation's full-distribution estimators)."""

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The minibatch's part of a rollout-wide ``[N, M]`` or ``[N]`` tensor."""
        return x[self.rows, : self.m] if x.dim() == 2 else x[self.rows]


class OnPolicyAgent:
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
    needs_logits: bool = False
    """The loss reads the policy's logits ``[B, m, V]`` (:attr:`Minibatch.logits`), not only the sampled tokens'
    log-probs (every row then takes part in the backward: no inert rows are skipped)."""
    """Log the outer iteration on every record, also with ``iterations = 1`` (False: only with more than one)."""

    def __init__(self, policy, config=None, run_dir: str | None = None):
        check_learner_args(type(self).__name__, policy, config, self.config_cls)
        self.policy = policy
        self.config = cfg = config if config is not None else self.config_cls()
        policy.packing = cfg.packing  # the update's forwards, and the reference's (make_reference copies it)
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
        self._engine = None  # sampler='vllm': the inference engine that samples rollouts (rollout_sampler)
        self._engine_sync_seconds = 0.0  # time spent loading weights into it (cumulative)
        self._engine_stale = False  # its weights may not be the policy's although their version matches (a restore)
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

    def reduce_stats(self, stats: dict[str, Any], shares: dict[str, float], mb: Minibatch, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """A minibatch's statistics over every rank: the means over its agent tokens (:data:`TOKEN_MEAN_STATS`)
        weighted by each rank's share of those tokens, the rest by the first loss term's share."""
        if not self.dp.distributed:
            return stats
        first = next(iter(shares.values()), 1.0)
        by_token = {k: v for k, v in stats.items() if k in TOKEN_MEAN_STATS}
        out = self.dp.weighted({k: v for k, v in stats.items() if k not in by_token}, first)
        if by_token:  # (every rank has the same keys)
            out.update(self.dp.weighted(by_token, shares.get("token-mean", first)))
        return {k: out[k] for k in stats}

    def collect(self, env) -> Rollout:
        """One rollout batch of the current policy (during :meth:`learn`: its source's rollout for this step; in async
        modes sampled by a worker with an older policy version)."""
        if self._source is not None:
            ro, self._async_metrics = self._source.take(self.global_step)
            return ro
        return collect(env, self.rollout_sampler(env), seed=self.config.seed if self.global_step == 0 else None)

    def rollout_sampler(self, env):
        """What samples this agent's rollouts and evaluations: the policy itself (``sampler='tokengym'``) or an
        inference engine (``sampler='vllm'``), started on first use with the policy's weights as version
        ``global_step`` and sized for ``env``'s rows. Before it samples after an update, the new weights are loaded
        into it by name as version ``global_step`` (``time/weight_sync``), and it checks that it holds them."""
        cfg = self.config
        if cfg.sampler == "tokengym":
            return self.policy
        if self._engine is None:
            self._engine = make_sampler(cfg.sampler, self.policy, rows=env.num_envs, row_len=env.seq_len, bf16=cfg.bf16,
                                        version=self.global_step)
        if self._engine_stale or self._engine.version != self.global_step:
            t0 = time.perf_counter()
            self._engine.load_weights(None, self.global_step)
            self._engine_sync_seconds += time.perf_counter() - t0
            self._engine_stale = False
        return self._engine

    def check_env(self, env) -> None:
        """Raise ``ValueError`` if ``env`` cannot feed this agent (an inference engine that cannot start: its one-line
        ``ValueError`` or ``ImportError``)."""
        check_fits(self.policy, env)
        if self.config.minibatches > env.num_envs:
            raise ValueError(f"minibatches={self.config.minibatches} is more than the {env.num_envs} episodes of a rollout "
                             "batch: every minibatch needs at least one; use fewer minibatches or more prompts")
        check_source(self.config, env, self.policy, self.dp)
        if self.config.sampler != "tokengym":
            if self.dp.distributed:
                raise ValueError(f"sampler={self.config.sampler!r} runs one engine in one learner process; data-parallel "
                                 "learners (torchrun) sample with sampler='tokengym'")
            self.rollout_sampler(env)

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
        self._engine_stale = True  # an engine started before holds other weights: reload them before it samples

    # ------------------------------------------------------------------ the step's parts
    def _autocast(self, device: torch.device | str):
        """bf16 autocast on ``device`` when ``config.bf16`` (a no-op context otherwise)."""
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=self.config.bf16)

    def train_mode(self, on: bool) -> None:
        self.policy.train(on)

    def _rollout(self, env) -> tuple[Rollout, dict[str, float]]:
        t0, r0, s0 = time.perf_counter(), env.reward_seconds, self._engine_sync_seconds
        self.train_mode(False)
        with self._autocast(env.device):
            ro = self.collect(env)
        reward_t, sync_t = env.reward_seconds - r0, self._engine_sync_seconds - s0
        timing = {"time/rollout": time.perf_counter() - t0 - reward_t - sync_t, "time/reward": reward_t}
        if self._engine is not None and self.config.async_mode == "off":
            timing["time/weight_sync"] = sync_t
        return ro, timing

    @torch.no_grad()
    def _logprobs(self, fn, ro: Rollout) -> torch.Tensor:
        with self._autocast(ro.tokens.device):
            return trimmed_logprobs(fn, ro, masked=self.config.mask_training == "masked")

    def _allowed(self, ro: Rollout, rows: torch.Tensor, m: int) -> dict[str, Any]:
        """``{"allowed": masks}`` of ``rows``' first ``m`` columns when the rollout was sampled under masks and training
        is masked (``{}`` otherwise): the keyword the policy's forward takes."""
        if ro.token_masks is None or self.config.mask_training != "masked":
            return {}
        return {"allowed": ro.token_masks.select(rows).columns(m)}

    @property
    def total_steps(self) -> int:
        return self.config.iterations * self.config.steps

    def _forward(self, ro: Rollout, rows: torch.Tensor, n_live: int) -> Minibatch:
        """Log-probs and entropies of ``rows``; only the first ``n_live`` are recorded for backward."""
        tokens, mask, p, m = used_slice(ro, rows)  # columns that are padding in every row are skipped
        logits = None
        with self._autocast(ro.tokens.device):
            if self.needs_logits:
                logp, ent, logits = self.policy(tokens, mask, p, return_entropy=True, return_logits=True,
                                                **self._allowed(ro, rows, m))
            elif n_live == len(rows):
                logp, ent = self.policy(tokens, mask, p, return_entropy=True, **self._allowed(ro, rows, m))
            else:
                with torch.no_grad():
                    logp, ent = self.policy(tokens[n_live:], mask[n_live:], p, return_entropy=True,
                                            **self._allowed(ro, rows[n_live:], m))
                if n_live:
                    live = self.policy(tokens[:n_live], mask[:n_live], p, return_entropy=True,
                                       **self._allowed(ro, rows[:n_live], m))
                    logp, ent = torch.cat([live[0], logp]), torch.cat([live[1], ent])
            extra = self.forward_extra(tokens, mask, p, m)
        return Minibatch(rows, m, ro.action_mask[rows, :m], logp, ent, extra, logits)

    def _update(self, ro: Rollout, batch: dict[str, torch.Tensor], kinds: list[str], measure_mismatch: bool,
                old_from_forward: bool = False) -> dict[str, float]:
        """``mu`` epochs of minibatch steps. ``measure_mismatch``: log the rollout's log-probs against the trainer's
        from the first minibatch's forward, which runs at pi_old's weights. ``old_from_forward`` (one epoch of one
        minibatch): that forward's log-probs are pi_old, and the correction's weights are computed from them."""
        cfg, dp = self.config, self.dp
        self.train_mode(True)
        # Data parallel: each loss term is weighted by this rank's share of its aggregation's denominator (1 alone).
        # (and the token-mean share, which token statistics are combined by: reduce_stats)
        weights = {kind: aggregation_weights(ro.action_mask, kind) for kind in dict.fromkeys([*kinds, "token-mean"])}
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.mu):
            order = torch.randperm(ro.num_episodes, generator=self._shuffle).to(ro.tokens.device)
            for rows in order.chunk(cfg.minibatches):
                shares = {}
                for kind, w in weights.items():
                    shard, shares[kind] = dp.shard(rows, w)
                rows = shard
                # sharded modules all-gather in every forward: each rank runs the same passes, inert rows included
                inert = self.inert_rows(batch, rows) if dp.sharding == "none" and not self.needs_logits else None
                n_live = len(rows) if inert is None else int((~inert).sum())
                if inert is not None:  # the order of rows does not change the loss
                    rows = torch.cat([rows[~inert], rows[inert]])
                mb = self._forward(ro, rows, n_live)
                if count == 0 and measure_mismatch:
                    mismatch = V.logprob_mismatch(mb.take(ro.logprobs), mb.logp.detach(), mb.action_mask)
                if old_from_forward:
                    batch["old_logp"] = batch["old_logp"].clone()
                    batch["old_logp"][mb.rows, : mb.m] = mb.logp.detach()
                    self._add_correction(batch, ro)
                terms, stats = self.loss(mb, batch)
                loss = terms[0][0] * shares[terms[0][1]]
                for term, kind in terms[1:]:
                    loss = loss + term * shares[kind]
                if not bool(torch.isfinite(loss.detach())):  # before any gradient reaches the weights
                    raise NonFiniteLoss(f"step {self.global_step + 1}: the loss is {float(loss):g}, so the update was not "
                                        "applied; the weights and the checkpoints are as they were (look for non-finite "
                                        "rewards, or lower the learning rate, and resume)")
                self.optim.zero_grad()
                if n_live:
                    loss.backward()
                else:  # every row is inert: the gradient is exactly 0, and AdamW still takes its (momentum) step
                    for p in self.optim.params:
                        p.grad = torch.zeros_like(p)
                if self._source is not None:  # the weight sync of the last version reads them until here
                    self._source.settle()
                report = self.optim.step()  # one flat all-reduce of every optimiser's gradients, clip each, step each
                stats.update((name, report[name]) for name in self.grad_norm_names)
                total = terms[0][0].detach()
                for term, _ in terms[1:]:
                    total = total + term.detach()
                stats["loss"] = total
                for k, v in self.reduce_stats(stats, shares, mb, batch).items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        out = {f"train/{k}": v / count for k, v in sums.items()}
        if measure_mismatch:
            out.update({f"mismatch/{k}": float(v) for k, v in mismatch.items()})
        return out

    # ------------------------------------------------------------------ loop
    def step(self, env, iteration: int = 0) -> dict[str, Any]:
        """One sampling step: rollout, advantages, ``mu`` epochs of minibatch updates; returns its metrics."""
        cfg = self.config
        t_start = time.perf_counter()
        ro, timing = self._rollout(env)
        # unmasked training of a masked rollout scores pi_old as the trainer sees it, over the whole vocabulary
        recompute = not cfg.reuse_rollout_logprobs or (ro.token_masks is not None and cfg.mask_training == "unmasked")
        # one epoch of one minibatch: the update's own forward runs at pi_old's weights, so it gives pi_old (no pass)
        from_update = recompute and cfg.mu == 1 and cfg.minibatches == 1
        old_logp = self._logprobs(self.policy, ro) if recompute and not from_update else None
        ref_logp = self._logprobs(self.ref, ro) if self.ref is not None else None
        ro, old_logp, ref_logp = self.dp.gather(ro, old_logp, ref_logp)  # data parallel: the global batch
        old_logp = ro.logprobs if old_logp is None else old_logp
        batch, stats = self.frozen_batch(ro, old_logp, ref_logp, correct=not from_update)
        if recompute and not from_update:  # the sampler's log-probs against the trainer's pi_old, over the whole batch
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
        metrics.update(self.rollout_metrics(ro, batch, time.perf_counter() - t_start))
        if ro.token_masks is not None:
            metrics.update(mask_metrics(ro.token_masks, ro.action_mask))
        if self.log_iteration or cfg.iterations > 1:
            metrics["iteration"] = iteration
        return metrics

    def frozen_batch(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, correct: bool = True):
        """:meth:`prepare`'s ``(batch, stats)`` with ``old_logp`` and (``correct``) the rollout correction's
        ``weights``: pi_old (the trainer's recomputed log-probs, the ratio's anchor) over the behaviour policy (the
        sampler's, in async modes a worker's older version), truncated or masked at ``correction_cap``."""
        batch, stats = self.prepare(ro, old_logp, ref_logp)
        batch.setdefault("old_logp", old_logp)
        if correct:
            self._add_correction(batch, ro)
        return batch, stats

    def _add_correction(self, batch: dict[str, torch.Tensor], ro: Rollout) -> None:
        cfg = self.config
        if (mode := cfg.correction_mode) != "none":
            batch["weights"] = V.importance_weights(batch["old_logp"], ro.logprobs, ro.action_mask, mode,
                                                    cfg.correction_level, cfg.correction_cap)

    def loss_kinds(self) -> list[str]:
        """The aggregations of the loss terms (data-parallel weights are computed for each)."""
        return [self.config.aggregation]

    def learn(self, env, eval_env=None, eval_samples: list | None = None,
              callback: Callable[[dict[str, float]], Any] | None = None, *, run_dir: str | None = None,
              resume: bool = False, save_every: int = 10) -> list[dict[str, float]]:
        """Train on ``env``; return the records logged.

        ``callback(record)`` is called once per step; returning ``False`` stops after that step. The first call
        after :meth:`load_state_dict` runs only the rest of the interrupted schedule. With ``eval_env``
        (group_size 1) and ``eval_samples`` (e.g. :func:`heldout_samples`), greedy held-out accuracy is logged
        every ``eval_every`` steps and after the last step (and before the first, with ``run_dir``).

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
        try:
            history = self._learn(env, eval_env, eval_samples, callback)
            if cfg.async_mode != "off":  # a later learn() call continues the workers' streams
                self._async_state = self._source.state_dict()
            return history
        finally:
            source, self._source = self._source, None
            source.close()

    def make_source(self, env) -> RolloutSource:
        """Where this run's rollouts come from (:func:`~tokengym.agents.engine.sources.make_source`), continuing the
        checkpointed async state after a resume."""
        return make_source(self.config, env, self.policy, dp=self.dp, version=self.global_step, total=self.total_steps,
                           state=self._async_state, sampler=self.rollout_sampler)

    def close(self) -> None:
        """Shut down the agent's inference engine (``sampler='vllm'``; a later rollout starts a new one). One engine
        runs in a process at a time, so close an agent's before starting another."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the rollout workers (async modes, while :meth:`learn` runs; else empty)."""
        return self._source.pids() if self._source is not None and hasattr(self._source, "pids") else []

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

        initial_eval(trainer, self, eval_env, eval_samples,
                     lambda policy, env, samples, greedy: evaluate(self.rollout_sampler(env), env, samples, greedy=greedy))
        self.learn(env, eval_env, eval_samples, callback=both(trainer.callback, callback))
        trainer.finish()

    def evaluate(self, eval_env, samples: list) -> dict[str, float]:
        """Greedy held-out metrics of ``samples`` (``eval/accuracy``, ...)."""
        self.train_mode(False)
        return {f"eval/{k}": v for k, v in evaluate(self.rollout_sampler(eval_env), eval_env, samples, greedy=True).items()}

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)

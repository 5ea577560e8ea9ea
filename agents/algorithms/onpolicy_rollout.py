"""The rollout half of :class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`: where a step's rollout comes
from (its rollout backend: the policy or an inference engine; or during :meth:`learn` its rollout source, async
workers included).

:class:`EngineSlot` is owned by the agent: the engine of an engine backend (``sampler='vllm'``), started on
first use, its weight loads and its shutdown. :class:`RolloutMixin` is mixed into ``OnPolicyAgent``, since
``collect``, ``check_env`` and ``make_source`` are hooks that subclasses extend (``super().collect(env)``) and tests replace on an instance.
"""

from __future__ import annotations

import time

from tokengym.agents.engine.backends import backend, check_one_process, make_backend
from tokengym.agents.engine.resources import check_fits
from tokengym.agents.engine.rollout import Rollout, collect
from tokengym.agents.engine.sources import RolloutSource, check_source, make_source

__all__ = ["EngineSlot", "RolloutMixin"]


class EngineSlot:
    """An agent's inference engine (an engine backend such as ``sampler='vllm'``; none until first used) and the time
    spent loading weights into it."""

    def __init__(self) -> None:
        self.engine = None
        self.sync_seconds = 0.0
        """Time spent loading weights into it (cumulative)."""
        self.stale = False
        """Its weights may not be the policy's although their version matches (after a restore)."""

    def backend(self, cfg, policy, env, version: int):
        """The engine, started for ``env``'s rows if none runs, holding ``policy``'s weights as ``version``."""
        if self.engine is None:
            self.engine = make_backend(cfg.sampler, policy, rows=env.num_envs, row_len=env.seq_len, bf16=cfg.bf16,
                                       version=version)
        if self.stale or self.engine.version != version:
            t0 = time.perf_counter()
            self.engine.load_weights(None, version)
            self.sync_seconds += time.perf_counter() - t0
            self.stale = False
        return self.engine

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


class RolloutMixin:
    """Rollouts of an ``OnPolicyAgent`` (which supplies ``config``, ``policy``, ``dp``, ``global_step``,
    ``total_steps``, ``_engines``, ``_source``, ``_async_state``, ``_async_metrics``, ``_autocast``, ``train_mode``)."""

    @property
    def _engine(self):
        """The running inference engine (an engine backend's, such as ``sampler='vllm'``), or None."""
        return self._engines.engine

    def collect(self, env) -> Rollout:
        """One rollout batch of the current policy (during :meth:`learn`: its source's rollout for this step; in async
        modes sampled by a worker with an older policy version)."""
        if self._source is not None:
            ro, self._async_metrics = self._source.take(self.global_step)
            return ro
        return collect(env, self.rollout_backend(env), seed=self.config.seed if self.global_step == 0 else None)

    def rollout_backend(self, env):
        """What samples this agent's rollouts and evaluations, the backend the ``sampler`` setting names: the policy
        itself (``sampler='tokengym'``) or an inference engine (an engine backend such as ``sampler='vllm'``), started
        on first use with the policy's weights as version ``global_step`` and sized for ``env``'s rows. Before it
        samples after an update, the new weights are loaded into it by name as version ``global_step``
        (``time/weight_sync``), and it checks that it holds them."""
        if not backend(self.config.sampler).engine:
            return make_backend(self.config.sampler, self.policy, rows=env.num_envs, row_len=env.seq_len,
                                bf16=self.config.bf16, version=self.global_step)
        return self._engines.backend(self.config, self.policy, env, self.global_step)

    rollout_sampler = rollout_backend
    """The old name of :meth:`rollout_backend`."""

    def check_env(self, env) -> None:
        """Raise ``ValueError`` if ``env`` cannot feed this agent (an inference engine that cannot start: its one-line
        ``ValueError`` or ``ImportError``)."""
        check_fits(self.policy, env)
        if self.config.minibatches > env.num_envs:
            raise ValueError(f"minibatches={self.config.minibatches} is more than the {env.num_envs} episodes of a rollout "
                             "batch: every minibatch needs at least one; use fewer minibatches or more prompts")
        check_source(self.config, env, self.policy, self.dp)
        check_one_process(self.config.sampler, self.dp.distributed)
        if backend(self.config.sampler).engine:
            self.rollout_backend(env)

    def make_source(self, env) -> RolloutSource:
        """Where this run's rollouts come from (:func:`~tokengym.agents.engine.sources.make_source`), continuing the
        checkpointed async state after a resume."""
        return make_source(self.config, env, self.policy, dp=self.dp, version=self.global_step, total=self.total_steps,
                           state=self._async_state, backend=self.rollout_backend)

    def close(self) -> None:
        """Shut down the agent's inference engine (an engine backend's; a later rollout starts a new one). One engine
        runs in a process at a time, so close an agent's before starting another."""
        self._engines.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the rollout workers (async modes, while :meth:`learn` runs; else empty)."""
        return self._source.pids() if self._source is not None and hasattr(self._source, "pids") else []

    def _rollout(self, env) -> tuple[Rollout, dict[str, float]]:
        t0, r0, s0 = time.perf_counter(), env.reward_seconds, self._engines.sync_seconds
        self.train_mode(False)
        with self._autocast(env.device):
            ro = self.collect(env)
        reward_t, sync_t = env.reward_seconds - r0, self._engines.sync_seconds - s0
        timing = {"time/rollout": time.perf_counter() - t0 - reward_t - sync_t, "time/reward": reward_t}
        if self._engines.engine is not None and self.config.async_mode == "off":
            timing["time/weight_sync"] = sync_t
        return ro, timing

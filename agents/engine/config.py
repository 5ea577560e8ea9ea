"""The rollout engine's settings: where rollouts are sampled (the sampler, in process or in async workers, local or
remote) and how the learner's weights reach the workers. :func:`~tokengym.agents.engine.sources.make_source` and
:func:`~tokengym.agents.engine.sources.check_source` read these fields and no others.

:class:`~tokengym.agents.algorithms.onpolicy_config.OnPolicyConfig` extends :class:`EngineConfig` (flat fields, so
each is a ``--flag`` and a config key of its own); the fields' checks are here, with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from tokengym.agents.engine.backends import SAMPLERS
from tokengym.agents.runtime.config import resumable
from tokengym.agents.runtime.weight_sync import WeightSync
from tokengym.rewards.training import SeedConfig

ASYNC_MODES = ("off", "one-step", "bounded")
"""Rollouts in worker processes while the learner updates (:attr:`EngineConfig.async_mode`)."""

__all__ = ["ASYNC_MODES", "EngineConfig"]


@dataclass
class EngineConfig(SeedConfig):
    """Settings of the rollout engine (and its ``seed``: the rollouts' prompts and samples; worker i's: seed + i).

    The fields a resumed run may change (timeouts, worker threads, the remote workers and the weight store) are
    declared :func:`~tokengym.agents.runtime.config.resumable`."""

    sampler: str = "tokengym"
    """Rollout backend (any registered one: tokengym.agents.engine.backends): tokengym (the policy's own fast decoder, in process) or vllm (an in-process vLLM engine,
    pip install 'tokengym[vllm]': the policy's weights are loaded into it by name after every update, its log-probs
    are the behaviour log-probs, and correction=auto is tis)."""
    bf16: bool = False
    """bf16 autocast in the rollout (the fast decoder multiplies bf16 weights) and the update's forward/backward (ratios are 1 only up to bf16 rounding)."""
    async_mode: str = "off"
    """Rollouts in worker processes while the learner updates: off, one-step (each rollout sampled by the policy one
    update older: a fixed schedule, deterministic and exactly resumable) or bounded (the newest weights a worker
    holds, at most max_staleness updates old); see tokengym.agents.engine.workers."""
    max_staleness: int = 1
    """Async: the most policy updates a rollout may lag the update it trains (one-step: 1; bounded: 0 = synchronous
    training through the workers, bit for bit)."""
    rollout_workers: int = 1
    """Async: rollout worker processes (worker i samples rollouts i, i + n, ...; its prompts and samples use seed + i);
    the command line's --rollout-workers also takes host:port,... of `tokengym worker` servers (remote_workers)."""
    worker_threads: int = resumable(1)
    """Async: torch CPU threads of each rollout worker."""
    sync_timeout: float = resumable(300.0)
    """Async: seconds a weight sync may wait for a worker before the run stops with an error naming it (1 s to 7 days)."""
    rollout_timeout: float = resumable(1800.0)
    """Async: seconds the learner waits for the rollout it needs before the run stops with an error naming the worker
    (a task's sample() or reward(), or a tool, that never returns; 1 s to 7 days)."""
    remote_workers: str = resumable("")
    """Async: host:port,... of `tokengym worker` servers that sample the rollouts, one worker each, instead of local
    worker processes (the CLI's --rollout-workers takes a count or these addresses; the secret: worker_secret_file
    or $TOKENGYM_SECRET)."""
    min_workers: int = resumable(0)
    """Async, remote workers: the run goes on while at least this many remain when one is lost, and a lost one that
    answers again rejoins (0: every worker; a lost one stops the run in one line)."""
    worker_secret_file: str = resumable("")
    """Async, remote workers: a file whose first line is the workers' shared secret (empty: $TOKENGYM_SECRET)."""
    worker_ca: str = resumable("")
    """Async, remote workers: talk HTTPS to the workers (`tokengym worker --tls-cert`), each certificate verified
    against this PEM file (a CA, or the worker's self-signed certificate; its host name or IP must be in it)."""
    worker_fingerprint: str = resumable("")
    """Async, remote workers: talk HTTPS to the workers, each certificate pinned by this SHA-256 fingerprint (64 hex
    digits, colons allowed; `tokengym worker` prints it), for a self-signed certificate without a CA."""
    sync_host: str = resumable("")
    """Async, remote workers: the address the workers reach this learner's weight store at (empty: this machine's
    address on the route to the first worker)."""
    sync_port: int = resumable(0)
    """Async, remote workers: the weight store's TCP port (0: a free port)."""
    sync_dir: str = resumable("")
    """Async, remote workers: a folder the learner and every worker can read (a shared filesystem); each version goes
    there as safetensors pieces of at most ``sync_bucket_mb`` and a manifest, instead of over a weight group, for
    networks where no group can be formed."""
    sync_bucket_mb: float = resumable(16.0)
    """Async: MiB per weight-sync bucket; the learner's extra memory for syncs is one bucket (kept between them) and,
    during one, one gathered tensor."""

    @property
    def worker_addresses(self) -> list[str]:
        """The remote workers' addresses (empty: local workers)."""
        return [a.strip() for a in self.remote_workers.split(",") if a.strip()]

    @property
    def worker_count(self) -> int:
        """How many rollout workers: the remote addresses, else ``rollout_workers``."""
        return len(self.worker_addresses) or self.rollout_workers

    def __post_init__(self) -> None:
        self.check_fields()  # every field's, a subclass's too (FieldChecks)
        if self.remote_workers:
            from tokengym.agents.engine.remote import parse_address

            seen: dict[tuple[str, int], str] = {}
            for a in self.worker_addresses or [self.remote_workers]:
                try:
                    where = parse_address(a)
                except ValueError as e:
                    raise ValueError(f"{type(self).__name__}: remote_workers: {e}; give host:port,host:port,...") from None
                if where in seen:  # one worker would serve two slots: two sessions, each replacing the other
                    raise ValueError(f"{type(self).__name__}: remote_workers names {seen[where]} twice; a worker serves "
                                     "one learner slot: name each once (start more `tokengym worker`s for more)")
                seen[where] = a
        if self.worker_fingerprint:
            from tokengym.agents.engine.tls import parse_fingerprint

            try:
                parse_fingerprint(self.worker_fingerprint)
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}: {e}") from None
        if self.async_mode == "one-step" and self.max_staleness != 1:
            raise ValueError(f"{type(self).__name__}: async_mode='one-step' samples each rollout exactly one update "
                             f"behind (max_staleness=1), not max_staleness={self.max_staleness}; use async_mode='bounded'")

    def checks(self) -> dict[str, bool]:
        return {"max_staleness": self.max_staleness >= 0, "rollout_workers": self.rollout_workers >= 1,
                "worker_threads": self.worker_threads >= 1,
                "sync_timeout": 1 <= self.sync_timeout <= WeightSync.WORKER_TIMEOUT,  # what a TCPStore and gloo can take
                "rollout_timeout": 1 <= self.rollout_timeout <= WeightSync.WORKER_TIMEOUT,
                "min_workers": 0 <= self.min_workers <= max(1, len(self.worker_addresses)),
                "sync_port": 0 <= self.sync_port <= 65535, "sync_bucket_mb": self.sync_bucket_mb > 0}

    def choices(self) -> dict[str, Iterable[Any]]:
        return {"async_mode": ASYNC_MODES, "sampler": SAMPLERS}  # a live view: a backend registered later is a choice

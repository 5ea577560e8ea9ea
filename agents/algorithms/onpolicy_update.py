"""The update half of :class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`: a step's frozen batch and its
``mu`` epochs of shuffled minibatches (forward, the algorithm's loss terms, NaN check, backward, optimiser step).

:class:`UpdateMixin` is mixed into ``OnPolicyAgent`` rather than owned by it: it calls the agent's hooks
(``prepare``, ``loss``, ``inert_rows``, ``forward_extra``, ``reduce_stats``, ...) through ``self``, so that a
subclass's overrides, and hooks replaced on an instance, are the ones it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokengym.agents import variants as V
from tokengym.agents.runtime.distributed import aggregation_weights
from tokengym.agents.engine.rollout import Rollout, trimmed_logprobs, used_slice
from tokengym.rewards.packing import packed_share

__all__ = ["Minibatch", "NonFiniteLoss", "TOKEN_MEAN_STATS", "UpdateMixin"]


TOKEN_MEAN_STATS = frozenset({"entropy", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean"})
"""Loss statistics that are means over a minibatch's agent tokens whatever the loss's aggregation
(:func:`~tokengym.agents.functional.policy_loss`'s, the entropy): data parallel combines them by token shares."""


class NonFiniteLoss(RuntimeError):
    """An update's loss was NaN or infinite: training stops before the weights change (the message says the step)."""


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


class UpdateMixin:
    """The frozen batch and the minibatch update of an ``OnPolicyAgent`` (which supplies ``config``, ``policy``,
    ``optim``, ``dp``, ``_shuffle``, ``_source``, ``global_step``, ``_autocast``, ``train_mode`` and the hooks)."""

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
        packed_share(self.policy.model)  # count this update's forwards only
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
        share = packed_share(self.policy.model)
        if cfg.packing == "auto" and share is not None:  # did auto pack this step's forwards (the fraction that ran so)
            out["train/packed"] = share
        if measure_mismatch:
            out.update({f"mismatch/{k}": float(v) for k, v in mismatch.items()})
        return out

"""GRPO (DeepSeekMath): group-relative advantages, outcome or process supervision, no critic.

Reads top to bottom: config -> agent (reference model, optimiser) -> ``learn``: for each outer
iteration (optionally resetting the reference to the current policy), for each sampling step:
rollout G completions per prompt from a ``group_size=G`` vector env -> advantages -> mu epochs of
minibatch updates of the clipped surrogate + beta * KL(pi || ref) (k3) -> log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.algorithms.advantages import ADVANTAGES, advantage_estimator, token_advantages
from tokengym.agents.algorithms.critic_free import LOSSES, CriticFreeConfig
from tokengym.agents.algorithms.losses import LossInputs, policy_loss
from tokengym.agents.algorithms.onpolicy import Minibatch, OnPolicyAgent
from tokengym.agents.algorithms.registry import register
from tokengym.agents.engine.rollout import Rollout, concat_rollouts, turn_metrics

__all__ = ["GRPOConfig", "GRPOAgent", "grpo_advantages", "CriticFreeConfig", "LOSSES"]


@dataclass
class GRPOConfig(CriticFreeConfig):
    """Hyper-parameters of :class:`GRPOAgent` (defaults: a quick, stable run on the tiny preset)."""

    advantage: str = "outcome"
    """Advantage estimator (any registered one: tokengym.agents.algorithms.advantages): outcome (group-normalised
    final reward on every token), process (PRM step rewards) or rloo (leave-one-out baseline)."""
    scale_rewards: str = "group"
    """Advantage scaling for outcome supervision: group, batch or none."""

    def choices(self) -> dict[str, Iterable[Any]]:
        return {**super().choices(), "advantage": ADVANTAGES, "scale_rewards": F.GROUP_SCALES}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not advantage_estimator(self.advantage).per_episode and (self.overlong_buffer > 0
                                                                    or policy_loss(self.loss).sequence_level):
            bad = "overlong_buffer" if self.overlong_buffer > 0 else f"loss={self.loss!r}"
            raise ValueError(f"GRPOConfig: {bad} needs one outcome per episode; it does not combine with "
                             f"advantage={self.advantage!r}")


def grpo_advantages(ro: Rollout, advantage: str, scale_rewards: str) -> torch.Tensor:
    """Per-token advantages ``[N, M]`` of a rollout (0 off the action mask) by estimator ``advantage`` of the
    unshaped returns."""
    return token_advantages(advantage, ro, ro.returns, GRPOConfig(advantage=advantage, scale_rewards=scale_rewards))


class GRPOAgent(OnPolicyAgent):
    """Group Relative Policy Optimisation on a ``group_size=G`` :class:`~tokengym.envs.TokenVectorEnv`.

    Args:
        policy: the :class:`~tokengym.agents.Policy` to train (sampling settings are the policy's).
        config: :class:`GRPOConfig`.
        run_dir: where to write TensorBoard events and ``metrics.jsonl`` (None = memory only).

    Example:
        >>> import gymnasium as gym, tokengym.envs
        >>> from tokengym.agents import Policy, GRPOAgent, GRPOConfig
        >>> env = gym.make_vec("tokengym/Target-v0", num_envs=16, vectorization_mode="vector_entry_point",
        ...                    group_size=8, partial_credit=True)
        >>> agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=2))
        >>> history = agent.learn(env)
        >>> len(history)
        2
    """

    config_cls = GRPOConfig

    @staticmethod
    def needs_process_reward(config) -> bool:
        return advantage_estimator(config.advantage).needs_process_reward

    def uses_reference(self) -> bool:
        return self.config.beta > 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    def shaped_returns(self, ro: Rollout) -> torch.Tensor:
        """Each episode's return ``[N]``, with DAPO's soft overlong penalty when ``overlong_buffer`` is set."""
        cfg = self.config
        if cfg.overlong_buffer <= 0:
            return ro.returns
        budget = ro.attention_mask.shape[1] - ro.prompt_len
        buffer = max(1, round(cfg.overlong_buffer * budget))
        return ro.returns + V.overlong_penalty(ro.episode_lengths, budget, buffer, cfg.overlong_penalty).to(ro.returns.dtype)

    def advantages(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token advantages ``[N, M]`` of a rollout (0 off the action mask): the configured estimator's, of the
        shaped returns."""
        return token_advantages(self.config.advantage, ro, self.shaped_returns(ro), self.config, ref_logp)

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None):
        cfg = self.config
        batch = {"adv": self.advantages(ro, ref_logp), "mask": ro.action_mask}
        if cfg.mask_truncated:  # DAPO's overlong filtering: cut episodes take no part in the loss
            keep = (~ro.truncated.bool())[:, None].to(ro.action_mask.dtype)
            batch["mask"], batch["adv"] = ro.action_mask * keep, batch["adv"] * keep
        if ref_logp is not None:
            batch["ref_logp"] = ref_logp
        return batch, dict(self._sampling_stats)

    def inert_rows(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor | None:
        """With ``skip_zero_advantage``, no KL term in the loss, no entropy bonus and a loss whose gradient is
        proportional to the advantage (clip, gspo: its registered metadata), a row whose advantage is 0 on every token
        (a group whose rewards are all equal) adds exactly nothing to the loss or its gradient."""
        cfg = self.config
        if not (cfg.skip_zero_advantage and "ref_logp" not in batch and cfg.entropy_coef == 0
                and policy_loss(cfg.loss).proportional_to_advantage):
            return None
        return ~(batch["adv"][rows] != 0).any(1)

    def policy_terms(self, mb: Minibatch, batch: dict[str, torch.Tensor], am: torch.Tensor):
        """The policy loss the config names (looked up in :mod:`~tokengym.agents.algorithms.losses`) and its
        statistics."""
        loss = policy_loss(self.config.loss)
        weights = mb.take(batch["weights"]) if loss.takes_weights and "weights" in batch else None
        return loss.fn(LossInputs(mb.logp, mb.take(batch["old_logp"]), mb.take(batch["adv"]), am, self.config, weights,
                                  self._shuffle))

    def loss(self, mb: Minibatch, batch: dict[str, torch.Tensor]):
        cfg, agg = self.config, self.config.aggregation
        am = mb.take(batch["mask"])
        pg, stats = self.policy_terms(mb, batch, am)
        stats = dict(stats, pg_loss=pg.detach(), entropy=F.masked_aggregate(mb.entropy.detach(), am, "token-mean"))
        terms = [(pg, agg)]
        if "ref_logp" in batch:
            kl = F.masked_aggregate(F.kl_penalty(mb.logp, mb.take(batch["ref_logp"]), cfg.kl_estimator), am, agg)
            terms.append((cfg.beta * kl, agg))
            stats["kl"] = kl.detach()
        if cfg.entropy_coef > 0:
            terms.append((-(cfg.entropy_coef * F.masked_aggregate(mb.entropy, am, agg)), agg))
        return terms, stats

    # ------------------------------------------------------------------ dynamic sampling
    _sampling_stats: dict[str, float] = {}

    def collect(self, env) -> Rollout:
        """One rollout; with ``dynamic_sampling``, only groups whose rewards differ, refilled by further rollouts
        (at most ``max_extra_rollouts``) until the batch has as many groups as one rollout."""
        ro = super().collect(env)
        if not self.config.dynamic_sampling:
            return ro
        g, want = ro.group_size, ro.num_episodes // ro.group_size
        parts, sampled, kept, extra = [], 0, 0, 0
        while True:
            signal = V.group_has_signal(self.shaped_returns(ro), g)
            rows = torch.arange(ro.num_episodes, device=ro.tokens.device).view(-1, g)[signal.to(ro.tokens.device)]
            take = rows[: want - kept].reshape(-1)
            if len(take):
                parts.append(ro.select(take))
            sampled, kept = sampled + len(signal), kept + len(take) // g
            if kept >= want or extra >= self.config.max_extra_rollouts:
                break
            ro, extra = super().collect(env), extra + 1
        self._sampling_stats = {"dynamic/kept_groups_frac": int(kept) / sampled if sampled else 0.0,
                                "dynamic/extra_rollouts": extra, "dynamic/batch_groups": kept}
        return concat_rollouts(parts) if parts else ro  # no group had a signal: an update of zero advantages

    def check_env(self, env) -> None:
        """Raise ``ValueError`` if ``env`` cannot feed this agent (no groups; process advantages without a PRM)."""
        if self.config.dynamic_sampling and env.group_size < 2:
            raise ValueError(f"dynamic_sampling drops groups whose rewards are all equal: it needs group_size >= 2 (got {env.group_size})")
        why = self.why_groups()
        if why and env.group_size < 2:
            raise ValueError(f"{why}: create the env with group_size >= 2 (got {env.group_size})")
        if self.needs_process_reward(self.config) and env.process_reward_fn is None:
            raise ValueError(f"advantage={self.config.advantage!r} needs an env with a process reward (process_reward=True "
                             "or a PRM)")
        super().check_env(env)

    def why_groups(self) -> str | None:
        """Why this agent's advantages need ``group_size >= 2`` (None: they do not)."""
        return "GRPO needs groups"

    def rollout_metrics(self, ro: Rollout, batch: dict[str, torch.Tensor], seconds: float) -> dict[str, Any]:
        g = ro.returns.view(-1, ro.group_size)
        lengths = ro.lengths.float()
        return {
            "reward/mean": ro.outcome.mean(),
            "reward/std": ro.outcome.std() if ro.num_episodes > 1 else 0.0,
            "reward/accuracy": (ro.outcome >= 1.0 - 1e-6).float().mean(),
            "reward/frac_zero_std_groups": (g.std(1) == 0).float().mean() if ro.group_size > 1 else 1.0,
            "completion/length_mean": lengths.mean(),
            "completion/length_max": lengths.max(),
            "completion/truncated_frac": ro.truncated.float().mean(),
            "perf/tokens_per_s": lengths.sum() / max(seconds, 1e-9),
            **turn_metrics(ro),
        }


PRESETS: dict[str, dict[str, Any]] = {
    "dr-grpo": {"scale_rewards": "none", "aggregation": "seq-mean-token-sum"},
    "dapo": {"clip_eps": 0.2, "clip_eps_high": 0.28, "aggregation": "token-mean", "beta": 0.0, "dynamic_sampling": True,
             "overlong_buffer": 0.2},
    "gspo": {"loss": "gspo", "clip_eps": 3e-4, "clip_eps_high": 4e-4},
    "kl-cov": {"loss": "kl-cov", "aggregation": "token-mean"},
    "clip-cov": {"loss": "clip-cov", "aggregation": "token-mean"},
}
"""``tokengym train grpo --preset NAME``: Dr. GRPO (Liu et al. 2025: no std scaling, no length normalisation: the
sum over a sequence's tokens, averaged over sequences, which is theirs up to the constant budget it divides by),
DAPO (Yu et al. 2025: clip-higher, token-mean, dynamic sampling, soft overlong punishment over the last 20% of the
budget), GSPO (Zheng et al. 2025) and KL-Cov / Clip-Cov (Cui et al. 2025)."""

register("grpo", GRPOConfig, "GRPO: group-relative advantages, outcome or process supervision", agent=GRPOAgent,
         min_group=2, data_parallel=True, presets=PRESETS)

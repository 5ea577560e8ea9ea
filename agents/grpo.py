"""GRPO (DeepSeekMath): group-relative advantages, outcome or process supervision, no critic.

Reads top to bottom: config -> agent (reference model, optimiser) -> ``learn``: for each outer
iteration (optionally resetting the reference to the current policy), for each sampling step:
rollout G completions per prompt from a ``group_size=G`` vector env -> advantages -> mu epochs of
minibatch updates of the clipped surrogate + beta * KL(pi || ref) (k3) -> log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokengym.agents import functional as F
from tokengym.agents.config import check_config
from tokengym.agents.onpolicy import Minibatch, OnPolicyAgent
from tokengym.agents.optim import LR_SCHEDULES
from tokengym.agents.registry import register
from tokengym.agents.rollout import Rollout, turn_metrics

__all__ = ["GRPOConfig", "GRPOAgent", "grpo_advantages", "LR_SCHEDULES"]

@dataclass
class GRPOConfig:
    """Hyper-parameters of :class:`GRPOAgent` (defaults: a quick, stable run on the tiny preset)."""

    lr: float = 1e-4
    """AdamW learning rate (peak value of lr_schedule)."""
    lr_schedule: str = "constant"
    """Learning-rate schedule over all iterations * steps sampling steps: constant, linear or cosine (both decay to 0)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    iterations: int = 1
    """Outer iterations; the reference model is reset to the policy at the start of each when reset_ref is on."""
    steps: int = 50
    """Sampling steps per outer iteration (one rollout batch each)."""
    mu: int = 1
    """Optimisation epochs over each rollout batch."""
    minibatches: int = 1
    """Minibatches per epoch (whole groups are not required to stay together)."""
    clip_eps: float = 0.2
    """Lower clip range of the ratio (and upper, unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper clip range ("clip-higher"); None = clip_eps."""
    beta: float = 0.0
    """KL(pi || ref) coefficient in the loss (k3 estimator); 0 skips the reference model entirely."""
    kl_estimator: str = "k3"
    """KL estimator for the loss term: k1, k2 or k3."""
    reset_ref: bool = False
    """Reset the reference model to the current policy at the start of every outer iteration."""
    advantage: str = "outcome"
    """outcome (group-normalised final reward on every token) or process (PRM step rewards)."""
    scale_rewards: str = "group"
    """Advantage scaling for outcome supervision: group, batch or none."""
    aggregation: str = "seq-mean-token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean (the paper's) or seq-mean-token-sum."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    skip_zero_advantage: bool = True
    """With beta = 0 and entropy_coef = 0, run rows whose advantage is 0 on every token (groups with equal
    rewards) through the update's forward without autograd and leave them out of the backward: exact, as
    they add nothing to the loss or its gradient; the logged statistics still cover every row."""
    recompute_old_logprobs: bool = False
    """Recompute pi_old log-probs with a forward pass instead of reusing the rollout's (needed only when sampling used top-k/top-p)."""
    bf16: bool = False
    """bf16 autocast in the rollout (the fast decoder multiplies bf16 weights) and the update's forward/backward; faster on CPU for the small preset, ratios are 1 only up to bf16 rounding."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: far less update memory for
    about a third more update compute (TRL's GRPOTrainer does this by default)."""
    eval_every: int = 10
    """Evaluate on held-out prompts every this many sampling steps when learn() gets eval samples (0 = only at the end)."""
    seed: int = 0
    """Seeds the env's prompt stream, the policy's sampler and minibatch shuffling."""

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0, "iterations": self.iterations >= 1, "steps": self.steps >= 0, "mu": self.mu >= 1,
            "minibatches": self.minibatches >= 1, "clip_eps": self.clip_eps > 0, "beta": self.beta >= 0,
            "entropy_coef": self.entropy_coef >= 0, "max_grad_norm": self.max_grad_norm >= 0,
            "clip_eps_high": self.clip_eps_high is None or self.clip_eps_high > 0,
            "eval_every": self.eval_every >= 0,
        }
        check_config(self, checks, {"advantage": ("outcome", "process"), "scale_rewards": F.GROUP_SCALES,
                                    "aggregation": F.AGGREGATIONS, "kl_estimator": F.KL_ESTIMATORS,
                                    "lr_schedule": LR_SCHEDULES})
        z = torch.zeros(1, 1)
        try:  # the loss's own argument checks (clip ranges) now, not after the first rollout
            F.policy_loss(z, z, z, z, self.clip_eps, self.clip_eps_high, self.aggregation)
        except ValueError as e:
            raise ValueError(f"GRPOConfig: {e}") from None

    @property
    def reuse_rollout_logprobs(self) -> bool:
        """pi_old log-probs come from the rollout (no extra forward) unless recompute is asked for."""
        return not self.recompute_old_logprobs


def grpo_advantages(ro: Rollout, advantage: str, scale_rewards: str) -> torch.Tensor:
    """Per-token advantages ``[N, M]`` of a rollout (0 off the action mask)."""
    m = ro.action_mask.shape[1]
    if advantage == "outcome":
        adv = F.group_advantages(ro.returns, ro.group_size, scale=scale_rewards)[:, None].expand(-1, m)
    else:
        step_rewards, step_ends = ro.step_rewards()
        adv = F.process_advantages(step_rewards, step_ends, ro.group_size, m)
    return adv * ro.action_mask


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
        return config.advantage == "process"

    def uses_reference(self) -> bool:
        return self.config.beta > 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    def advantages(self, ro: Rollout) -> torch.Tensor:
        """Per-token advantages ``[N, M]`` of a rollout (0 off the action mask)."""
        return grpo_advantages(ro, self.config.advantage, self.config.scale_rewards)

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None):
        batch = {"adv": self.advantages(ro)}
        if ref_logp is not None:
            batch["ref_logp"] = ref_logp
        return batch, {}

    def inert_rows(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor | None:
        """With ``skip_zero_advantage``, ``beta = 0`` and no entropy bonus, a row whose advantage is 0 on every
        token (a group whose rewards are all equal) adds exactly nothing to the loss or its gradient."""
        cfg = self.config
        if not (cfg.skip_zero_advantage and cfg.beta == 0 and cfg.entropy_coef == 0):
            return None
        return ~(batch["adv"][rows] != 0).any(1)

    def loss(self, mb: Minibatch, batch: dict[str, torch.Tensor]):
        cfg, am, agg = self.config, mb.action_mask, self.config.aggregation
        pg, stats = F.policy_loss(mb.logp, mb.take(batch["old_logp"]), mb.take(batch["adv"]), am,
                                  cfg.clip_eps, cfg.clip_eps_high, agg)
        stats = dict(stats, pg_loss=pg.detach(), entropy=F.masked_aggregate(mb.entropy.detach(), am, "token-mean"))
        terms = [(pg, agg)]
        if "ref_logp" in batch:
            kl = F.masked_aggregate(F.kl_penalty(mb.logp, mb.take(batch["ref_logp"]), cfg.kl_estimator), am, agg)
            terms.append((cfg.beta * kl, agg))
            stats["kl"] = kl.detach()
        if cfg.entropy_coef > 0:
            terms.append((-(cfg.entropy_coef * F.masked_aggregate(mb.entropy, am, agg)), agg))
        return terms, stats

    def check_env(self, env) -> None:
        """Raise ``ValueError`` if ``env`` cannot feed this agent (no groups; process advantages without a PRM)."""
        if env.group_size < 2:
            raise ValueError(f"GRPO needs groups: create the env with group_size >= 2 (got {env.group_size})")
        if self.config.advantage == "process" and env.process_reward_fn is None:
            raise ValueError("advantage='process' needs an env with a process reward (process_reward=True or a PRM)")
        super().check_env(env)

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


register("grpo", GRPOConfig, "GRPO: group-relative advantages, outcome or process supervision", agent=GRPOAgent,
         min_group=2, data_parallel=True)

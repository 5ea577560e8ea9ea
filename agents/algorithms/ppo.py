"""PPO with a critic and GAE (InstructGPT-style RLHF).

Reads top to bottom: config -> KL controller -> agent -> ``learn``: for each update, roll out with
pi_old and the old critic's values -> per-token reward = env reward (PRM step scores, outcome at the
last token) - beta * KL(pi_old || ref) -> GAE (gamma, lambda) over the old values -> advantages and
returns frozen -> mu epochs of minibatch updates of the clipped policy loss and the (optionally clipped)
value regression -> adapt beta -> log.

Truncated rows: a tokengym env scores a completion cut at the token budget like any other, so the
episode's return is complete and GAE ends it at 0, as for terminated rows. Bootstrapping from V(s_M)
on top of that paid reward (``bootstrap_truncated=True``) is only right for envs whose rewards go on
past the budget: the critic is never regressed on s_M, so with gamma = 1 it chases its own bootstrap
(V -> r + V at every update; what that did on Target-v0 is in ``bench/RESULTS.md``).

Under ``torchrun`` (``self.dp``, set by :func:`~tokengym.agents.runtime.distributed.prepare`) each rank rolls out
its rows of the global batch and scores them with the critic and the reference, the ranks gather the
global batch for GAE, whitening and the KL controller, and every minibatch's policy and critic gradients
are summed over ranks before clipping: see :mod:`tokengym.agents.runtime.distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokengym.agents import functional as F
from tokengym.agents.engine.critic import Critic
from tokengym.agents.runtime.config import check_learner_args
from tokengym.agents.algorithms.onpolicy import Minibatch, OnPolicyAgent
from tokengym.agents.algorithms.onpolicy_config import OnPolicyConfig
from tokengym.agents.runtime.optim import adamw
from tokengym.agents.algorithms.registry import register
from tokengym.agents.engine.rollout import Rollout, attach_values, turn_metrics
from tokengym.rewards.packing import set_packing

__all__ = ["PPOConfig", "PPOAgent", "AdaptiveKLController", "ppo_rewards"]

@dataclass
class PPOConfig(OnPolicyConfig, renames={"kl_coef": "beta"}):
    """Hyper-parameters of :class:`PPOAgent`: :class:`OnPolicyConfig`'s (beta: the per-token KL penalty in the
    reward) and the critic's.

    The defaults are a first try for fine-tuning a warm-started policy (the shipped ``tiny-arithmetic``
    checkpoint, 64 rollouts per update): a small learning rate, since larger ones stall or hurt there. They
    also learn ``Target-v0`` from a random tiny model, slowly. Measurements: ``bench/RESULTS.md``.
    """

    lr: float = 3e-5
    mu: int = 4
    minibatches: int = 2
    beta: float = 0.05
    kl_estimator: str = "k1"
    aggregation: str = "token-mean"
    eval_every: int = 0
    critic_lr: float = 1e-3
    """Critic learning rate (its own AdamW)."""
    gamma: float = 1.0
    """Discount factor of GAE."""
    lam: float = 0.95
    """GAE lambda."""
    value_clip: float | None = 0.2
    """Value clipping range around V_old (None = plain MSE)."""
    kl_target: float | None = None
    """Target KL per sequence for the adaptive controller (None = fixed beta)."""
    kl_horizon: int = 10_000
    """Horizon (in episodes) of the adaptive KL controller."""
    bootstrap_truncated: bool = False
    """Bootstrap truncated rows from V(s_M) in GAE (only for envs whose rewards continue past the budget; see the module docstring)."""
    whiten_advantages: bool = True
    """Whiten advantages over the batch's action tokens."""
    share_trunk: bool = False
    """Critic shares the policy's transformer trunk (one backbone, two heads) instead of its own copy."""

    def checks(self) -> dict[str, bool]:
        return {"critic_lr": self.critic_lr > 0, "gamma": 0 <= self.gamma <= 1, "lam": 0 <= self.lam <= 1,
                "value_clip": self.value_clip is None or self.value_clip > 0,
                "kl_target": self.kl_target is None or self.kl_target > 0, "kl_horizon": self.kl_horizon > 0}


class AdaptiveKLController:
    """Ziegler et al. (2019): ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon``."""

    def __init__(self, init: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = float(init), target, horizon

    def update(self, kl: float, n_episodes: int) -> None:
        if self.target is None:
            return
        err = max(-0.2, min(0.2, kl / self.target - 1.0))
        self.value *= 1.0 + err * n_episodes / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.target, self.horizon = state["value"], state["target"], state["horizon"]


def ppo_rewards(ro: Rollout, ref_logp: torch.Tensor | None, beta: float, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``[N, M]`` = env rewards - beta * KL(pi_old || ref); also the KL ``[N, M]``."""
    am = ro.action_mask
    if ref_logp is None:
        kl = torch.zeros_like(ro.rewards)
    else:
        kl = F.kl_penalty(ro.logprobs, ref_logp, estimator) * am
    return (ro.rewards - beta * kl) * am, kl


class PPOAgent(OnPolicyAgent):
    """PPO with a critic on a :class:`~tokengym.envs.TokenVectorEnv` (``DISABLED`` autoreset).

    Args:
        policy: the :class:`~tokengym.agents.Policy` to train.
        config: :class:`PPOConfig`.
        critic: a :class:`~tokengym.agents.Critic`; default: ``Critic.from_policy(policy, config.share_trunk, config.seed)``.
        run_dir: where to write TensorBoard events and ``metrics.jsonl`` (None = memory only).

    Example:
        >>> import gymnasium as gym, tokengym.envs
        >>> from tokengym.agents import Policy, PPOAgent, PPOConfig
        >>> env = gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point",
        ...                    partial_credit=True)
        >>> agent = PPOAgent(Policy.from_pretrained("tiny"), PPOConfig(steps=2))
        >>> history = agent.learn(env)
        >>> len(history), sorted(agent.checkpoint_modules())
        (2, ['critic', 'policy', 'ref'])
    """

    config_cls = PPOConfig
    update_passes = 2  # policy and critic
    optimizer_names = ("policy_optimizer", "critic_optimizer")
    grad_norm_names = ("grad_norm", "critic_grad_norm")
    log_iteration = False

    def __init__(self, policy, config: PPOConfig | None = None, critic: Critic | None = None, run_dir: str | None = None):
        check_learner_args(type(self).__name__, policy, config, PPOConfig)
        cfg = config or PPOConfig()
        self.critic = critic if critic is not None else Critic.from_policy(policy, share_trunk=cfg.share_trunk, seed=cfg.seed)
        set_packing(cfg.packing, self.critic)  # a Critic (a user's own value model packs or not as it likes)
        self.kl_ctl = AdaptiveKLController(cfg.beta, cfg.kl_target, cfg.kl_horizon)
        super().__init__(policy, cfg, run_dir)
        self.policy_opt, self.critic_opt = self.optimizers

    # ------------------------------------------------------------------ the skeleton's hooks
    def uses_reference(self) -> bool:
        return self.config.beta > 0

    def make_optimizers(self) -> list[torch.optim.Optimizer]:
        policy_params = list(self.policy.parameters())
        ids = {id(p) for p in policy_params}
        critic_params = [p for p in self.critic.parameters() if id(p) not in ids]  # shared trunk: policy optimiser owns it
        return [adamw(policy_params, lr=self.config.lr, weight_decay=self.config.weight_decay),
                adamw(critic_params, lr=self.config.critic_lr)]

    def checkpointed_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.policy.model, self.critic.trunk)

    def train_mode(self, on: bool) -> None:
        self.policy.train(on)
        self.critic.train(on)

    def collect(self, env) -> Rollout:
        """The skeleton's rollout (this process's sampler, an engine's or a worker's) with the critic's values, now."""
        return attach_values(super().collect(env), self.critic)

    def extra_state(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_ctl.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_controller"])

    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """Modules whose weights a checkpoint must hold: ``policy`` (the model), ``critic`` and, when the
        reference is a separate frozen copy (``beta > 0``, no LoRA adapter to disable), ``ref``."""
        modules = {"policy": self.policy.model, "critic": self.critic}
        if isinstance(getattr(self.ref, "model", None), torch.nn.Module):
            modules["ref"] = self.ref.model
        return modules

    # ------------------------------------------------------------------ advantages
    @torch.no_grad()
    def advantages(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Frozen ``(advantages, returns)`` of a rollout and the KL statistics.

        ``ref_logp``: the reference's log-probs of the rollout (default: computed here when there is a reference).
        """
        cfg = self.config
        if ref_logp is None and self.ref is not None:
            ref_logp = self._logprobs(self.ref, ro)
        rewards, kl = ppo_rewards(ro, ref_logp, self.kl_ctl.value, cfg.kl_estimator)
        last_values = ro.last_values if cfg.bootstrap_truncated else None
        adv, ret = F.gae(rewards, ro.values, ro.action_mask, cfg.gamma, cfg.lam, last_values)
        if cfg.whiten_advantages:
            adv = F.whiten(adv, ro.action_mask)
        seq_kl = kl.sum(1).mean()
        stats = {
            "objective/kl": seq_kl,
            "objective/kl_coef": self.kl_ctl.value,
            "objective/non_score_reward": (-self.kl_ctl.value * kl).sum(1).mean(),
            "returns/mean": F.masked_aggregate(ret, ro.action_mask, "token-mean"),
            "advantages/mean": F.masked_aggregate(adv, ro.action_mask, "token-mean"),
            "advantages/std": adv[ro.action_mask.bool()].std() if ro.action_mask.sum() > 1 else 0.0,
        }
        return adv, ret, stats

    def prepare(self, ro: Rollout, old_logp: torch.Tensor, ref_logp: torch.Tensor | None):
        adv, ret, stats = self.advantages(ro, ref_logp)
        return {"adv": adv, "ret": ret, "values": ro.values}, stats

    # ------------------------------------------------------------------ update
    def loss_kinds(self) -> list[str]:
        return [self.config.aggregation, "token-mean"]  # the policy loss's, the value loss's

    def forward_extra(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int, m: int) -> dict[str, torch.Tensor]:
        return {"values": self.critic(tokens, mask, prompt_len)[:, :m]}

    def loss(self, mb: Minibatch, batch: dict[str, torch.Tensor]):
        cfg, am = self.config, mb.action_mask
        weights = mb.take(batch["weights"]) if "weights" in batch else None  # the rollout correction's
        pg, pstats = F.policy_loss(mb.logp, mb.take(batch["old_logp"]), mb.take(batch["adv"]), am,
                                   cfg.clip_eps, cfg.clip_eps_high, cfg.aggregation, weights)
        vf, vstats = F.value_loss(mb.extra["values"], mb.take(batch["values"]), mb.take(batch["ret"]), am, cfg.value_clip)
        terms = [(pg, cfg.aggregation), (vf, "token-mean")]
        if cfg.entropy_coef > 0:
            terms.append((-(cfg.entropy_coef * F.masked_aggregate(mb.entropy, am, cfg.aggregation)), cfg.aggregation))
        stats = {**pstats, **vstats, "policy_loss": pg.detach(), "value_loss": vf.detach(),
                 "entropy": F.masked_aggregate(mb.entropy.detach(), am, "token-mean")}
        return terms, stats

    def reduce_stats(self, stats: dict[str, Any], shares: dict[str, float], mb: Minibatch, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        stats.pop("loss")  # policy_loss and value_loss are logged; their sum has no global form under data parallelism
        if not self.dp.distributed:
            return stats
        return global_stats(self.dp, stats, shares[self.config.aggregation], shares["token-mean"],
                            mb.extra["values"].detach(), mb.take(batch["ret"]), mb.action_mask)

    def after_update(self, ro: Rollout, stats: dict[str, Any]) -> None:
        self.kl_ctl.update(float(stats["objective/kl"]), ro.num_episodes)

    def rollout_metrics(self, ro: Rollout, batch: dict[str, torch.Tensor], seconds: float) -> dict[str, Any]:
        lengths = ro.lengths.float()
        ret = batch["ret"]
        return {
            "objective/score": ro.outcome.mean(),
            "reward/std": ro.outcome.std() if ro.num_episodes > 1 else 0.0,
            "reward/accuracy": (ro.outcome >= 1.0 - 1e-6).float().mean(),
            "values/explained_variance_rollout": F.value_loss(ro.values, ro.values, ret, ro.action_mask)[1]["explained_variance"],
            "completion/length_mean": lengths.mean(),
            "completion/length_max": lengths.max(),
            "completion/truncated_frac": ro.truncated.float().mean(),
            "perf/tokens_per_s": lengths.sum() / max(seconds, 1e-9),
            **turn_metrics(ro),
        }


def global_stats(dp, stats: dict[str, Any], pshare: float, tshare: float, values: torch.Tensor,
                 returns: torch.Tensor, am: torch.Tensor) -> dict[str, float]:
    """A PPO minibatch's statistics over all ranks from this rank's share: token means weighted by the share's
    tokens, the policy loss by its share of the loss, maxima by max, explained variance from the summed
    moments of the returns and residuals (one all-reduce, plus one for the maxima)."""
    weight = {"policy_loss": pshare, "grad_norm": 1.0 / dp.world_size, "critic_grad_norm": 1.0 / dp.world_size}
    valid = am.bool()
    r, e = returns.double()[valid], (returns.double() - values.double())[valid]
    moments = {"n": float(valid.sum()), "r": float(r.sum()), "r2": float((r * r).sum()),
               "e": float(e.sum()), "e2": float((e * e).sum())}
    local = {k: (float(v) if k.endswith("_max") else float(v) * weight.get(k, tshare)) for k, v in stats.items()
             if k != "explained_variance"}
    out = dp.weighted({**local, **{f"moment/{k}": v for k, v in moments.items()}}, 1.0)
    s = {k: out.pop(f"moment/{k}") for k in moments}
    n = s["n"]
    var = {k: (s[f"{k}2"] - s[k] ** 2 / n) / (n - 1) if n >= 2 else 0.0 for k in "re"}
    eps = torch.finfo(torch.float32).eps  # value_loss's rule: Var(R) negligible next to Var(R - V) -> 0
    out["explained_variance"] = 1.0 - var["e"] / var["r"] if var["r"] > eps * var["e"] else 0.0
    return out


register("ppo", PPOConfig, "PPO with a critic and GAE (optionally against a learned reward model)", agent=PPOAgent,
         rollout=(64, 1), data_parallel=True)
"""64 episodes per step, as GRPO's 8 x 8: with 8 rollouts per update PPO against the learned RM lowered held-out
greedy accuracy, with 64 it raised it (``bench/RESULTS.md``)."""

"""GRPO (DeepSeekMath): group-relative advantages, outcome or process supervision, no critic.

Reads top to bottom: config -> agent (reference model, optimiser) -> ``learn``: for each outer
iteration (optionally resetting the reference to the current policy), for each sampling step:
rollout G completions per prompt from a ``group_size=G`` vector env -> advantages -> mu epochs of
minibatch updates of the clipped surrogate + beta * KL(pi || ref) (k3) -> log.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from tokengym.agents import functional as F
from tokengym.agents.config import check_config
from tokengym.agents.distributed import LOCAL, aggregation_weights
from tokengym.agents.logger import RunLogger
from tokengym.agents.models import enable_checkpointing
from tokengym.agents.optim import adamw
from tokengym.agents.policy import make_reference
from tokengym.agents.resources import check_fits
from tokengym.agents.rollout import Rollout, collect, evaluate, trimmed_logprobs, turn_metrics, used_slice

__all__ = ["GRPOConfig", "GRPOAgent", "grpo_advantages", "LR_SCHEDULES"]

LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}
"""Learning-rate multiplier as a function of the fraction of sampling steps already taken (0 at the first)."""


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


class GRPOAgent:
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

    def __init__(self, policy, config: GRPOConfig | None = None, run_dir: str | None = None):
        self.policy = policy
        self.config = config or GRPOConfig()
        self.logger = RunLogger(run_dir)
        self.optimizer = adamw(policy.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay)
        if self.config.gradient_checkpointing:
            enable_checkpointing(policy.model)
        self.ref = make_reference(policy) if self.config.beta > 0 else None  # beta = 0: no reference at all
        self.global_step = 0
        self._resume_step: int | None = None  # set by load_state_dict: learn() continues its schedule from here
        self._shuffle = torch.Generator().manual_seed(self.config.seed)
        self.dp = LOCAL  # data parallel: set by distributed.prepare under torchrun

    # ------------------------------------------------------------------ checkpoint state
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """Modules whose weights a checkpoint holds: the policy, and a frozen reference copy when there is one."""
        mods = {"policy": self.policy.model}
        if isinstance(self.ref, torch.nn.Module):  # a frozen Policy copy (a LoRA reference has no weights of its own)
            mods["ref"] = self.ref.model
        return mods

    def state_dict(self) -> dict[str, Any]:
        """Everything but module weights needed to continue exactly: step, optimiser, generators."""
        return {"global_step": self.global_step, "optimizer": self.optimizer.state_dict(),
                "shuffle_rng": self._shuffle.get_state(), "policy_rng": self.policy.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next :meth:`learn` call runs the rest of the interrupted schedule."""
        self.global_step = int(state["global_step"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._shuffle.set_state(state["shuffle_rng"])
        self.policy.generator.set_state(state["policy_rng"])
        self._resume_step = self.global_step

    # ------------------------------------------------------------------ rollout
    def _rollout(self, env) -> tuple[Rollout, dict[str, float]]:
        t0, r0 = time.perf_counter(), env.reward_seconds
        self.policy.eval()
        with self._autocast(env.device):
            ro = collect(env, self.policy, seed=self.config.seed if self.global_step == 0 else None)
        dt = time.perf_counter() - t0
        reward_t = env.reward_seconds - r0
        return ro, {"time/rollout": dt - reward_t, "time/reward": reward_t}

    def _autocast(self, device: torch.device | str):
        """bf16 autocast on ``device`` when ``config.bf16`` (a no-op context otherwise)."""
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=self.config.bf16)

    @torch.no_grad()
    def _ref_logprobs(self, ro: Rollout) -> torch.Tensor | None:
        if self.ref is None:
            return None
        with self._autocast(ro.tokens.device):
            return trimmed_logprobs(self.ref, ro)

    def _schedule_lr(self) -> float:
        """Set the learning rate of the coming sampling step from ``global_step`` (so a resumed run continues the schedule)."""
        cfg = self.config
        progress = min(self.global_step / max(cfg.iterations * cfg.steps, 1), 1.0)
        lr = cfg.lr * LR_SCHEDULES[cfg.lr_schedule](progress)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # ------------------------------------------------------------------ update
    def _update(self, ro: Rollout, adv: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None) -> dict[str, float]:
        cfg, n = self.config, ro.num_episodes
        self.policy.train()
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.mu):
            order = torch.randperm(n, generator=self._shuffle).to(ro.tokens.device)
            for mb in order.chunk(cfg.minibatches):
                mb, share = self.dp.shard(mb, aggregation_weights(ro.action_mask, cfg.aggregation))
                mb, n_live = self._live_first(mb, adv)
                tokens, mask, p, m = used_slice(ro, mb)  # columns that are padding in every row are skipped
                am = ro.action_mask[mb, :m]
                with self._autocast(ro.tokens.device):
                    logp, ent = self._forward(tokens, mask, p, n_live)
                loss, stats = F.policy_loss(logp, old_logp[mb, :m], adv[mb, :m], am, cfg.clip_eps, cfg.clip_eps_high, cfg.aggregation)
                stats = dict(stats, pg_loss=loss.detach(), entropy=F.masked_aggregate(ent.detach(), am, "token-mean"))
                if ref_logp is not None:
                    kl = F.masked_aggregate(F.kl_penalty(logp, ref_logp[mb, :m], cfg.kl_estimator), am, cfg.aggregation)
                    loss = loss + cfg.beta * kl
                    stats["kl"] = kl.detach()
                if cfg.entropy_coef > 0:
                    loss = loss - cfg.entropy_coef * F.masked_aggregate(ent, am, cfg.aggregation)
                self.optimizer.zero_grad(set_to_none=True)
                if n_live:
                    (loss * share).backward()  # share = 1 in a single process
                else:  # every advantage is 0: the gradient is exactly 0, and AdamW still takes its (momentum) step
                    for p in self.policy.parameters():
                        if p.requires_grad:  # as backward would: frozen weights (a LoRA base) get no gradient buffer
                            p.grad = torch.zeros_like(p)
                self.dp.sync_gradients(self.policy.parameters())
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
                self.optimizer.step()
                stats["grad_norm"] = norm
                stats["loss"] = loss.detach()
                for k, v in self.dp.weighted(stats, share).items():  # global statistics of the minibatch
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        return {f"train/{k}": v / count for k, v in sums.items()}

    def _live_first(self, mb: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Rows ``mb`` reordered with those that have a nonzero advantage first, and how many there are.

        With ``skip_zero_advantage``, ``beta = 0`` and no entropy bonus, a row whose advantage is 0 on every
        token (a group whose rewards are all equal) adds exactly nothing to the loss or its gradient; all
        rows count when those conditions do not hold. The order of rows does not change the loss.
        """
        cfg = self.config
        if not (cfg.skip_zero_advantage and cfg.beta == 0 and cfg.entropy_coef == 0):
            return mb, len(mb)
        live = (adv[mb] != 0).any(1)
        return torch.cat([mb[live], mb[~live]]), int(live.sum())

    def _forward(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int, n_live: int):
        """Log-probs and entropies of every row; only the first ``n_live`` rows are recorded for backward
        (the others run without autograd: their statistics are logged, their gradient would be 0)."""
        if n_live == len(tokens):
            return self.policy(tokens, mask, prompt_len, return_entropy=True)
        with torch.no_grad():
            rest = self.policy(tokens[n_live:], mask[n_live:], prompt_len, return_entropy=True)
        if n_live == 0:
            return rest
        live = self.policy(tokens[:n_live], mask[:n_live], prompt_len, return_entropy=True)
        return torch.cat([live[0], rest[0]]), torch.cat([live[1], rest[1]])

    # ------------------------------------------------------------------ loop
    def check_env(self, env) -> None:
        """Raise ``ValueError`` if ``env`` cannot feed this agent (no groups; process advantages without a PRM)."""
        if env.group_size < 2:
            raise ValueError(f"GRPO needs groups: create the env with group_size >= 2 (got {env.group_size})")
        if self.config.advantage == "process" and env.process_reward_fn is None:
            raise ValueError("advantage='process' needs an env with a process reward (process_reward=True or a PRM)")
        check_fits(self.policy, env)

    def learn(
        self,
        env,
        eval_env=None,
        eval_samples: list | None = None,
        callback: Callable[[dict[str, float]], Any] | None = None,
    ) -> list[dict[str, float]]:
        """Train on ``env`` (a ``TokenVectorEnv`` with ``group_size >= 2``); return the logged records.

        With ``eval_env`` (group_size 1) and ``eval_samples`` (e.g. :func:`heldout_samples`), greedy
        held-out accuracy is logged every ``eval_every`` steps and after the last step.
        """
        cfg = self.config
        self.check_env(env)
        if self.global_step == 0:
            self.policy.seed(cfg.seed)
        history_start = len(self.logger.history)
        done, self._resume_step = self._resume_step or 0, None  # steps of this schedule already taken (resume)
        for it in range(cfg.iterations):
            if done >= (it + 1) * cfg.steps:
                continue
            if cfg.beta > 0 and cfg.reset_ref and done <= it * cfg.steps:
                self.ref = make_reference(self.policy)
            for _ in range(cfg.steps - max(0, done - it * cfg.steps)):
                t_start = time.perf_counter()
                ro, timing = self._rollout(env)
                old_logp = None
                if not cfg.reuse_rollout_logprobs:
                    with torch.no_grad(), self._autocast(ro.tokens.device):
                        old_logp = trimmed_logprobs(self.policy, ro)
                ref_logp = self._ref_logprobs(ro)
                ro, old_logp, ref_logp = self.dp.gather(ro, old_logp, ref_logp)  # data parallel: the global batch
                old_logp = ro.logprobs if old_logp is None else old_logp
                adv = grpo_advantages(ro, cfg.advantage, cfg.scale_rewards)
                t_up = time.perf_counter()
                lr = self._schedule_lr()
                metrics = self._update(ro, adv, old_logp, ref_logp)
                metrics["train/lr"] = lr
                timing["time/update"] = time.perf_counter() - t_up
                self.global_step += 1
                metrics.update(timing)
                metrics.update(self._rollout_metrics(ro, time.perf_counter() - t_start))
                metrics["iteration"] = it
                if eval_env is not None and eval_samples and cfg.eval_every and self.global_step % cfg.eval_every == 0:
                    metrics.update(self.evaluate(eval_env, eval_samples))
                record = self.logger.log(self.global_step, metrics)
                if callback is not None and callback(record) is False:
                    return self.logger.history[history_start:]
        if eval_env is not None and eval_samples and not (cfg.eval_every and self.global_step % cfg.eval_every == 0):
            self.logger.log(self.global_step, self.evaluate(eval_env, eval_samples))
        return self.logger.history[history_start:]

    def evaluate(self, eval_env, samples: list) -> dict[str, float]:
        self.policy.eval()
        res = evaluate(self.policy, eval_env, samples, greedy=True)
        return {f"eval/{k}": v for k, v in res.items()}

    @staticmethod
    def _rollout_metrics(ro: Rollout, seconds: float) -> dict[str, float]:
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

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)

"""Supervised warm start (SFT): teach a policy a task's reference solutions before RL.

Reads top to bottom: config -> data -> loss -> loop -> eval.

* **Data.** A seeded stream of task samples becomes teacher-forced batches laid out exactly like a
  :class:`~tokengym.envs.TokenVectorEnv` buffer: the prompt (with ``<bos>``) left-padded into ``P``
  columns, the completion ``solution + <eos>`` from column ``P``, right-padded. Prompts of the held-out
  evaluation set are never trained on.
* **Loss.** The mean token cross-entropy over completion tokens only, computed as
  ``-Policy.forward(tokens, mask, P)``: the very log-probabilities the RL agents use (same position ids,
  same temperature scaling, same chunked log-softmax). Prompt and padding positions carry no loss.
* **Loop.** AdamW, linear warmup then cosine (or linear / constant) decay, gradient clipping, optional
  CPU/GPU bf16 autocast, periodic held-out greedy evaluation with :func:`tokengym.agents.engine.rollout.evaluate`.
  :class:`SFTLearner` holds it with the resume contract of ``tokengym train`` (``tokengym train sft --resume``
  continues a killed run exactly); metrics go through :class:`~tokengym.agents.runtime.logger.RunLogger`.

Example:
    >>> from tokengym.agents.engine.policy import Policy
    >>> from tokengym.envs.tasks import ArithmeticTask
    >>> policy = Policy.from_pretrained("tiny")
    >>> task = ArithmeticTask(n_operands=2, digits=1, operators="+")
    >>> cfg = SFTConfig(steps=3, batch_size=8, warmup_steps=1, eval_every=0, eval_prompts=8, log_every=0)
    >>> hist = train_sft(policy, task, cfg)
    >>> len(hist["loss"]), 0.0 <= hist["eval"][-1]["accuracy"] <= 1.0
    (3, True)

Command line: ``tokengym train sft`` (task settings through ``--env-kwargs``; the run folder holds the
config, metrics and the trained model), then ``tokengym eval --run runs/NAME`` for held-out accuracy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from tokengym.agents.runtime.distributed import LOCAL
from tokengym.agents.runtime.logger import RunLogger
from tokengym.agents.runtime.optim import (LR_SCHEDULES, OptimizerStep, ScheduledOptimConfig, TrainLoopConfig,
                                          lr_factor as schedule_factor)
from tokengym.rewards.packing import PACKING, packed_share, set_packing
from tokengym.agents.engine.rollout import evaluate, heldout_samples
from tokengym.envs.chat import encode_prompts
from tokengym.envs.tasks.base import fresh_samples
from tokengym.agents.algorithms.registry import register
from tokengym.rewards.common import Rename, Renamed, plain_scalars

__all__ = ["SFTConfig", "SFTBatch", "make_batch", "batches", "sft_loss", "lr_factor", "SFTLearner", "train_sft", "evaluate_policy"]


# ====================================================================== config
def _clip_off_is_zero(value: Any) -> Any:
    """The old ``grad_clip``'s "off" (None) as ``max_grad_norm``'s (0)."""
    return 0.0 if value is None or (isinstance(value, str) and value.lower() in ("none", "null")) else value


@dataclass
class SFTConfig(TrainLoopConfig, ScheduledOptimConfig, Renamed,
                renames={"grad_clip": Rename("max_grad_norm", _clip_off_is_zero), "warmup": "warmup_steps",
                         "schedule": "lr_scheduler_type", "eval_batch": "eval_batch_size"}):
    """Settings of a supervised warm start (defaults suit the ``tiny`` preset on arithmetic): the optimiser's and
    the training loop's (:mod:`tokengym.rewards.training`; SFT's own defaults), and SFT's below."""

    lr: float = 3e-3
    weight_decay: float = 0.01
    lr_scheduler_type: str = "cosine"
    warmup_steps: int = 100
    eval_every: int = 100
    batch_size: int = 64
    """Training sequences per optimizer step."""
    steps: int = 800
    """Optimizer steps (enough for ``tiny`` to learn the default 2-3 operand 2-digit addition)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (cosine and linear schedules)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW ``(beta1, beta2)``."""
    bf16: bool = False
    """Run forward and backward under bf16 autocast (weights and optimizer stay float32)."""
    eval_prompts: int = 256
    """Number of held-out prompts (``rollout.heldout_samples``) used for evaluation (0: no evaluation)."""
    eval_batch_size: int = 256
    """Parallel episodes of the evaluation env (``num_envs``)."""
    exclude_heldout: bool = True
    """Never train on a prompt that is in the held-out evaluation set."""
    stop_at_accuracy: float | None = None
    """Stop early once a held-out evaluation reaches this accuracy (``None``: always run all steps)."""
    log_every: int = 50
    """Record/print the training loss every this many steps (0: never print; loss is still recorded)."""
    run_dir: str | None = None
    """If set, :meth:`SFTLearner.fit` writes the run folder ``tokengym train sft`` writes there (as ``fit(run_dir=...)``)."""

    def __post_init__(self) -> None:  # its own checks (messages of their own), the shared fields' included
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SFTConfig.{name} {why}, got {getattr(self, name)!r}")

        plain_scalars(self)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            bad("lr", "must be a finite number > 0")
        for name in ("batch_size", "steps", "eval_prompts", "eval_batch_size"):
            v, low = getattr(self, name), 0 if name in ("steps", "eval_prompts") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(name, f"must be an int >= {low}")
        if self.eval_prompts == 0 and self.stop_at_accuracy is not None:
            bad("stop_at_accuracy", "needs an evaluation to stop on (eval_prompts=0 turns it off)")
        for name in ("warmup_steps", "eval_every", "log_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(name, "must be an int >= 0")
        if self.lr_scheduler_type not in LR_SCHEDULES:
            bad("lr_scheduler_type", f"must be one of {sorted(LR_SCHEDULES)}")
        if self.packing not in PACKING:
            bad("packing", f"must be one of {list(PACKING)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", "must be in [0, 1]")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")
        if not (isinstance(self.max_grad_norm, (int, float)) and math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            bad("max_grad_norm", "must be a finite number >= 0 (0 = off)")
        if self.stop_at_accuracy is not None and not 0.0 < self.stop_at_accuracy <= 1.0:
            bad("stop_at_accuracy", "must be in (0, 1] or None")

    @property
    def decay_steps(self) -> int:
        """Steps after warmup over which the learning rate decays."""
        return max(self.steps - self.warmup_steps, 1)

    @property
    def schedule_steps(self) -> int:
        """The length of the learning-rate schedule: warmup plus decay."""
        return self.warmup_steps + self.decay_steps

    @property
    def tokens_seen(self) -> int:
        """Training sequences seen over the whole run (``steps * batch_size``)."""
        return self.steps * self.batch_size


# ====================================================================== data
@dataclass
class SFTBatch:
    """Teacher-forced sequences in the env's layout.

    ``tokens[N, P + M]``: prompts (``<bos>`` included) left-padded into the first ``P`` columns, the
    completion (``solution + <eos>``) from column ``P``, right-padded. ``mask`` is 1 on real tokens;
    ``loss_mask[N, M]`` is 1 on the completion tokens the agent writes (not on env replies), the only ones that
    carry loss.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: int

    def to(self, device: str | torch.device) -> "SFTBatch":
        return SFTBatch(self.tokens.to(device), self.mask.to(device), self.loss_mask.to(device), self.prompt_len)

    def select(self, rows: torch.Tensor) -> "SFTBatch":
        """The batch's rows ``rows`` (a data-parallel rank's share)."""
        return SFTBatch(self.tokens[rows], self.mask[rows], self.loss_mask[rows], self.prompt_len)


def make_batch(samples: Sequence[dict[str, Any]], tokenizer: Any, prompt_len: int) -> SFTBatch:
    """Lay out ``samples`` (dicts with ``"prompt"`` and ``"solution"``) like a ``TokenVectorEnv`` buffer.

    Prompts are encoded as the env encodes them (special tokens on: the char tokenizer prepends
    ``<bos>``); solutions without special tokens, then ``<eos>`` (the action that ends an episode).
    A multi-turn sample's ``"solution_turns"`` (agent and env turns, alternating) are tokenized one turn at a
    time, as the env tokenizes its replies, and only the agent's turns (and ``<eos>``) carry loss.
    """
    if not samples:
        raise ValueError("make_batch needs at least one sample")
    missing = [i for i, s in enumerate(samples) if not isinstance(s.get("solution"), str)]
    if missing:
        raise ValueError(f"SFT needs a reference 'solution' string in every sample; sample {missing[0]} has none")
    prompts = encode_prompts(tokenizer, [s["prompt"] for s in samples])  # chat prompts through the template
    eos = tokenizer.eos_token_id
    eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
    comps, agent = [], []
    for s in samples:
        turns = s.get("solution_turns") or [s["solution"]]
        pieces = tokenizer(list(turns), add_special_tokens=False)["input_ids"]
        comps.append([t for p in pieces for t in p] + [eos])
        agent.append([k % 2 == 0 for k, p in enumerate(pieces) for _ in p] + [True])
    longest = max(len(p) for p in prompts)
    if longest > prompt_len:
        raise ValueError(f"a prompt has {longest} tokens but prompt_len={prompt_len}; pass a larger prompt_len")
    P, M, N = prompt_len, max(len(c) for c in comps), len(samples)
    tokens = torch.full((N, P + M), int(tokenizer.pad_token_id), dtype=torch.long)
    mask = torch.zeros((N, P + M), dtype=torch.bool)
    loss_mask = torch.zeros((N, M), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        tokens[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        tokens[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, P - len(p) : P + len(c)] = True
        loss_mask[i, : len(c)] = torch.tensor(agent[i])
    return SFTBatch(tokens, mask, loss_mask, P)


def batches(task: Any, tokenizer: Any, batch_size: int, prompt_len: int, seed: int = 0,
            exclude: set[str] | None = None, rng: np.random.Generator | None = None) -> Iterator[SFTBatch]:
    """An endless, seeded stream of batches from ``task.batch`` (prompts in ``exclude`` are skipped).

    ``rng`` (default: seeded with ``seed``) is the stream's only state: setting its ``bit_generator.state``
    between batches moves the stream to where that state was taken (how :class:`SFTLearner` resumes).
    """
    rng = rng if rng is not None else np.random.default_rng(seed)
    while True:
        yield make_batch(fresh_samples(task, batch_size, rng, exclude or set()), tokenizer, prompt_len)


# ====================================================================== loss
def sft_loss(policy: Any, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean cross-entropy over completion tokens: ``-sum(logp * loss_mask) / sum(loss_mask)``.

    ``logp`` is ``policy(tokens, mask, P)``, the per-token log-probabilities the RL agents use (so a
    policy with ``temperature != 1`` is fitted through its tempered sampling distribution).
    Returns ``(loss, {"loss": detached loss, "tokens": number of scored tokens})``.
    """
    logp = policy(batch.tokens, batch.mask, batch.prompt_len)
    m = batch.loss_mask.to(logp.dtype)
    n = m.sum().clamp(min=1.0)
    loss = -(logp * m).sum() / n
    return loss, {"loss": loss.detach(), "tokens": n.detach()}


def lr_factor(step: int, cfg: SFTConfig) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): warmup, then ``cfg.lr_scheduler_type``."""
    return schedule_factor(step, cfg.schedule_steps, cfg.lr_scheduler_type, cfg.warmup_steps,
                           cfg.min_lr_ratio)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


# ====================================================================== loop
class SFTLearner:
    """The SFT loop with the resume contract of ``tokengym train`` (as :class:`~tokengym.agents.algorithms.dpo.DPOLearner`).

    ``checkpoint_modules`` / ``state_dict`` / ``load_state_dict`` hold the weights, the optimiser, the step, the
    data stream's and the policy's generators and the history; after a restore, :meth:`fit` runs the remaining
    steps with the same batches, learning rates and logged records as one uninterrupted fit.
    ``logger`` (a :class:`~tokengym.agents.runtime.logger.RunLogger`) holds the metrics; a fit in a run folder
    (``fit(run_dir=...)`` or ``config.run_dir``) writes them there.
    Data parallel (``dp``, set by :func:`~tokengym.agents.runtime.distributed.prepare` under torchrun): every rank draws
    the global batch and trains on its rows, its loss weighted by its share of the batch's completion tokens,
    and the summed gradients give every rank the 1-process step.
    """

    def __init__(self, policy: Any, task: Any, config: SFTConfig | None = None, prompt_len: int | None = None):
        from tokengym.agents.engine.resources import check_fits
        from tokengym.envs import TokenVectorEnv

        self.policy, self.task = policy, task
        self.config = cfg = config or SFTConfig()
        set_packing(cfg.packing, policy)
        self.heldout = heldout_samples(task, cfg.eval_prompts)
        self.eval_env = TokenVectorEnv(min(cfg.eval_batch_size, max(cfg.eval_prompts, 1)), task, tokenizer=policy.tokenizer,
                                       device=policy.device, max_prompt_len=prompt_len)
        check_fits(policy, self.eval_env)  # rows past the model's positions: one line now, not mid-run (or silently)
        P = self.eval_env.max_prompt_len  # the env's default room for the task's prompts (chat templates included)
        self._rng = np.random.default_rng(cfg.seed)  # the data stream's only state (saved in checkpoints)
        exclude = {s["prompt"] for s in self.heldout} if cfg.exclude_heldout else None
        self._stream = batches(task, policy.tokenizer, cfg.batch_size, P, exclude=exclude, rng=self._rng)
        # plain (unfused) AdamW, no weight decay on norms and biases; clipped in the model's parameter order
        self.optim = OptimizerStep.adamw(_param_groups(policy.model, cfg.weight_decay), cfg.lr, fused=False, betas=cfg.betas,
                                         schedule=cfg.lr_scheduler_type, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio,
                                         max_grad_norm=cfg.max_grad_norm, sync=lambda params: self.dp.sync_gradients(params),
                                         clip_params=[list(policy.model.parameters())])
        self.logger = RunLogger(None)  # a run folder's logger comes with its fit (see fit)
        self.global_step = 0
        self.dp = LOCAL
        self.hist: dict[str, Any] = {"step": [], "loss": [], "lr": [], "eval": [], "config": dataclasses.asdict(cfg)}
        self._elapsed = 0.0  # wall seconds spent before the current fit (in an earlier, interrupted process)
        self._t0: float | None = None

    # ------------------------------------------------------------------ checkpoint state
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.policy.model}

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights needed to continue exactly: step, optimiser, generators, history."""
        return {"global_step": self.global_step, **self.optim.state_dict(),
                "data_rng": self._rng.bit_generator.state, "policy_rng": self.policy.generator.get_state(),
                "history": {k: self.hist[k] for k in ("step", "loss", "lr", "eval")}, "elapsed": self._wall()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.optim.load_state_dict(state)
        self._rng.bit_generator.state = state["data_rng"]
        self.policy.generator.set_state(state["policy_rng"])
        self.hist.update({k: list(v) for k, v in state["history"].items()})
        self._elapsed = float(state["elapsed"])

    def _wall(self) -> float:
        return self._elapsed + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    # ------------------------------------------------------------------ loop
    def fit(self, log: Callable[[int, dict[str, float]], None] | None = None,
            callback: Callable[[dict[str, Any]], Any] | None = None, *, run_dir: str | None = None,
            resume: bool = False, save_every: int = 10) -> dict[str, Any]:
        """Train up to ``config.steps`` (or ``stop_at_accuracy``); return the history (see :func:`train_sft`).

        ``log(step, metrics)`` sees every training and evaluation record; ``callback(record)`` is called after
        every step with ``{"step": ..., **what was logged at it}``, and returning ``False`` stops right there
        (a checkpoint saved in it resumes exactly).

        ``run_dir`` (default ``config.run_dir``): write the folder ``tokengym train sft`` writes (``config.json``
        recording the task, ``metrics.jsonl``, checkpoints every ``save_every`` steps, ``model/``), so that
        ``tokengym eval/plot/sample --run`` work on it. A folder that is not empty is refused unless
        ``resume=True``, which continues it from its newest checkpoint as ``--resume`` does (a missing or empty
        folder starts the run).
        """
        run_dir = run_dir if run_dir is not None else self.config.run_dir
        if run_dir is not None:
            from tokengym.agents.runtime.run_config import RunConfig
            from tokengym.agents.runtime.session import jsonable, python_run, run_in_folder

            settings = RunConfig(save_every=save_every, progress=False)  # no progress bar from Python
            config = {"algorithm": "sft", "preset": None,  # the folder is the run's: config.json names none
                      "config": jsonable(dataclasses.asdict(dataclasses.replace(self.config, run_dir=None))),
                      "run": python_run(self.eval_env, self.policy, self.heldout, settings, rollout=False)}
            run_in_folder(run_dir, resume, config, self, None, self.config.steps, settings=settings,
                          body=lambda trainer: self.fit_in_folder(trainer, log, callback))
            return self.hist
        return self._train(log, callback)

    def fit_in_folder(self, trainer: Any, log: Callable[[int, dict[str, float]], None] | None = None,
                      callback: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """The fit in its run folder (``tokengym train sft`` and ``fit(run_dir=...)``): the training loop with the
        trainer's checkpoints and progress (the held-out accuracy from the evaluation before training on, and each
        step's loss, as on-policy runs show theirs), then the final checkpoint and ``model/``."""
        from tokengym.agents.algorithms.onpolicy import both

        shown = self._log_fn(log)

        def log_and_show(step: int, metrics: dict[str, float]) -> None:
            if step == 0:  # the evaluation before training: on the progress line until the next one
                trainer.progress.update({"step": 0, **metrics})
            shown(step, metrics)

        def show_loss(record: dict[str, Any]) -> Any:  # the trainer's progress sees the step's loss too
            return trainer.callback({**record, "loss": self.hist["loss"][-1]})

        self._train(log_and_show, callback=both(show_loss, callback))
        trainer.finish()

    def stopped_early(self) -> bool:
        """Whether the last fit ended before ``config.steps`` because held-out accuracy reached ``stop_at_accuracy``."""
        cfg, evals = self.config, self.hist["eval"]
        return (cfg.stop_at_accuracy is not None and bool(evals) and self.global_step < cfg.steps
                and evals[-1]["accuracy"] >= cfg.stop_at_accuracy)

    def _log_fn(self, log: Callable[[int, dict[str, float]], None] | None) -> Callable[[int, dict[str, float]], None]:
        """``log``, or by default a printed line per record when ``config.log_every`` is on."""
        if log is not None:
            return log
        return _print_log if self.config.log_every else (lambda step, metrics: None)

    def _train(self, log: Callable[[int, dict[str, float]], None] | None,
               callback: Callable[[dict[str, Any]], Any] | None) -> dict[str, Any]:
        cfg, model, hist = self.config, self.policy.model, self.hist
        autocast = torch.autocast(self.policy.device.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
        log = self._log_fn(log)
        self._t0 = time.perf_counter()

        def run_eval(step: int) -> dict[str, float]:
            if not self.heldout:  # eval_prompts=0: no evaluation
                return {}
            model.eval()
            res = evaluate(self.policy, self.eval_env, self.heldout, greedy=True)
            model.train()
            hist["eval"].append({"step": step, **res, "wall_s": self._wall()})
            metrics = {f"eval/{k}": v for k, v in res.items()}
            self.logger.log(step, metrics)
            log(step, metrics)
            return metrics

        def done_early() -> bool:
            return cfg.stop_at_accuracy is not None and hist["eval"][-1]["accuracy"] >= cfg.stop_at_accuracy

        if not hist["eval"]:  # a new fit: the score before training
            run_eval(0)
        model.train()
        stopped = False
        while self.global_step < cfg.steps and not done_early():
            batch = next(self._stream)  # the global batch (every rank draws it alike)
            rows, share = self.dp.shard(torch.arange(len(batch.tokens)), batch.loss_mask.sum(1))
            batch = (batch.select(rows) if self.dp.distributed else batch).to(self.policy.device)
            lr = self.optim.set_lr(self.global_step, cfg.schedule_steps)
            with autocast:
                loss, stats = sft_loss(self.policy, batch)
            self.optim.zero_grad()
            (loss * share).backward()  # share = 1 in one process
            gnorm = self.optim.step()["grad_norm"]  # summed over ranks, clipped, stepped
            stats = self.dp.weighted({"loss": stats["loss"]}, share)  # the global batch's token mean
            self.global_step = step = self.global_step + 1
            hist["step"].append(step)
            hist["loss"].append(float(stats["loss"]))
            hist["lr"].append(lr)
            record: dict[str, Any] = {"step": step}
            if cfg.log_every and step % cfg.log_every == 0:
                window = hist["loss"][-cfg.log_every :]
                metrics = {"train/loss": sum(window) / len(window), "train/lr": lr, "train/grad_norm": float(gnorm)}
                packed = packed_share(self.policy.model)  # the forwards since the last record
                if cfg.packing == "auto" and packed is not None:
                    metrics["train/packed"] = packed
                self.logger.log(step, metrics)
                log(step, metrics)
                record.update(metrics)
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                record.update(run_eval(step))
            if callback is not None and callback(record) is False:
                stopped = True
                break
        if not stopped and hist["eval"] and hist["eval"][-1]["step"] != self.global_step:
            run_eval(self.global_step)
        model.eval()
        hist["steps_done"] = self.global_step
        hist["wall_s"] = self._wall()
        self._elapsed, self._t0 = hist["wall_s"], None
        return hist


def train_sft(policy: Any, task: Any, config: SFTConfig | None = None, log: Callable[[int, dict[str, float]], None] | None = None,
              prompt_len: int | None = None) -> dict[str, Any]:
    """Fine-tune ``policy`` on ``task``'s reference solutions; return the history.

    Args:
        policy: a :class:`~tokengym.agents.Policy` (trained in place).
        task: a :class:`~tokengym.envs.tasks.Task` whose samples carry ``"solution"``.
        config: :class:`SFTConfig` (defaults if ``None``).
        log: called as ``log(step, metrics)`` at every log and eval step; by default prints when
            ``config.log_every > 0``.
        prompt_len: prompt columns ``P`` (default: the env's for this task and tokenizer).

    Returns:
        ``{"step": [...], "loss": [...], "lr": [...], "eval": [{"step", "accuracy", "mean_reward",
        "mean_length", "truncated", "wall_s"}, ...], "wall_s": float, "steps_done": int, "config": {...}}``;
        ``loss[i]`` is the mean completion cross-entropy of step ``i``'s batch (before its update).
    """
    learner = SFTLearner(policy, task, config, prompt_len)
    try:
        return learner.fit(log)
    finally:
        learner.logger.close()


def _print_log(step: int, metrics: dict[str, float]) -> None:
    print(f"step {step:6d}  " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()), flush=True)


# ====================================================================== eval
def evaluate_policy(policy: Any, task: Any, n: int = 256, num_envs: int = 256, prompt_len: int | None = None) -> dict[str, float]:
    """Held-out greedy accuracy of ``policy`` on ``n`` prompts of ``task`` (``rollout.heldout_samples``)."""
    from tokengym.envs import TokenVectorEnv

    P = int(prompt_len or task.max_prompt_chars + 2)
    env = TokenVectorEnv(min(num_envs, n), task, tokenizer=policy.tokenizer, device=policy.device, max_prompt_len=P)
    policy.model.eval()
    return evaluate(policy, env, heldout_samples(task, n), greedy=True)


register("sft", SFTConfig, "supervised fine-tuning on the task's reference solutions",
         run_fields=frozenset({"save_every", "keep_checkpoints", "sharding"}), default_model="tiny", data_parallel=True)


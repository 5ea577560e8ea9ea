"""Supervised warm start (SFT): teach a policy a task's reference solutions before RL.

Reads top to bottom: config -> data -> loss -> loop -> eval -> command line.

* **Data.** A seeded stream of task samples becomes teacher-forced batches laid out exactly like a
  :class:`~tokengym.envs.TokenVectorEnv` buffer: the prompt (with ``<bos>``) left-padded into ``P``
  columns, the completion ``solution + <eos>`` from column ``P``, right-padded. Prompts of the held-out
  evaluation set are never trained on.
* **Loss.** The mean token cross-entropy over completion tokens only, computed as
  ``-Policy.forward(tokens, mask, P)``: the very log-probabilities the RL agents use (same position ids,
  same temperature scaling, same chunked log-softmax). Prompt and padding positions carry no loss.
* **Loop.** AdamW, linear warmup then cosine (or linear / constant) decay, gradient clipping, optional
  CPU/GPU bf16 autocast, periodic held-out greedy evaluation with :func:`tokengym.agents.rollout.evaluate`.

Example:
    >>> from tokengym.agents.policy import Policy
    >>> from tokengym.envs.tasks import ArithmeticTask
    >>> policy = Policy.from_pretrained("tiny")
    >>> task = ArithmeticTask(n_operands=2, digits=1, operators="+")
    >>> cfg = SFTConfig(steps=3, batch_size=8, warmup=1, eval_every=0, eval_prompts=8, log_every=0)
    >>> hist = train_sft(policy, task, cfg)
    >>> len(hist["loss"]), 0.0 <= hist["eval"][-1]["accuracy"] <= 1.0
    (3, True)

Command line (trains, saves with ``save_pretrained`` and writes ``sft_metrics.json`` next to the weights)::

    python -m tokengym.agents.sft --model tiny --n-operands 2 3 --digits 2 --operators + \\
        --steps 800 --seed 0 --out runs/sft-tiny
    python -m tokengym.agents.sft --model runs/sft-tiny --eval-only --n-operands 2 3 --digits 2 --operators +
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from tokengym.agents.optim import LR_SCHEDULES, lr_factor as schedule_factor
from tokengym.agents.rollout import evaluate, heldout_samples
from tokengym.envs.chat import encode_prompts

__all__ = ["SFTConfig", "SFTBatch", "make_batch", "batches", "sft_loss", "lr_factor", "train_sft", "evaluate_policy", "main"]


# ====================================================================== config
@dataclass
class SFTConfig:
    """Settings of a supervised warm start (defaults suit the ``tiny`` preset on arithmetic)."""

    lr: float = 3e-3
    """Peak AdamW learning rate (reached at the end of warmup)."""
    batch_size: int = 64
    """Training sequences per optimizer step."""
    steps: int = 800
    """Optimizer steps (``tiny`` on 2-3 operand 2-digit addition: ~94% after 800, a late jump from ~10% near 400-600)."""
    warmup: int = 100
    """Steps of linear learning-rate warmup from 0 to ``lr``."""
    schedule: str = "cosine"
    """Decay after warmup: ``"cosine"``, ``"linear"`` (both down to ``min_lr_ratio * lr``) or ``"constant"``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (cosine and linear schedules)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to matrices only (not to norms or biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW ``(beta1, beta2)``."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; ``None`` turns clipping off."""
    seed: int = 0
    """Seeds the training data stream (the model's initialisation is seeded where it is built)."""
    bf16: bool = False
    """Run forward and backward under bf16 autocast (weights and optimizer stay float32)."""
    eval_every: int = 100
    """Evaluate held-out greedy accuracy every this many steps (0: only before and after training)."""
    eval_prompts: int = 256
    """Number of held-out prompts (``rollout.heldout_samples``) used for evaluation."""
    eval_batch: int = 256
    """Parallel episodes of the evaluation env (``num_envs``)."""
    exclude_heldout: bool = True
    """Never train on a prompt that is in the held-out evaluation set."""
    stop_at_accuracy: float | None = None
    """Stop early once a held-out evaluation reaches this accuracy (``None``: always run all steps)."""
    log_every: int = 50
    """Record/print the training loss every this many steps (0: never print; loss is still recorded)."""
    run_dir: str | None = None
    """If set, write ``metrics.jsonl`` and TensorBoard events there."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SFTConfig.{name} {why}, got {getattr(self, name)!r}")

        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            bad("lr", "must be a finite number > 0")
        for name in ("batch_size", "steps", "eval_prompts", "eval_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "steps" else 1):
                bad(name, "must be an int >= " + ("0" if name == "steps" else "1"))
        for name in ("warmup", "eval_every", "log_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(name, "must be an int >= 0")
        if self.schedule not in LR_SCHEDULES:
            bad("schedule", f"must be one of {sorted(LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", "must be in [0, 1]")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")
        if self.grad_clip is not None and not self.grad_clip > 0:
            bad("grad_clip", "must be > 0 or None")
        if self.stop_at_accuracy is not None and not 0.0 < self.stop_at_accuracy <= 1.0:
            bad("stop_at_accuracy", "must be in (0, 1] or None")

    @property
    def decay_steps(self) -> int:
        """Steps after warmup over which the learning rate decays."""
        return max(self.steps - self.warmup, 1)

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
            exclude: set[str] | None = None) -> Iterator[SFTBatch]:
    """An endless, seeded stream of batches from ``task.batch`` (prompts in ``exclude`` are skipped)."""
    rng = np.random.default_rng(seed)
    exclude = exclude or set()
    while True:
        out: list[dict[str, Any]] = []
        tries = 0
        while len(out) < batch_size:
            out += [s for s in task.batch(rng, batch_size - len(out)) if s["prompt"] not in exclude]
            tries += 1
            if tries > 1000:
                raise RuntimeError("could not draw training prompts outside the held-out set: the task's prompt space is too small")
        yield make_batch(out, tokenizer, prompt_len)


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
    """Learning-rate multiplier at optimizer step ``step`` (0-based): warmup, then ``cfg.schedule``."""
    return schedule_factor(step, cfg.warmup + cfg.decay_steps, cfg.schedule, cfg.warmup, cfg.min_lr_ratio)




def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


# ====================================================================== loop
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
    from tokengym.envs import TokenVectorEnv

    cfg = config or SFTConfig()
    model, tok, device = policy.model, policy.tokenizer, policy.device
    heldout = heldout_samples(task, cfg.eval_prompts)
    eval_env = TokenVectorEnv(min(cfg.eval_batch, cfg.eval_prompts), task, tokenizer=tok, device=device, max_prompt_len=prompt_len)
    P = eval_env.max_prompt_len  # the env's default room for the task's prompts (chat templates included)
    stream = batches(task, tok, cfg.batch_size, P, cfg.seed, {s["prompt"] for s in heldout} if cfg.exclude_heldout else None)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    sink = _MetricSink(cfg.run_dir, dataclasses.asdict(cfg))
    if log is None:
        log = _print_log if cfg.log_every else (lambda step, metrics: None)

    hist: dict[str, Any] = {"step": [], "loss": [], "lr": [], "eval": [], "config": dataclasses.asdict(cfg)}
    t0 = time.perf_counter()

    def run_eval(step: int) -> float:
        model.eval()
        res = evaluate(policy, eval_env, heldout, greedy=True)
        model.train()
        res = {**res, "wall_s": time.perf_counter() - t0}
        hist["eval"].append({"step": step, **res})
        sink.write(step, {f"eval/{k}": v for k, v in res.items()})
        log(step, {f"eval/{k}": v for k, v in res.items()})
        return res["accuracy"]

    def done_early(acc: float) -> bool:
        return cfg.stop_at_accuracy is not None and acc >= cfg.stop_at_accuracy

    acc = run_eval(0)
    model.train()
    step = 0
    while step < cfg.steps and not done_early(acc):
        batch = next(stream).to(device)
        with autocast:
            loss, stats = sft_loss(policy, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip is not None else float("inf"))
        opt.step()
        lr = opt.param_groups[0]["lr"]
        sched.step()
        step += 1
        hist["step"].append(step)
        hist["loss"].append(float(stats["loss"]))
        hist["lr"].append(lr)
        if cfg.log_every and step % cfg.log_every == 0:
            window = hist["loss"][-cfg.log_every :]
            metrics = {"train/loss": sum(window) / len(window), "train/lr": lr, "train/grad_norm": float(gnorm),
                       "train/wall_s": time.perf_counter() - t0}
            sink.write(step, metrics)
            log(step, metrics)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            acc = run_eval(step)
    if not hist["eval"] or hist["eval"][-1]["step"] != step:
        run_eval(step)
    model.eval()
    sink.close()
    hist["steps_done"] = step
    hist["wall_s"] = time.perf_counter() - t0
    return hist


def _print_log(step: int, metrics: dict[str, float]) -> None:
    print(f"step {step:6d}  " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()), flush=True)


class _MetricSink:
    """``metrics.jsonl`` + TensorBoard under ``run_dir`` (a no-op without one)."""

    def __init__(self, run_dir: str | None, config: dict[str, Any]):
        self.jsonl = self.tb = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(run_dir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


# ====================================================================== eval
def evaluate_policy(policy: Any, task: Any, n: int = 256, num_envs: int = 256, prompt_len: int | None = None) -> dict[str, float]:
    """Held-out greedy accuracy of ``policy`` on ``n`` prompts of ``task`` (``rollout.heldout_samples``)."""
    from tokengym.envs import TokenVectorEnv

    P = int(prompt_len or task.max_prompt_chars + 2)
    env = TokenVectorEnv(min(num_envs, n), task, tokenizer=policy.tokenizer, device=policy.device, max_prompt_len=P)
    policy.model.eval()
    return evaluate(policy, env, heldout_samples(task, n), greedy=True)


# ====================================================================== command line
def _parser() -> argparse.ArgumentParser:
    d = SFTConfig()
    p = argparse.ArgumentParser(prog="python -m tokengym.agents.sft", description="Supervised warm start on a task's reference solutions.")
    p.add_argument("--model", "--preset", dest="model", default="tiny", help="preset name (tiny, small) or a local save_pretrained folder")
    p.add_argument("--task", default="arithmetic", help="task name (its samples need a 'solution')")
    p.add_argument("--n-operands", type=int, nargs="+", default=[2, 3], help="arithmetic: operand count or MIN MAX")
    p.add_argument("--digits", type=int, nargs="+", default=[2], help="arithmetic: digits per operand or MIN MAX")
    p.add_argument("--operators", default="+", help="arithmetic: operators to draw from")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--schedule", default=d.schedule, choices=sorted(LR_SCHEDULES))
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global gradient-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=d.seed, help="data-stream seed")
    p.add_argument("--init-seed", type=int, default=0, help="initialisation seed of a preset model")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--stop-at-accuracy", type=float, default=None)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--run-dir", default=None, help="write metrics.jsonl and TensorBoard events here")
    p.add_argument("--out", default=None, help="save the trained policy (safetensors + tokenizer) and sft_metrics.json here")
    p.add_argument("--eval-only", action="store_true", help="only report held-out greedy accuracy of --model")
    return p


def _task_from_args(a: argparse.Namespace) -> Any:
    from tokengym.envs.vector_env import resolve_task

    if a.task != "arithmetic":
        return resolve_task(a.task)

    def rng(v: list[int]) -> int | tuple[int, int]:
        if len(v) not in (1, 2):
            raise SystemExit("--n-operands/--digits take one value or MIN MAX")
        return v[0] if len(v) == 1 else (v[0], v[1])

    return resolve_task("arithmetic", n_operands=rng(a.n_operands), digits=rng(a.digits), operators=a.operators)


def main(argv: Sequence[str] | None = None) -> int:
    from tokengym.agents.models import build_preset, PRESETS
    from tokengym.agents.policy import Policy

    a = _parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    task = _task_from_args(a)
    if a.model in PRESETS:
        model, tok = build_preset(a.model, seed=a.init_seed)
        policy = Policy(model.to(a.device), tok)
    else:
        policy = Policy.from_pretrained(a.model, device=a.device)
    if a.eval_only:
        t0 = time.perf_counter()
        res = evaluate_policy(policy, task, a.eval_prompts)
        print(json.dumps({"model": a.model, "task": repr(task), "eval_prompts": a.eval_prompts, **res,
                          "wall_s": round(time.perf_counter() - t0, 2)}, indent=2))
        return 0
    cfg = SFTConfig(lr=a.lr, batch_size=a.batch_size, steps=a.steps, warmup=a.warmup, schedule=a.schedule,
                    min_lr_ratio=a.min_lr_ratio, weight_decay=a.weight_decay, grad_clip=a.grad_clip or None, seed=a.seed,
                    bf16=a.bf16, eval_every=a.eval_every, eval_prompts=a.eval_prompts,
                    stop_at_accuracy=a.stop_at_accuracy, log_every=a.log_every, run_dir=a.run_dir)
    hist = train_sft(policy, task, cfg)
    final = hist["eval"][-1]
    print(f"done: {hist['steps_done']} steps in {hist['wall_s']:.1f}s, held-out greedy accuracy {final['accuracy']:.3f}", flush=True)
    if a.out:
        policy.save_pretrained(a.out)
        meta = {"command": "python -m tokengym.agents.sft " + " ".join(sys.argv[1:] if argv is None else argv),
                "task": repr(task), "model": a.model, "init_seed": a.init_seed, "torch": torch.__version__,
                "threads": a.threads, **{k: hist[k] for k in ("steps_done", "wall_s", "eval", "config")},
                "loss_every_50": hist["loss"][49::50]}
        with open(os.path.join(a.out, "sft_metrics.json"), "w") as f:
            json.dump(meta, f, indent=2)
        print(f"saved to {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

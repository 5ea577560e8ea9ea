"""DPO (Rafailov et al. 2023) and its IPO / hinge (SLiC) / robust variants: an offline preference learner.

Here: the config and the learner (optimiser, checkpoint state, loss, evaluation). Beside it: the sequence log-probs
(one concatenated forward of chosen + rejected per batch, :mod:`~tokengym.agents.algorithms.dpo_logps`), the reference
side (live frozen model, or log-probs precomputed once over the dataset; the batch layout,
:mod:`~tokengym.agents.algorithms.dpo_reference`) and ``fit`` (epochs of shuffled minibatches, log, evaluate; its run
folder, :mod:`~tokengym.agents.algorithms.dpo_fit`). Online pairs, made from the policy's own samples round after
round, live in :mod:`tokengym.agents.algorithms.online_dpo`.

The loss math is :func:`tokengym.agents.functional.dpo_loss`; this file only feeds it:

* **Sequence log-probs** are sums of the policy's per-token log-probs (:meth:`Policy.forward`) over
  completion tokens only: prompt and padding columns are masked out. A batch of ``B`` pairs is one
  ``[2B, P + M]`` stack (chosen rows, then rejected rows), so each step costs one policy forward (and,
  with a live reference, one reference forward under ``torch.no_grad``). Shared-prefix packing (the
  default wherever the model honours 4D attention masks, see ``DPOConfig.share_prefix``) gets the same
  numbers from fewer tokens: each pair stored once as ``[prompt | chosen | rejected after the common
  prefix]``, several pairs per row, with a 4D attention mask (:func:`shared_prefix_logps`).
* **IPO** uses log-probs averaged over each completion's length (as TRL does and the IPO authors
  confirmed); the other losses use sums.
* **Reference log-probs** come from a frozen reference model (default:
  :func:`~tokengym.agents.engine.policy.make_reference`: a frozen copy of the policy at construction, or, for
  a LoRA (``peft``) policy, the same model with its adapter disabled: no second copy of the weights),
  or, with ``precompute_ref=True``, are computed once per dataset before training and cached, so that
  no reference model is kept in memory.
* **Exact resume**: :meth:`DPOLearner.checkpoint_modules` / ``state_dict`` / ``load_state_dict``; a
  ``fit`` stopped by its callback and restored continues at the saved data position (same batches,
  learning rates and logged metrics as one uninterrupted ``fit``); the round loops of
  :mod:`~tokengym.agents.algorithms.online_dpo` resume at round boundaries.
* **Near-identical pairs.** When chosen and rejected differ in a token or two (arithmetic: one digit),
  plain DPO tends to lower the chosen completion's likelihood too and move probability onto other
  tokens ("likelihood displacement"). ``dpop_lambda`` (DPO-Positive, Pal et al. 2024) penalises a
  chosen log-prob below the reference's; ``nll_coef`` adds an NLL term on the chosen completion (RPO,
  Pang et al. 2024). On arithmetic pairs, plain DPO gains greedy accuracy only at a smaller learning
  rate, or with ``dpop_lambda``; with the model's own wrong answers as rejected completions it needs a
  smaller one still (measurements: ``bench/RESULTS.md``, ``tests/agents/algorithms/test_dpo_learner.py``).

Example:
    >>> from tokengym.agents.engine.policy import Policy
    >>> from tokengym.agents.data.pairs import arithmetic_pairs
    >>> from tokengym.envs.tasks import ArithmeticTask
    >>> pairs = arithmetic_pairs(ArithmeticTask(n_operands=2, digits=1, operators="+"), 16)
    >>> learner = DPOLearner(Policy.from_pretrained("tiny"), DPOConfig(batch_size=8, epochs=1))
    >>> history = learner.fit(pairs)
    >>> len(history), sorted(k for k in history[0] if k.startswith("rewards/"))
    (2, ['rewards/accuracies', 'rewards/chosen', 'rewards/margins', 'rewards/rejected'])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch

from tokengym.agents import functional as F
from tokengym.agents.runtime.logger import RunLogger
from tokengym.agents.runtime.config import check_learner_args
from tokengym.agents.runtime.distributed import LOCAL
from tokengym.agents.runtime.optim import OptimizerStep, ScheduledOptimConfig, TrainLoopConfig
from tokengym.agents.data.pairs import PairBatch, PairData, SharedPrefixBatch
from tokengym.agents.engine.rollout import evaluate
from tokengym.agents.algorithms.dpo_fit import DPOFit
from tokengym.agents.algorithms.dpo_logps import shared_prefix_logps  # noqa: F401 (its home before the split)
from tokengym.agents.algorithms.dpo_reference import DPOReference
from tokengym.agents.algorithms.registry import register
from tokengym.rewards.common import Renamed, check_rows_fit
from tokengym.rewards.packing import set_packing

__all__ = ["DPOConfig", "DPOLearner"]


@dataclass
class DPOConfig(TrainLoopConfig, ScheduledOptimConfig, Renamed, renames={"schedule": "lr_scheduler_type"}):
    """Hyper-parameters of :class:`DPOLearner` (defaults: a quick, stable run on the tiny preset): the optimiser's and
    the training loop's (:mod:`tokengym.rewards.training`), and DPO's below."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * log(pi / pi_ref); for IPO the regulariser tau."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, hinge (SLiC) or robust (see functional.dpo_loss)."""
    label_smoothing: float = 0.0
    """Assumed label-flip rate in [0, 0.5): conservative DPO for sigmoid, robust DPO for robust; 0 for ipo/hinge."""
    nll_coef: float = 0.0
    """Weight of an extra NLL term on chosen completions (per-token mean; "RPO", Pang et al. 2024); 0 = plain DPO."""
    dpop_lambda: float = 0.0
    """DPO-Positive (Pal et al. 2024): margin minus lambda * max(0, ref - policy chosen log-prob); 0 = plain DPO."""
    batch_size: int = 16
    """Preference pairs per optimiser step (2 * batch_size sequences per forward)."""
    epochs: int = 1
    """Passes over the pairs per fit() call (ignored when steps is set)."""
    steps: int | None = None
    """Optimiser steps per fit() call, cycling through reshuffled epochs; None = epochs full passes."""
    shuffle: bool = True
    """Reshuffle the pairs every epoch (seeded by seed)."""
    share_prefix: bool | None = None
    """Pack pairs as [prompt | chosen | rejected after the common prefix] with a 4D mask (same log-probs, fewer tokens); None = on iff a one-time check on a few synthetic pairs finds the model (and reference) give the plain stack's log-probs that way."""
    precompute_ref: bool = False
    """Compute reference log-probs once per dataset before training and keep no reference model in memory."""
    ref_batch_size: int | None = None
    """Pairs per reference forward when precomputing; None = 4 * batch_size."""
    max_prompt_len: int | None = None
    """Keep only the last this-many prompt tokens when tokenizing text pairs (None = no limit)."""
    max_length: int | None = None
    """Cap prompt + completion tokens when tokenizing text pairs; completions keep their start (None = no limit)."""
    chat_template: bool = False
    """Render text pairs with the tokenizer's chat template (needs a tokenizer that has one)."""
    eval_batch_size: int | None = None
    """Pairs per forward when evaluating; None = 4 * batch_size."""
    log_every: int = 1
    """Write a training record every this many steps (metrics averaged over them)."""

    def __post_init__(self) -> None:
        self.check_fields()  # the shared fields' checks (rewards.training) and checks()/choices() below
        z = torch.zeros(1)
        try:  # beta / label_smoothing / loss_type compatibility: the loss function's own checks
            F.dpo_loss(z, z, z, z, self.beta, self.loss_type, self.label_smoothing)
        except (ValueError, TypeError) as e:
            raise ValueError(f"DPOConfig: {e}") from None
        if self.max_length is not None and self.max_prompt_len is not None and self.max_prompt_len >= self.max_length:
            raise ValueError(f"DPOConfig.max_prompt_len={self.max_prompt_len} leaves no room for completions in max_length={self.max_length}")

    def checks(self) -> dict[str, bool]:
        return {"batch_size": self.batch_size >= 1, "epochs": self.epochs >= 1,
                "steps": self.steps is None or self.steps >= 0, "nll_coef": self.nll_coef >= 0,
                "dpop_lambda": self.dpop_lambda >= 0, "log_every": self.log_every >= 1,
                "ref_batch_size": self.ref_batch_size is None or self.ref_batch_size >= 1,
                "eval_batch_size": self.eval_batch_size is None or self.eval_batch_size >= 1,
                "max_prompt_len": self.max_prompt_len is None or self.max_prompt_len >= 1,
                "max_length": self.max_length is None or self.max_length >= 2}

    def choices(self) -> dict[str, Iterable[Any]]:
        return {"loss_type": F.DPO_LOSSES}

    @property
    def length_normalized(self) -> bool:
        """Whether sequence log-probs are averaged over completion length (IPO) instead of summed."""
        return self.loss_type == "ipo"


class DPOLearner(DPOFit, DPOReference):
    """Offline preference optimisation of a :class:`~tokengym.agents.Policy` on (prompt, chosen, rejected) pairs.

    Args:
        policy: the policy to train (in place).
        config: :class:`DPOConfig`.
        ref: the reference: a ``Policy``, a causal LM (used frozen, never trained) or an
            :class:`~tokengym.agents.engine.policy.AdapterDisabledReference`. ``None``:
            :func:`~tokengym.agents.engine.policy.make_reference` of ``policy`` as it is now (a frozen copy; a
            LoRA policy's reference is the same model with its adapter disabled); with
            ``config.precompute_ref`` nothing is kept and the reference log-probs come from the policy
            itself at the start of each ``fit`` (before any update of that call), which for the first
            call is the same initial policy.
        run_dir: where to write TensorBoard events and ``metrics.jsonl`` (None = memory only); a whole run
            folder (config, checkpoints, ``model/``) comes from ``fit(..., run_dir=...)`` instead.

    Logged (every ``log_every`` steps, averaged): ``train/loss``, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``, ``train/grad_norm``, ``train/lr``, ``perf/tokens_per_s``, ``perf/pairs_per_s``,
    ``epoch``; ``train/nll`` when ``nll_coef > 0``. Held-out pairs add the same names under ``eval/``.
    """

    def __init__(self, policy: Any, config: DPOConfig | None = None, ref: Any = None, run_dir: str | None = None):
        check_learner_args(type(self).__name__, policy, config, DPOConfig)
        self.policy = policy
        self.config = cfg = config or DPOConfig()
        set_packing(cfg.packing, policy)  # the reference's forwards pack as the policy's do
        self.logger = RunLogger(run_dir)
        self.optim = OptimizerStep.adamw(policy.parameters(), cfg.lr, cfg.weight_decay, schedule=cfg.lr_scheduler_type,
                                         warmup=cfg.warmup_steps, max_grad_norm=cfg.max_grad_norm,
                                         sync=lambda params: self.dp.sync_gradients(params))
        self.ref = self._initial_reference(ref)  # None with precompute_ref (see DPOReference)
        self.global_step = 0
        self.epoch = 0
        self._shuffle = torch.Generator().manual_seed(cfg.seed)
        self.dp = LOCAL  # data parallel: set by distributed.prepare under torchrun
        self._share_prefix = cfg.share_prefix  # None until resolved (see share_prefix)
        self._fit: dict[str, Any] | None = None  # the latest fit's position (what state_dict saves)
        self._resume_fit: dict[str, Any] | None = None  # set by load_state_dict: the next fit continues it
        self._round = 0  # rounds done by the latest online_dpo round loop
        self._resume_round: int | None = None

    # ------------------------------------------------------------------ checkpoint state
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """Modules whose weights a checkpoint holds: the policy, and the reference when it is a model of its own.

        A LoRA policy's adapter-disabled reference and a precomputed reference have no weights of their own.
        """
        mods = {"policy": self.policy.model}
        if isinstance(self.ref, torch.nn.Module):
            mods["ref"] = self.ref.model
        return mods

    def state_dict(self) -> dict[str, Any]:
        """Everything but module weights needed to continue exactly (tensors, numbers, strings, containers only).

        Step and epoch counters, the optimiser, the shuffle and policy generators, the latest ``fit``'s
        position (its steps, the current epoch's permutation and batch, the log window, precomputed
        reference log-probs) and the round of an :mod:`~tokengym.agents.algorithms.online_dpo` loop.
        """
        fit = None
        if self._fit is not None:
            fit = {**self._fit, "window": dict(self._fit["window"])}
        return {"global_step": self.global_step, "epoch": self.epoch, **self.optim.state_dict(),
                "shuffle_rng": self._shuffle.get_state(), "policy_rng": self.policy.generator.get_state(),
                "fit": fit, "round": self._round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next ``fit`` on the same pairs runs the rest of the interrupted one
        (nothing if it had finished), and the next online_dpo round loop the remaining rounds."""
        self.global_step, self.epoch = int(state["global_step"]), int(state["epoch"])
        self.optim.load_state_dict(state)
        self._shuffle.set_state(state["shuffle_rng"])
        self.policy.generator.set_state(state["policy_rng"])
        self._fit = self._resume_fit = state["fit"]
        self._round = int(state["round"])
        self._resume_round = self._round

    # ------------------------------------------------------------------ data
    def prepare(self, pairs: Any) -> PairData:
        """Tokenized pairs (text pairs are tokenized with the policy's tokenizer and the config's limits)."""
        cfg = self.config
        data = PairData.from_pairs(pairs, self.policy.tokenizer, chat_template=cfg.chat_template,
                                   max_prompt_len=cfg.max_prompt_len, max_length=cfg.max_length)
        if len(data) == 0:
            raise ValueError("no preference pairs to train or evaluate on (e.g. every mined group had the same reward)")
        lengths = data.row_lengths().tolist()

        def name(i: int) -> str:
            prompt = data.records[i].get("prompt") if i < len(data.records) else None
            return f"the longest pair{f' (prompt {prompt[:24]!r}...)' if isinstance(prompt, str) else ''}, prompt + " \
                   "its longer completion,"

        check_rows_fit(self.policy.model, lengths, name, "set max_length (--max-length) to at most that (it cuts the "
                       "completions' ends) and, for long prompts, max_prompt_len (--max-prompt-len, which keeps a prompt's "
                       "last tokens) below it; train/truncated logs the fraction of pairs cut"
                       + (f" (max_length={cfg.max_length} now)" if cfg.max_length else ""))
        return data

    # ------------------------------------------------------------------ loss
    def _loss(self, batch: PairBatch | SharedPrefixBatch, ref_seq: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DPO loss of one batch and its detached statistics."""
        cfg = self.config
        seq = self.sequence_logps(self.policy, batch)  # [2B] sums
        lens = batch.completion_lens.to(seq.dtype)
        pc, pr = seq.chunk(2)
        if cfg.length_normalized:
            pol, ref = seq / lens, ref_seq.to(seq.dtype) / lens
        else:
            pol, ref = seq, ref_seq.to(seq.dtype)
        (p_c, p_r), (r_c, r_r) = pol.chunk(2), ref.chunk(2)
        if cfg.dpop_lambda > 0:  # DPO-Positive: the penalty enters the margin through the chosen log-prob
            penalty = (r_c - p_c).clamp(min=0.0)
            losses = F.dpo_loss(p_c - cfg.dpop_lambda * penalty, p_r, r_c, r_r, cfg.beta, cfg.loss_type, cfg.label_smoothing)[0]
            ch, rj = cfg.beta * (p_c - r_c).detach(), cfg.beta * (p_r - r_r).detach()
        else:
            losses, ch, rj = F.dpo_loss(p_c, p_r, r_c, r_r, cfg.beta, cfg.loss_type, cfg.label_smoothing)
        loss = losses.mean()
        stats = {
            "loss": loss.detach(),
            "rewards/chosen": ch.mean(), "rewards/rejected": rj.mean(),
            "rewards/accuracies": (ch > rj).float().mean(), "rewards/margins": (ch - rj).mean(),
            "logps/chosen": pc.detach().mean(), "logps/rejected": pr.detach().mean(),
        }
        if cfg.nll_coef > 0:
            nll = -(pc / lens[: len(pc)]).mean()
            loss = loss + cfg.nll_coef * nll
            stats["nll"] = nll.detach()
        return loss, stats

    # ------------------------------------------------------------------ evaluation
    def _evaluate_all(self, eval_data, eval_ref, eval_env, eval_samples) -> dict[str, float]:
        """The held-out metrics ``fit`` logs: pair metrics of ``eval_data``, greedy ones of ``eval_env``."""
        out: dict[str, float] = {}
        if eval_data is not None:
            out.update(self.evaluate_pairs(eval_data, eval_ref))
        if eval_env is not None and eval_samples:
            self.policy.eval()
            out.update({f"eval/{k}": v for k, v in evaluate(self.policy, eval_env, eval_samples, greedy=True).items()})
        return out

    @torch.no_grad()
    def evaluate_pairs(self, pairs: Any, ref_logps: torch.Tensor | None = None) -> dict[str, float]:
        """Held-out pair metrics (``eval/loss``, ``eval/rewards/accuracies``, margins, log-probs), pair-weighted.

        ``ref_logps`` (``[2, N]``, from :meth:`reference_logps`) is needed when the learner keeps no
        reference model; otherwise the reference model scores the pairs.
        """
        data = self.prepare(pairs)
        if ref_logps is None and self.ref is None:
            raise ValueError("this learner keeps no reference model (precompute_ref=True): pass ref_logps=learner.reference_logps(pairs) "
                             "computed before training")
        was_training = self.policy.training
        self.policy.eval()
        sums: dict[str, float] = {}
        bs = self.config.eval_batch_size or 4 * self.config.batch_size
        for idx in torch.arange(len(data)).split(bs):
            batch = self._batch(data, idx)
            _, stats = self._loss(batch, self._ref_batch(batch, ref_logps))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(idx)
        self.policy.train(was_training)
        return {f"eval/{k}": v / len(data) for k, v in sums.items()}

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)


register("dpo", DPOConfig, "DPO and its IPO/hinge/robust variants on preference pairs",
         run_fields=frozenset({"temperature", "pairs", "num_pairs", "save_every", "keep_checkpoints", "sharding"}), data_parallel=True)

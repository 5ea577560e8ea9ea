"""DPO (Rafailov et al. 2023) and its IPO / hinge (SLiC) / robust variants: an offline preference learner.

Reads top to bottom: config -> learner (reference model, optimiser) -> sequence log-probs (one
concatenated forward of chosen + rejected per batch) -> reference log-probs (live frozen model, or
precomputed once over the dataset) -> ``fit`` (epochs of shuffled minibatches, log, evaluate). Online
pairs, made from the policy's own samples round after round, live in :mod:`tokengym.agents.algorithms.online_dpo`.

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
  smaller one still (measurements: ``bench/RESULTS.md``, ``tests/agents/test_dpo_learner.py``).

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

import contextlib
import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from tokengym.agents import functional as F
from tokengym.agents.runtime.logger import RunLogger
from tokengym.agents.runtime.config import check_learner_args
from tokengym.agents.runtime.distributed import LOCAL
from tokengym.agents.engine.models import frozen_copy
from tokengym.agents.runtime.optim import OptimizerStep, ScheduledOptimConfig, TrainLoopConfig
from tokengym.agents.engine.policy import AdapterDisabledReference, make_reference
from tokengym.agents.data.pairs import PairBatch, PairData, SharedPrefixBatch
from tokengym.agents.engine.rollout import evaluate
from tokengym.agents.algorithms.registry import register
from tokengym.rewards.common import Renamed

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




def _wrap_policy(model: Any, like: Any) -> Any:
    """A frozen ``Policy`` around ``model`` with ``like``'s tokenizer and temperature (``model`` may already be one)."""
    if not (hasattr(model, "prefill") and hasattr(model, "model")):
        model = type(like)(model, like.tokenizer, temperature=like.temperature, fast_decode=False, packing=getattr(like, "packing", "off"))
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _frozen(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode without autograd, its training mode restored on exit."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


def _fingerprint(data: PairData) -> str:
    """A digest of the tokenized pairs: a resumed ``fit`` checks it is given the pairs it was interrupted on."""
    h = hashlib.blake2b(digest_size=16)
    extra = () if data.completion_agent is None else (data.agent_mask,)  # multi-turn pairs: which tokens are scored
    for t in (data.prompts, data.prompt_mask, data.completions, data.completion_lens, *extra):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


class DPOLearner:
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
        policy.packing = cfg.packing  # the reference's forwards pack as the policy's do
        self.logger = RunLogger(run_dir)
        self.optim = OptimizerStep.adamw(policy.parameters(), cfg.lr, cfg.weight_decay, schedule=cfg.lr_scheduler_type,
                                         warmup=cfg.warmup_steps, max_grad_norm=cfg.max_grad_norm,
                                         sync=lambda params: self.dp.sync_gradients(params))
        if isinstance(ref, AdapterDisabledReference):
            self.ref = ref
        elif ref is not None:
            self.ref = _wrap_policy(ref, policy)
        elif cfg.precompute_ref:
            self.ref = None  # reference log-probs come from the policy before each fit's first update
        else:
            self.ref = make_reference(policy)
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
        return data

    @property
    def share_prefix(self) -> bool:
        """Whether batches are prefix-shared and packed: ``config.share_prefix``, or when that is ``None``
        the result of a one-time check (:meth:`_packing_matches`, run on first use)."""
        if self._share_prefix is None:
            self._share_prefix = self._packing_matches()
        return self._share_prefix

    def _packing_matches(self) -> bool:
        """Whether the packed path gives the plain stack's log-probs here: three synthetic pairs (left padding,
        a shared prefix, none, a rejected completion extending the chosen one) scored both ways by the
        policy and by a reference model of its own. A model that rejects or ignores the 4D mask fails."""
        g = torch.Generator().manual_seed(0)
        vocab = self.policy.model.get_input_embeddings().num_embeddings

        def ids(n: int) -> list[int]:
            return torch.randint(vocab, (n,), generator=g).tolist()

        common = ids(3)
        chosen = [common + ids(4), ids(5), common]
        data = PairData.from_token_ids([ids(3), ids(6), ids(4)], chosen, [common + ids(2), ids(3), common + ids(3)],
                                       pad_id=int(self.policy.tokenizer.pad_token_id or 0))
        idx = torch.arange(len(data))
        scorers = [(self.policy, _frozen(self.policy))]
        if isinstance(self.ref, torch.nn.Module):
            scorers.append((self.ref, torch.no_grad()))
        for model, ctx in scorers:
            try:
                with ctx:
                    plain = self.sequence_logps(model, data.batch(idx, self.policy.device)).float()
                    packed = self.sequence_logps(model, data.shared_batch(idx, self.policy.device)).float()
            except (TypeError, ValueError, RuntimeError, NotImplementedError):
                return False
            tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 3e-2  # per scored token
            lens = data.completion_lens.reshape(-1).to(plain.device)
            if not bool(((plain - packed).abs() <= tol * (lens + 1)).all()):
                return False
        return True

    # ------------------------------------------------------------------ log-probs
    def _batch(self, data: PairData, idx: torch.Tensor) -> PairBatch | SharedPrefixBatch:
        if self.share_prefix:
            return data.shared_batch(idx, self.policy.device)
        return data.batch(idx, self.policy.device)

    @staticmethod
    def sequence_logps(policy: Any, batch: PairBatch | SharedPrefixBatch) -> torch.Tensor:
        """Summed completion log-probs ``[2B]`` of a batch (chosen first, then rejected): one forward pass.

        ``policy(tokens, mask, P)`` gives per-token log-probs of ``tokens[:, P:]``; prompt columns are
        not part of it and padding columns are masked out of the sum. A :class:`SharedPrefixBatch` gets
        the same numbers from its packed rows (see :func:`shared_prefix_logps`).
        """
        if isinstance(batch, SharedPrefixBatch):
            return shared_prefix_logps(policy, batch)
        logp = policy(batch.tokens, batch.mask, batch.prompt_len)
        return logp.masked_fill(~batch.completion_mask, 0.0).sum(1)

    def _reference(self) -> tuple[Any, contextlib.AbstractContextManager]:
        """The policy that scores reference log-probs and the context to score in (no autograd, no dropout)."""
        if self.ref is None:  # precompute_ref: the policy itself, before the fit's first update
            return self.policy, _frozen(self.policy)
        if isinstance(self.ref, AdapterDisabledReference):
            return self.ref.policy, self.ref.disabled()
        return self.ref, torch.no_grad()  # a frozen Policy

    def reference_logps(self, data: PairData, batch_size: int | None = None) -> torch.Tensor:
        """Reference log-probs ``[2, N]`` (summed over completion tokens; ``[0]`` chosen, ``[1]`` rejected) of every pair.

        Uses the reference model, or the policy itself when the learner keeps none (``precompute_ref``).
        """
        bs = batch_size or self.config.ref_batch_size or 4 * self.config.batch_size
        out = torch.empty(2, len(data), dtype=torch.float32)
        self.share_prefix  # resolve the packing check outside the reference's context
        model, ctx = self._reference()
        with ctx:
            for idx in torch.arange(len(data)).split(bs):
                out[:, idx] = self.sequence_logps(model, self._batch(data, idx)).float().cpu().view(2, -1)
        return out

    def _ref_batch(self, batch: PairBatch | SharedPrefixBatch, cached: torch.Tensor | None) -> torch.Tensor:
        if cached is not None:
            return cached[:, batch.index].reshape(-1).to(self.policy.device)
        model, ctx = self._reference()
        with ctx:
            return self.sequence_logps(model, batch)

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

    # ------------------------------------------------------------------ loop
    def _start_fit(self, data: PairData, eval_data: PairData | None) -> dict[str, Any]:
        """The position of a new fit over ``data``, or of the interrupted one that ``load_state_dict`` restored."""
        cfg = self.config
        resume, self._resume_fit = self._resume_fit, None
        per_epoch = math.ceil(len(data) / cfg.batch_size)
        total = self.fit_steps(data)
        digest = _fingerprint(data)
        if resume is not None and resume["pairs"] == digest:
            if resume["total"] != total:
                raise ValueError(f"the restored fit ran {resume['total']} steps but this config gives {total}: "
                                 "resume with the config it was saved with")
            return resume
        if resume is not None and resume["step"] < resume["total"]:
            raise ValueError(f"fit() was interrupted after {resume['step']} of {resume['total']} steps on other pairs "
                             f"({resume['n']} pairs, got {len(data)}): pass the same pairs to resume it")
        precompute = self.ref is None or cfg.precompute_ref
        return {
            "pairs": digest, "n": len(data), "step": 0, "total": total, "pos": per_epoch, "order": None,
            "window": {}, "count": 0,
            "ref_cache": self.reference_logps(data) if precompute else None,
            "eval_ref": self.reference_logps(eval_data, cfg.eval_batch_size) if precompute and eval_data is not None else None,
        }

    def fit_steps(self, data: PairData) -> int:
        """Optimiser steps of one fit over ``data``: ``config.steps``, else ``epochs`` passes of ``batch_size`` pairs."""
        cfg = self.config
        return cfg.steps if cfg.steps is not None else cfg.epochs * math.ceil(len(data) / cfg.batch_size)

    def fit(
        self,
        pairs: Any,
        eval_pairs: Any = None,
        eval_env: Any = None,
        eval_samples: list | None = None,
        callback: Callable[[dict[str, float]], Any] | None = None,
        *,
        run_dir: str | None = None,
        resume: bool = False,
        save_every: int = 10,
    ) -> list[dict[str, float]]:
        """Train on ``pairs``; return the records logged during this call.

        After :meth:`load_state_dict` of a state saved during a ``fit`` on the same pairs, this call runs
        only that fit's remaining steps (the same batches, learning rates and records as one
        uninterrupted call; pass the same ``eval_*`` arguments too).

        Args:
            pairs: a :class:`PairData`, or text pairs / a JSONL path / a ``datasets.Dataset``
                (see :func:`tokengym.agents.data.pairs.load_pairs`).
            eval_pairs: held-out pairs; their preference accuracy, margins and loss are logged under
                ``eval/`` every ``eval_every`` steps and after the last step.
            eval_env, eval_samples: a ``group_size=1`` env and prompts (e.g.
                :func:`~tokengym.agents.engine.rollout.heldout_samples`) for greedy accuracy, logged with the evals.
            callback: called with every training record, after the evaluation due at that step;
                returning ``False`` stops right there (a checkpoint saved in it resumes exactly).
            run_dir: write the folder ``tokengym train dpo`` writes (``config.json`` recording ``eval_env``'s env,
                ``metrics.jsonl`` with held-out metrics at step 0 too, checkpoints every ``save_every`` steps,
                ``model/``), so that ``tokengym eval/plot/sample --run`` work on it. A folder that is not empty is
                refused unless ``resume=True``, which continues it from its newest checkpoint as ``--resume`` does
                (on the same pairs and config; a missing or empty folder starts the run).
        """
        if run_dir is not None:
            from tokengym.agents.runtime.run_config import RunConfig
            from tokengym.agents.runtime.session import jsonable, python_run, run_in_folder

            data = self.prepare(pairs)
            settings = RunConfig(save_every=save_every, progress=False)  # no progress bar from Python
            config = {"algorithm": "dpo", "preset": None, "config": jsonable(asdict(self.config)),
                      "run": python_run(eval_env, self.policy, eval_samples, settings, rollout=False)}
            return run_in_folder(run_dir, resume, config, self, None, self.fit_steps(data), settings=settings,
                                 body=lambda trainer: self.fit_in_folder(trainer, data, eval_pairs, eval_env, eval_samples, callback))
        cfg = self.config
        data = self.prepare(pairs)
        eval_data = self.prepare(eval_pairs) if eval_pairs is not None else None
        evaluates = eval_data is not None or (eval_env is not None and bool(eval_samples))
        self.share_prefix  # resolve the packing check before any reference context is entered
        self._fit = run = self._start_fit(data, eval_data)
        n, bs, total = len(data), cfg.batch_size, run["total"]
        per_epoch = math.ceil(n / bs)
        history_start = len(self.logger.history)
        if total == 0 and evaluates:
            self.logger.log(self.global_step, self._evaluate_all(eval_data, run["eval_ref"], eval_env, eval_samples))
        self.policy.train()
        t_window, tok_window, pairs_window = 0.0, 0, 0
        while run["step"] < total:
            if run["pos"] >= per_epoch:  # new epoch
                run["order"] = torch.randperm(n, generator=self._shuffle) if cfg.shuffle else torch.arange(n)
                run["pos"] = 0
                self.epoch += 1
            t0 = time.perf_counter()
            idx, share = self.dp.shard(run["order"][run["pos"] * bs:(run["pos"] + 1) * bs])  # share = 1 in one process
            batch = self._batch(data, idx)
            self.optim.set_lr(run["step"], total)
            ref_seq = self._ref_batch(batch, run["ref_cache"])
            loss, stats = self._loss(batch, ref_seq)
            self.optim.zero_grad()
            (loss * share).backward()
            norm = self.optim.step()["grad_norm"]  # summed over ranks, clipped, stepped
            stats = self.dp.weighted(stats, share)  # global means of the batch's statistics
            run["pos"] += 1
            run["step"] += 1
            self.global_step += 1
            stats["grad_norm"] = norm
            window = run["window"]
            for k, v in stats.items():
                window[k] = window.get(k, 0.0) + float(v)
            run["count"] += 1
            t_window += time.perf_counter() - t0
            tok_window += batch.num_tokens
            pairs_window += batch.num_pairs
            record = None
            if run["count"] == cfg.log_every or run["step"] == total:
                count = run["count"]
                metrics = {(k if "/" in k else f"train/{k}"): v / count for k, v in window.items()}
                metrics.update({"train/lr": self.optim.lr, "epoch": self.epoch - 1 + run["pos"] / per_epoch,
                                "perf/tokens_per_s": tok_window / max(t_window, 1e-9),
                                "perf/pairs_per_s": pairs_window / max(t_window, 1e-9)})
                run["window"], run["count"] = {}, 0
                t_window, tok_window, pairs_window = 0.0, 0, 0
                record = self.logger.log(self.global_step, metrics)
            if evaluates and (run["step"] == total or (cfg.eval_every and self.global_step % cfg.eval_every == 0)):
                self.logger.log(self.global_step, self._evaluate_all(eval_data, run["eval_ref"], eval_env, eval_samples))
                self.policy.train()
            if record is not None and callback is not None and callback(record) is False:
                break
        self.policy.eval()
        return self.logger.history[history_start:]

    def fit_in_folder(self, trainer: Any, pairs: Any, eval_pairs: Any = None, eval_env: Any = None,
                      eval_samples: list | None = None, callback: Callable[[dict[str, float]], Any] | None = None) -> None:
        """The fit in its run folder (``tokengym train dpo`` and ``fit(run_dir=...)``): held-out greedy metrics at
        step 0 of a new run, :meth:`fit` with the trainer's checkpoints, then the final checkpoint and ``model/``."""
        from tokengym.agents.algorithms.onpolicy import both
        from tokengym.agents.runtime.session import initial_eval

        initial_eval(trainer, self, eval_env, eval_samples, evaluate)
        self.fit(pairs, eval_pairs, eval_env, eval_samples, callback=both(trainer.callback, callback))
        trainer.finish()

    # ------------------------------------------------------------------ evaluation
    def _evaluate_all(self, eval_data, eval_ref, eval_env, eval_samples) -> dict[str, float]:
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

    # ------------------------------------------------------------------ reference
    def reset_reference(self) -> None:
        """Make the current policy the reference: a fresh frozen copy (also for a LoRA policy, whose
        adapter-disabled base is only its *initial* policy); nothing to do with ``precompute_ref`` and no
        reference model (every ``fit`` then takes its reference from the policy at its start)."""
        if self.ref is None:
            return
        self.ref = _wrap_policy(frozen_copy(self.policy.model), self.policy)

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)


def shared_prefix_logps(policy: Any, b: SharedPrefixBatch) -> torch.Tensor:
    """Summed completion log-probs ``[2B]`` (chosen, then rejected) of a prefix-shared, packed batch: one forward.

    The model gets the batch's 4D additive attention mask and explicit position ids; a token is scored
    from the output of the column before it, except each rejected suffix's first token, predicted from
    its pair's last shared column. Logits are divided by the policy's temperature, as in
    :meth:`Policy.forward`.
    """
    model = policy.model
    out = model(input_ids=b.tokens, attention_mask=b.attention_bias(next(model.parameters()).dtype), position_ids=b.position_ids)
    logits = out.logits
    if policy.temperature != 1.0:
        logits = logits / policy.temperature
    lp = F.token_logprobs(logits[:, :-1], b.tokens[:, 1:])  # lp[:, j]: the token at column j + 1
    B = b.num_pairs
    pair = b.pair[:, 1:].reshape(-1).clamp(min=0)
    zero = lp.new_zeros(())
    chosen = lp.new_zeros(B).index_add(0, pair, torch.where(b.score_chosen[:, 1:], lp, zero).reshape(-1))
    rejected = lp.new_zeros(B).index_add(0, pair, torch.where(b.score_rejected[:, 1:], lp, zero).reshape(-1))
    head = logits[b.first_rejected_at[:, 0], b.first_rejected_at[:, 1]][:, None]  # [B, 1, V]
    first = F.token_logprobs(head, b.first_rejected[:, None])[:, 0]
    return torch.cat([chosen, rejected + torch.where(b.has_rejected_suffix, first, zero)])


register("dpo", DPOConfig, "DPO and its IPO/hinge/robust variants on preference pairs",
         run_fields=frozenset({"temperature", "pairs", "num_pairs", "save_every", "keep_checkpoints", "sharding"}), data_parallel=True)

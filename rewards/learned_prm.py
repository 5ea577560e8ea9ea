"""A learned process reward model: a token-classification head that scores the token ending each step.

**Layout.** A solution is read as ``ids(prompt, special tokens on)`` followed, for every step, by
``ids(step + delimiter, special tokens off)``; the score of a step is the model's output at the last
token of its piece (the delimiter, which is where the environments place step rewards). The model is
causal, so a step's score never depends on the steps after it: scoring a partial solution gives the
same numbers as scoring the full one.

**Scores.** With one label the step score is ``sigmoid(logit)``; with two it is ``softmax(logits)[1]``
(the probability that the step is good). ``threshold`` turns them into hard 0/1 scores, the scale of a
rule-based checker such as :class:`~tokengym.rewards.ArithmeticStepReward`.

**Training** (:func:`train_prm`) fits the step scores to step labels in ``[0, 1]`` (binary
cross-entropy) and reports step-label accuracy on held-out examples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .packing import classifier_at, set_packing
from .reward_model import fit, load_folder, load_rows, model_device, pad_id_of, pad_right, save_folder, split_rows
from .training import OptimConfig, TrainLoopConfig

__all__ = ["LearnedPRM", "PRMConfig", "train_prm", "PRM_COLUMNS"]

PRM_COLUMNS = ("prompt", "steps", "labels")
"""Columns of a PRM training example: the prompt, its steps (list of str), one label in [0, 1] per step."""


def _good_logprob_1(logits: torch.Tensor) -> torch.Tensor:
    return F.logsigmoid(logits[..., 0])


def _good_logprob_2(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1)[..., 1]


def _loss_1(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits[..., 0].float(), y, reduction="none")


def _loss_2(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), torch.stack([1 - y, y], -1), reduction="none")


HEADS = {1: (_good_logprob_1, _loss_1), 2: (_good_logprob_2, _loss_2)}
"""Per number of labels: (log-probability that a step is good, per-step loss against a label in [0, 1])."""


class LearnedPRM:
    """A token-classification model as a process reward ``(prompts, steps, **fields) -> list[list[float]]``.

    All step lists of a call are scored in batches of ``batch_size`` solutions under
    ``torch.inference_mode`` and in eval mode. Pass it as ``process_reward=`` to an environment, in
    place of a rule-based PRM; task fields are ignored.

    Args:
        model: a ``transformers`` ``AutoModelForTokenClassification`` with 1 or 2 labels (or any module
            whose ``model(input_ids=..., attention_mask=...).logits`` is ``[N, L, num_labels]``).
        tokenizer: its tokenizer (needs a pad token).
        delimiter: the text that ends a step (the task's ``step_delimiter``; arithmetic: ``"\\n"``).
        batch_size: solutions per forward pass.
        threshold: ``None`` for probabilities, else scores become ``1.0`` when the probability is at
            least ``threshold`` and ``0.0`` otherwise.
        name: the reward's name in logs.

    Example:
        >>> from tokengym.agents.engine.models import load_classifier
        >>> prm = LearnedPRM(*load_classifier("tiny", head="token"), threshold=0.5)
        >>> scores = prm(["12+7+30\\n"], [["12+7=19", "19+30=49", "A: 49"]])
        >>> len(scores[0]), set(scores[0]) <= {0.0, 1.0}
        (3, True)
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, delimiter: str = "\n", batch_size: int = 64,
                 threshold: float | None = None, name: str = "learned_prm"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (a token classifier), got {type(model).__name__}")
        labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if labels not in HEADS:
            raise ValueError(f"a learned PRM has 1 (sigmoid) or 2 (softmax) labels per token, got num_labels={labels}")
        if not isinstance(delimiter, str) or not delimiter:
            raise ValueError(f"delimiter must be a non-empty string, got {delimiter!r}")
        if batch_size < 1 or (threshold is not None and not 0 < threshold < 1):
            raise ValueError(f"batch_size must be >= 1 and threshold None or in (0, 1), got {batch_size}, {threshold}")
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = pad_id_of(model, tokenizer)
        self.num_labels = labels
        self.delimiter, self.batch_size, self.threshold, self.name = delimiter, int(batch_size), threshold, name
        self.packing = "off"  # forwards over the real tokens packed into bins: off, bins or auto (the fit sets it)

    def encode(self, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """``(ids, ends)``: the solution's token ids and the position of the token that ends each step."""
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        ends = []
        pieces = self.tokenizer([s + self.delimiter for s in steps], add_special_tokens=False)["input_ids"] if steps else []
        for piece in pieces:
            if not piece:
                raise ValueError(f"{self.name}: a step encodes to no tokens")
            ids += list(piece)
            ends.append(len(ids) - 1)
        return ids, ends

    def step_logits(self, encoded: Sequence[tuple[list[int], list[int]]]) -> torch.Tensor:
        """Logits ``[S, num_labels]`` at the step ends of encoded solutions (all their steps, in order), with
        autograd, from one forward pass."""
        tokens, mask = pad_right([ids for ids, _ in encoded], self.pad_id, model_device(self.model))
        rows = torch.tensor([i for i, (_, ends) in enumerate(encoded) for _ in ends], dtype=torch.long, device=tokens.device)
        cols = torch.tensor([e for _, ends in encoded for e in ends], dtype=torch.long, device=tokens.device)
        if self.packing != "off":
            packed = classifier_at(self.model, self.packing, tokens, mask, rows, cols)
            if packed is not None:
                return packed
        logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits
        if logits.shape[:2] != tokens.shape or logits.shape[-1] != self.num_labels:
            raise ValueError(f"the PRM returned logits of shape {tuple(logits.shape)}; expected {tuple(tokens.shape) + (self.num_labels,)}")
        return logits[rows, cols]

    def step_logprobs(self, encoded: Sequence[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Log-probability that each step is good, one tensor per solution (with autograd)."""
        good = HEADS[self.num_labels][0](self.step_logits(encoded))
        return list(good.split([len(ends) for _, ends in encoded]))

    def __call__(self, prompts: list[str], steps: list[list[str]], **fields: Any) -> list[list[float]]:
        if len(prompts) != len(steps):
            raise ValueError(f"{self.name}: got {len(prompts)} prompts for {len(steps)} step lists")
        encoded = [self.encode(p, s) for p, s in zip(prompts, steps)]
        out: list[list[float]] = [[] for _ in encoded]
        todo = sorted((i for i, (_, ends) in enumerate(encoded) if ends), key=lambda i: len(encoded[i][0]))
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for s in range(0, len(todo), self.batch_size):
                    chunk = todo[s : s + self.batch_size]
                    for i, lp in zip(chunk, self.step_logprobs([encoded[i] for i in chunk])):
                        p = lp.exp()
                        out[i] = (p >= self.threshold).float().tolist() if self.threshold is not None else p.tolist()
        finally:
            self.model.train(was_training)
        return out

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the model (safetensors), its tokenizer and ``learned_prm.json`` (the wrapper's settings)."""
        save_folder(self.model, self.tokenizer, path, "learned_prm.json",
              {"delimiter": self.delimiter, "batch_size": self.batch_size, "threshold": self.threshold, "name": self.name})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer: Any = None, device: str | torch.device = "cpu",
                        **kwargs: Any) -> "LearnedPRM":
        """Load a local folder (safetensors only, nothing downloaded, never the folder's own code); ``kwargs``
        override the saved settings."""
        from transformers import AutoModelForTokenClassification

        model, tok, settings = load_folder(AutoModelForTokenClassification, path, tokenizer, device, "learned_prm.json", kwargs)
        return cls(model, tok, **{**settings, **kwargs})

    def __repr__(self) -> str:
        return f"LearnedPRM({type(self.model).__name__}, delimiter={self.delimiter!r}, threshold={self.threshold})"


@dataclass
class PRMConfig(TrainLoopConfig, OptimConfig):
    """Hyper-parameters of :func:`train_prm`: the optimiser's and the training loop's
    (:mod:`tokengym.rewards.training`), and the ones below."""

    epochs: int = 1
    """Passes over the training examples."""
    batch_size: int = 32
    """Solutions per optimiser step."""
    delimiter: str = "\n"
    """The text that ends a step (must match the LearnedPRM that will score)."""
    val_fraction: float = 0.1
    """Fraction of prompts held out for step accuracy when no eval examples are given (0 = none)."""

    def __post_init__(self) -> None:
        self.check_fields()

    def checks(self) -> dict[str, bool]:
        return {"epochs": self.epochs >= 1, "batch_size": self.batch_size >= 1,
                "delimiter": isinstance(self.delimiter, str) and bool(self.delimiter),
                "val_fraction": 0 <= self.val_fraction < 1}


def _check_examples(rows: list[dict], what: str) -> None:
    for i, r in enumerate(rows):
        steps, labels = r["steps"], r["labels"]
        if not isinstance(r["prompt"], str) or not isinstance(steps, (list, tuple)) or not all(isinstance(s, str) for s in steps):
            raise ValueError(f"{what} {i}: 'prompt' must be a string and 'steps' a list of strings, got {r['prompt']!r:.40}, {steps!r:.60}")
        if not isinstance(labels, (list, tuple)) or len(labels) != len(steps) or not steps:
            raise ValueError(f"{what} {i}: needs one label per step and at least one step, got {len(steps)} steps and labels {labels!r:.60}")
        if not all(isinstance(y, (int, float)) and not isinstance(y, bool) and 0 <= y <= 1 for y in labels):
            raise ValueError(f"{what} {i}: labels must be numbers in [0, 1], got {labels!r:.60}")


def check_step_labels(examples: Any) -> list[dict[str, Any]]:
    """The rows of ``examples`` (a list, a JSONL path or a ``datasets.Dataset``), each checked as :func:`train_prm`
    needs it: a string ``prompt``, a list of string ``steps``, one label in [0, 1] per step."""
    rows = load_rows(examples, PRM_COLUMNS, "PRM examples")
    _check_examples(rows, "PRM example")
    return rows


def train_prm(model: torch.nn.Module, tokenizer: Any, examples: Any, config: PRMConfig | None = None, eval_examples: Any = None,
              callback: Callable[[dict[str, float]], Any] | None = None) -> list[dict[str, float]]:
    """Train ``model`` (in place) as a process reward model on step labels.

    Args:
        model: a token classifier with 1 or 2 labels (see :class:`LearnedPRM`); wrap it in
            ``LearnedPRM(model, tokenizer, delimiter=config.delimiter)`` afterwards to score.
        tokenizer: its tokenizer.
        examples: dicts with ``prompt`` (str), ``steps`` (list of str) and ``labels`` (one number in
            [0, 1] per step, 1 = good step); a list, a JSONL path or a ``datasets.Dataset``.
        config: :class:`PRMConfig`.
        eval_examples: held-out examples; default: ``config.val_fraction`` of the prompts of ``examples``.
        callback: called with every logged record; returning ``False`` stops training.

    Returns:
        The logged records: per step ``train/loss`` and ``train/step_accuracy``; at evaluations
        ``eval/loss``, ``eval/step_accuracy`` (held-out steps whose thresholded score (0.5) matches the
        rounded label), ``eval/good_step_accuracy`` and ``eval/bad_step_accuracy`` (the same on good and
        on bad steps alone) and ``eval/solution_accuracy`` (every step of a solution right).
    """
    cfg = config or PRMConfig()
    rows = load_rows(examples, PRM_COLUMNS, "PRM examples")
    if eval_examples is not None:
        held = load_rows(eval_examples, PRM_COLUMNS, "eval PRM examples")
    elif cfg.val_fraction > 0:
        rows, held = split_rows(rows, cfg.val_fraction, cfg.seed)
    else:
        held = []
    _check_examples(rows + held, "PRM example")
    prm = LearnedPRM(model, tokenizer, delimiter=cfg.delimiter, batch_size=cfg.batch_size)
    set_packing(cfg.packing, prm)
    loss_fn = HEADS[prm.num_labels][1]

    def encode(rs: list[dict]) -> tuple[list, list[torch.Tensor]]:
        return [prm.encode(r["prompt"], r["steps"]) for r in rs], [torch.tensor(r["labels"], dtype=torch.float32) for r in rs]

    train_x, train_y = encode(rows)
    held_x, held_y = encode(held) if held else ([], [])

    def batch_stats(x: list, y: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = prm.step_logits(x)
        labels = torch.cat(y).to(logits.device)
        right = (HEADS[prm.num_labels][0](logits).exp() >= 0.5) == (labels >= 0.5)
        return loss_fn(logits, labels).mean(), right

    def step_loss(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, right = batch_stats([train_x[i] for i in idx], [train_y[i] for i in idx])
        return loss, {"loss": loss.item(), "step_accuracy": right.float().mean().item()}

    def evaluate() -> dict[str, float]:
        was_training = model.training
        model.eval()
        losses, rights = [], []
        with torch.inference_mode():
            for s in range(0, len(held_x), cfg.batch_size):
                loss, right = batch_stats(held_x[s : s + cfg.batch_size], held_y[s : s + cfg.batch_size])
                losses.append(loss.item() * right.numel())
                rights.append(right.cpu())
        model.train(was_training)
        right = torch.cat(rights)
        good = torch.cat(held_y) >= 0.5
        per_solution = right.split([len(y) for y in held_y])
        nan = float("nan")
        return {"loss": sum(losses) / right.numel(), "step_accuracy": right.float().mean().item(),
                "good_step_accuracy": right[good].float().mean().item() if good.any() else nan,
                "bad_step_accuracy": right[~good].float().mean().item() if (~good).any() else nan,
                "solution_accuracy": sum(bool(r.all()) for r in per_solution) / len(per_solution)}

    return fit(model, len(train_x), step_loss, evaluate if held else None, cfg, callback)

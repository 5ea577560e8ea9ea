"""Learned outcome rewards: a sequence-classification reward model and its Bradley-Terry training.

Reads top to bottom: loading rows (preference pairs or PRM examples) -> the token layout a reward model
reads -> :class:`RewardModel` (an outcome reward callable) -> :class:`RewardModelConfig` and
:func:`train_reward_model` -> the small training loop that :mod:`tokengym.rewards.learned_prm` shares.

**Layout.** A (prompt, completion) pair is read as ``ids(prompt, special tokens on) + ids(completion,
special tokens off) + [eos]``, right-padded: the way the environments encode prompts, plus an explicit
end marker (the env decodes completions without special tokens, so the marker is added back here, the
same in training and in scoring). The model's scalar output at the last real token is the reward (what
``transformers`` ``...ForSequenceClassification`` models return as ``logits[:, 0]``).

**Bradley-Terry.** ``P(chosen > rejected) = sigmoid(r_c - r_r)``; training minimises
``-log sigmoid(r_c - r_r)`` (optionally plus ``center_coef * mean((r_c + r_r)^2)``, which keeps rewards
near 0 since the loss only fixes differences) and reports pairwise accuracy ``mean(r_c > r_r)`` on
held-out pairs.

:class:`LikelihoodRewardModel` scores with a causal LM instead: ``beta * log p(completion + <eos> | prompt)``,
optionally minus a frozen reference's (DPO's implicit reward), and trains with the same loop.

Nothing here imports the environments or the agents: pass a model and its tokenizer (e.g. from
``tokengym.agents.engine.models.load_classifier``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from .common import check_rows_fit, quiet_transformers
from .packing import classifier_at, head_logits, place, plan, set_packing
from .training import OptimConfig, OptimizerStep, TrainLoopConfig

__all__ = ["RewardModel", "LikelihoodRewardModel", "RewardModelConfig", "train_reward_model", "check_pairs_fit", "load_rows",
           "split_rows"]


# ============================================================================== rows
def load_rows(source: Any, columns: Sequence[str], what: str = "rows") -> list[dict[str, Any]]:
    """Rows with the given columns from a list of dicts, a JSONL path or a ``datasets.Dataset``.

    Other columns are kept. Raises ``ValueError`` naming the row and the columns it has when one is
    missing, and ``TypeError`` for a source of another type.

    Example:
        >>> load_rows([{"prompt": "1+1\\n", "chosen": "A: 2", "rejected": "A: 3"}], ("prompt", "chosen", "rejected"))
        [{'prompt': '1+1\\n', 'chosen': 'A: 2', 'rejected': 'A: 3'}]
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what}: no such JSONL file: {path!r}")
        with open(path, encoding="utf-8") as f:
            rows = []
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        where = f"file {path!r}"
    elif hasattr(source, "column_names") and hasattr(source, "to_list"):  # datasets.Dataset
        rows, where = source.to_list(), "dataset"
    elif isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        rows, where = list(source), "list"
    else:
        raise TypeError(f"cannot read {what} from {type(source).__name__}; pass a list of dicts, a JSONL path or a datasets.Dataset")
    if not rows:
        raise ValueError(f"no {what}: the {where} is empty")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{what}: item {i} of the {where} is a {type(row).__name__}, expected a dict with {list(columns)}")
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(f"{what}: item {i} of the {where} has no {missing} column(s); its columns are {sorted(row)}")
    return [dict(r) for r in rows]


def split_rows(rows: list[dict[str, Any]], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` split by prompt (no prompt in both), about ``val_fraction`` of the prompts held out."""
    prompts = list(dict.fromkeys(str(r["prompt"]) for r in rows))
    if len(prompts) < 2:
        raise ValueError(f"need at least 2 distinct prompts to hold some out, got {len(prompts)}; pass eval data or val_fraction=0")
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(max(1, round(val_fraction * len(prompts))), len(prompts) - 1)
    held = {prompts[i] for i in order[:k]}
    return [r for r in rows if str(r["prompt"]) not in held], [r for r in rows if str(r["prompt"]) in held]


# ============================================================================== layout
def _eos(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos[0] if isinstance(eos, (list, tuple)) else eos)]


def encode_texts(tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of ``prompt + completion + <eos>`` per row (see the module docstring); longer rows keep their last
    ``max_length`` (no tokenizer warning about its own limit: the trainers check rows against the model's positions)."""
    p = tokenizer(list(prompts), add_special_tokens=True, verbose=False)["input_ids"]
    c = tokenizer(list(completions), add_special_tokens=False, verbose=False)["input_ids"]
    eos = _eos(tokenizer)
    ids = [list(a) + list(b) + eos for a, b in zip(p, c)]
    return [x[-max_length:] for x in ids] if max_length else ids


def pad_right(ids: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens[N, L], mask[N, L])`` right-padded to the longest row."""
    width = max(len(x) for x in ids)
    tokens = torch.full((len(ids), width), int(pad_id), dtype=torch.long)
    for i, x in enumerate(ids):
        tokens[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    mask = torch.arange(width) < torch.tensor([len(x) for x in ids])[:, None]
    return tokens.to(device), mask.to(device)


def pad_id_of(model: torch.nn.Module, tokenizer: Any) -> int:
    """The pad id, also written into the model's config (sequence classifiers find the last token with it)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has no pad token; set one, e.g. tokenizer.pad_token = tokenizer.eos_token")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = int(pad)
    return int(pad)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (where its inputs go)."""
    return next(model.parameters()).device


# ============================================================================== the reward model
class RewardModel:
    """A sequence-classification model as an outcome reward ``(prompts, completions, **fields) -> Tensor[N]``.

    Scores are the model's scalar output at the last token of ``prompt + completion + <eos>``, computed
    in batches of ``batch_size`` rows (sorted by length to cut padding) under ``torch.inference_mode``
    and in eval mode. Pass it as ``reward=`` to any environment; task fields are ignored.

    Args:
        model: a ``transformers`` ``AutoModelForSequenceClassification`` with ``num_labels=1`` (or any
            module whose ``model(input_ids=..., attention_mask=...).logits`` is ``[N, 1]``).
        tokenizer: its tokenizer (needs a pad token; EOS, when it has one, ends every scored text).
        batch_size: rows per forward pass when scoring.
        max_length: keep only the last ``max_length`` tokens of a row (``None`` = all).
        name: the reward's name in logs.
        shift: the reward is ``(model output - shift) / scale``. Bradley-Terry training fixes
            only differences, so the raw level is arbitrary; :meth:`normalize` sets both so that a
            reference set of completions (e.g. the initial policy's samples) scores mean 0 and std 1,
            which keeps an RL critic's targets and the KL penalty on a known scale.
        scale: the divisor in that formula.

    Example:
        >>> from tokengym.agents.engine.models import load_classifier
        >>> rm = RewardModel(*load_classifier("tiny", head="sequence"))
        >>> rm(["1+2\\n", "2+2\\n"], ["1+2=3\\nA: 3", "2+2=5\\nA: 5"]).shape
        torch.Size([2])
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, batch_size: int = 64, max_length: int | None = None,
                 name: str = "reward_model", shift: float = 0.0, scale: float = 1.0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (a sequence classifier), got {type(model).__name__}")
        self._check_model(model)
        if batch_size < 1 or (max_length is not None and max_length < 2):
            raise ValueError(f"batch_size must be >= 1 and max_length None or >= 2, got {batch_size}, {max_length}")
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = pad_id_of(model, tokenizer)
        if not (math.isfinite(shift) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"shift must be finite and scale finite and > 0, got {shift}, {scale}")
        self.batch_size, self.max_length, self.name = int(batch_size), max_length, name
        self.shift, self.scale = float(shift), float(scale)
        self.packing = "off"  # forwards over the real tokens packed into bins: off, bins or auto (the fit sets it)

    @staticmethod
    def _check_model(model: torch.nn.Module) -> None:
        labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if labels != 1:
            raise ValueError(f"a reward model has one output (num_labels=1), got num_labels={labels}")

    def encode(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """Token ids of each row as the model reads them (see the module docstring)."""
        return encode_texts(self.tokenizer, prompts, completions, self.max_length)

    def forward_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rewards ``[N]`` (float32, with autograd) of already encoded rows, in one forward pass."""
        tokens, mask = pad_right(ids, self.pad_id, model_device(self.model))
        logits = _packed_score(self.model, self.packing, tokens, mask)
        if logits is None:
            logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits
        if logits.dim() != 2 or logits.shape != (len(ids), 1):
            raise ValueError(f"the reward model returned logits of shape {tuple(logits.shape)}; expected ({len(ids)}, 1)")
        return logits[:, 0].float()

    def score_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Raw model outputs ``[N]`` (no shift/scale) of encoded rows, batched, in eval mode, without autograd."""
        was_training = self.model.training
        self.model.eval()
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = torch.empty(len(ids), dtype=torch.float32)
        try:
            with torch.inference_mode():
                for s in range(0, len(order), self.batch_size):
                    chunk = order[s : s + self.batch_size]
                    out[chunk] = self.forward_ids([ids[i] for i in chunk]).cpu()
        finally:
            self.model.train(was_training)
        return out

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> torch.Tensor:
        if len(prompts) != len(completions):
            raise ValueError(f"{self.name}: got {len(prompts)} prompts for {len(completions)} completions")
        if not completions:
            return torch.zeros(0)
        return (self.score_ids(self.encode(prompts, completions)) - self.shift) / self.scale

    def normalize(self, prompts: Sequence[str], completions: Sequence[str]) -> "RewardModel":
        """Set ``shift``/``scale`` so these completions score mean 0 and std 1; returns ``self``."""
        if len(completions) < 2 or len(prompts) != len(completions):
            raise ValueError(f"normalize needs at least 2 (prompt, completion) rows, got {len(prompts)} and {len(completions)}")
        raw = self.score_ids(self.encode(prompts, completions))
        self.shift, self.scale = raw.mean().item(), max(raw.std().item(), 1e-6)
        return self

    SETTINGS_FILE = "reward_model.json"
    """The wrapper's settings next to the weights; its name also tells which class wrote the folder."""

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the model (safetensors), its tokenizer and ``reward_model.json`` (the wrapper's settings)."""
        save_folder(self.model, self.tokenizer, path, self.SETTINGS_FILE,
              {"batch_size": self.batch_size, "max_length": self.max_length, "name": self.name,
               "shift": self.shift, "scale": self.scale})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer: Any = None, device: str | torch.device = "cpu",
                        **kwargs: Any) -> "RewardModel":
        """Load a local folder (written by :meth:`save_pretrained` or any sequence classifier with ``num_labels=1``).

        A folder written by :class:`LikelihoodRewardModel` loads as one (a causal LM read as a sequence
        classifier would get a new, random head). Safetensors weights only, nothing downloaded, and never the
        folder's own code (``trust_remote_code`` stays off); ``kwargs`` override the saved wrapper settings.
        """
        from transformers import AutoModelForSequenceClassification

        if cls is RewardModel and os.path.isfile(os.path.join(os.fspath(path), LikelihoodRewardModel.SETTINGS_FILE)):
            return LikelihoodRewardModel.from_pretrained(path, tokenizer, device, **kwargs)
        model, tok, settings = load_folder(AutoModelForSequenceClassification, path, tokenizer, device, cls.SETTINGS_FILE, kwargs)
        return cls(model, tok, **{**settings, **kwargs})

    def __repr__(self) -> str:
        return f"RewardModel({type(self.model).__name__}, name={self.name!r})"


class _Row(list):
    """Token ids of one scored row; ``start`` is the index of its first completion token."""

    start: int = 1


class LikelihoodRewardModel(RewardModel):
    """A causal LM as an outcome reward: ``beta * log p(completion + <eos> | prompt)``, optionally minus a reference's.

    The score sums the LM's log-probabilities of the completion's tokens and the closing EOS (same layout
    as :class:`RewardModel`), so a Bradley-Terry fit (:func:`train_reward_model` accepts this object in
    place of a classifier) starts from what the LM already knows: how likely each next token is. A
    sequence head on the same trunk has to learn that from scratch, and on Arithmetic it ranks the
    policy's own right and wrong samples far worse (``bench/RESULTS.md``, ``tests/agents/data/test_rlhf_pipeline.py``).

    With ``reference`` (a frozen copy of the starting LM, e.g. ``frozen_copy(model)``), the score is
    ``beta * (log p - log p_ref)``: DPO's implicit reward (Rafailov et al. 2023; as a reward model for RL,
    PRIME, Cui et al. 2025), which scores 0 everywhere before training, so BT training moves only what
    the pairs tell it. As PPO's reward it is exploitable: its maximum lies wherever the trained LM moved
    most from the reference, so the verifier's accuracy rises, then falls. Scoring the trained LM *without*
    the reference (``LikelihoodRewardModel(rm.model, rm.tokenizer, beta=rm.beta)``) keeps PPO on what that LM
    finds likely, and is what raised the verifier's accuracy on Arithmetic (``bench/RESULTS.md``).

    Args:
        model: a ``transformers`` causal LM (``model(input_ids=..., attention_mask=...).logits`` is ``[N, L, V]``).
        tokenizer: its tokenizer (a pad token needed; EOS, when it has one, ends every scored text).
        beta: scale of the log-likelihood.
        reference: optional frozen causal LM whose log-likelihood is subtracted (not saved by :meth:`save_pretrained`).
        batch_size: as in :class:`RewardModel`.
        max_length: as in :class:`RewardModel`.
        name: as in :class:`RewardModel`.
        shift: as in :class:`RewardModel`.
        scale: as in :class:`RewardModel`.

    Example:
        >>> from tokengym.agents.engine.models import load_model
        >>> rm = LikelihoodRewardModel(*load_model("tiny"), beta=0.5)
        >>> rm(["1+2\\n", "2+2\\n"], ["1+2=3\\nA: 3", "2+2=5\\nA: 5"]).shape
        torch.Size([2])
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, beta: float = 1.0, reference: torch.nn.Module | None = None,
                 batch_size: int = 64, max_length: int | None = None, name: str = "likelihood_reward_model",
                 shift: float = 0.0, scale: float = 1.0):
        super().__init__(model, tokenizer, batch_size, max_length, name, shift, scale)
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"beta must be finite and > 0, got {beta}")
        if reference is not None and not isinstance(reference, torch.nn.Module):
            raise TypeError(f"reference must be a torch.nn.Module (a causal LM) or None, got {type(reference).__name__}")
        self.beta, self.reference = float(beta), reference

    @staticmethod
    def _check_model(model: torch.nn.Module) -> None:
        pass  # a causal LM: its output is per token; forward_ids reduces it to one score

    def encode(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """Token ids of each row (as :meth:`RewardModel.encode`), each knowing where its completion starts."""
        p = self.tokenizer(list(prompts), add_special_tokens=True, verbose=False)["input_ids"]
        rows = []
        for a, ids in zip(p, encode_texts(self.tokenizer, prompts, completions, None)):
            cut = len(ids) - self.max_length if self.max_length and len(ids) > self.max_length else 0
            row = _Row(ids[cut:])
            row.start = max(len(a) - cut, 1)  # position 0 has no prediction
            rows.append(row)
        return rows

    def _token_logprobs(self, lm: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[N, L - 1]`` of ``tokens[:, 1:]`` (packed under ``self.packing``: 0 at padding)."""
        bins = plan(self.packing, lm, tokens, mask)
        if bins is not None:  # the head runs only where a real token is predicted; 0 elsewhere
            logits, dst = head_logits(lm, bins, mask, 1)
            lp = torch.log_softmax(logits[0].float(), -1).gather(1, tokens[:, 1:].reshape(-1)[dst][:, None])[:, 0]
            return place(lp, dst, len(tokens), tokens.shape[1] - 1)
        logits = lm(input_ids=tokens, attention_mask=mask.long()).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(2, tokens[:, 1:, None])[..., 0]

    def forward_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rewards ``[N]`` (with autograd through ``model``) of rows from :meth:`encode`, in one forward pass."""
        tokens, mask = pad_right(ids, self.pad_id, model_device(self.model))
        lp = self._token_logprobs(self.model, tokens, mask)
        if self.reference is not None:
            with torch.no_grad():
                ref = self._token_logprobs(self.reference, tokens, mask)
            lp = lp - ref
        starts = torch.tensor([getattr(x, "start", 1) for x in ids], device=tokens.device)
        scored = mask[:, 1:] & (torch.arange(1, tokens.shape[1], device=tokens.device)[None] >= starts[:, None])
        return self.beta * (lp * scored).sum(1)

    SETTINGS_FILE = "likelihood_reward_model.json"

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the LM (safetensors), its tokenizer and ``likelihood_reward_model.json`` (the reference is not saved)."""
        save_folder(self.model, self.tokenizer, path, self.SETTINGS_FILE,
              {"beta": self.beta, "batch_size": self.batch_size, "max_length": self.max_length, "name": self.name,
               "shift": self.shift, "scale": self.scale})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer: Any = None, device: str | torch.device = "cpu",
                        **kwargs: Any) -> "LikelihoodRewardModel":
        """Load a local folder holding a causal LM (e.g. written by :meth:`save_pretrained`); ``kwargs`` override saved settings."""
        from transformers import AutoModelForCausalLM

        model, tok, settings = load_folder(AutoModelForCausalLM, path, tokenizer, device, cls.SETTINGS_FILE, kwargs)
        return cls(model, tok, **{**settings, **kwargs})

    def __repr__(self) -> str:
        return f"LikelihoodRewardModel({type(self.model).__name__}, beta={self.beta}, reference={self.reference is not None})"


def save_folder(model: torch.nn.Module, tokenizer: Any, path: str | os.PathLike, settings_file: str, settings: dict) -> None:
    """Write ``model``, ``tokenizer`` and ``settings`` (as ``settings_file``, JSON) into the folder ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, settings_file), "w") as f:
        json.dump(settings, f, indent=1)


def load_folder(auto_cls: Any, path: str | os.PathLike, tokenizer: Any, device: Any, settings_file: str, kwargs: dict[str, Any]):
    """``(model, tokenizer, saved settings)`` of a local folder; ``kwargs`` are the caller's setting overrides, checked
    here for ``trust_remote_code``, which tokengym never turns on (a model folder's own code is never run)."""
    from transformers import AutoTokenizer

    if "trust_remote_code" in kwargs:
        raise ValueError("trust_remote_code: tokengym never runs a model folder's own Python code; load models whose "
                         "architecture transformers ships (convert others to one first)")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a local folder (nothing is downloaded); pass a folder written by save_pretrained")
    with quiet_transformers():
        model = auto_cls.from_pretrained(path, local_files_only=True, use_safetensors=True, trust_remote_code=False)
    if tokenizer is None:
        if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"{path!r} holds no tokenizer files; pass tokenizer=")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    settings_path = os.path.join(path, settings_file)
    settings = {}
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            settings = json.load(f)
    return model.to(device).eval(), tokenizer, settings


def _packed_score(model: torch.nn.Module, packing: str, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """A sequence classifier's ``[N, 1]`` scores from a packed pass, read where its own forward pools (the rightmost
    token that is not the pad id); ``None``: run it padded."""
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if packing == "off" or pad is None:
        return None
    last = (torch.arange(tokens.shape[1], device=tokens.device) * (tokens != pad)).argmax(-1)
    return classifier_at(model, packing, tokens, mask, torch.arange(len(tokens), device=tokens.device), last)


# ============================================================================== training
@dataclass
class RewardModelConfig(TrainLoopConfig, OptimConfig):
    """Hyper-parameters of :func:`train_reward_model` (Bradley-Terry training): the optimiser's and the training
    loop's (:mod:`tokengym.rewards.training`), and the ones below."""

    epochs: int = 1
    """Passes over the training pairs."""
    batch_size: int = 32
    """Pairs per optimiser step (each step scores 2 x batch_size rows)."""
    center_coef: float = 0.0
    """Weight of mean((r_c + r_r)^2), which keeps rewards centred on 0 (0 = off)."""
    max_length: int | None = None
    """Keep only the last max_length tokens of a row (None = all)."""
    val_fraction: float = 0.1
    """Fraction of prompts held out for pairwise accuracy when no eval pairs are given (0 = none)."""

    def __post_init__(self) -> None:
        self.check_fields()

    def checks(self) -> dict[str, bool]:
        return {"epochs": self.epochs >= 1, "batch_size": self.batch_size >= 1, "center_coef": self.center_coef >= 0,
                "max_length": self.max_length is None or self.max_length >= 2, "val_fraction": 0 <= self.val_fraction < 1}


PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def _check_texts(rows: list[dict], columns: Sequence[str], what: str) -> None:
    for i, r in enumerate(rows):
        for c in columns:
            if not isinstance(r[c], str):
                raise ValueError(f"{what} {i}: {c!r} must be a string, got {type(r[c]).__name__}: {r[c]!r:.60}")


def train_reward_model(model: torch.nn.Module, tokenizer: Any, pairs: Any, config: RewardModelConfig | None = None,
                       eval_pairs: Any = None, callback: Callable[[dict[str, float]], Any] | None = None) -> list[dict[str, float]]:
    """Train ``model`` (in place) as a Bradley-Terry reward model on preference pairs.

    Args:
        model: a sequence classifier with one output (see :class:`RewardModel`), or a :class:`RewardModel`
            (e.g. a :class:`LikelihoodRewardModel`) to train through its own scoring and settings (then
            ``tokenizer`` and ``config.max_length`` are not used); wrap a classifier in
            ``RewardModel(model, tokenizer, max_length=config.max_length)`` afterwards to score.
        tokenizer: its tokenizer.
        pairs: dicts with string ``prompt``, ``chosen`` and ``rejected`` (a list, a JSONL path or a
            ``datasets.Dataset``).
        config: :class:`RewardModelConfig`.
        eval_pairs: held-out pairs; default: ``config.val_fraction`` of the prompts of ``pairs``.
        callback: called with every logged record; returning ``False`` stops training.

    Returns:
        The logged records: per step ``train/loss``, ``train/accuracy``, ``train/margin`` (mean
        ``r_c - r_r``), ``train/reward_mean``, ``train/truncated`` (the fraction of the step's rows cut to
        ``max_length``); at evaluations ``eval/loss``, ``eval/accuracy`` (held-out
        pairwise accuracy), ``eval/margin``, ``eval/reward_mean``. Each has ``step`` and ``epoch``.
    """
    cfg = config or RewardModelConfig()
    rows = load_rows(pairs, PAIR_COLUMNS, "preference pairs")
    given = rows  # in their order (a message names a pair by its place)
    if eval_pairs is not None:
        held = load_rows(eval_pairs, PAIR_COLUMNS, "eval pairs")
    elif cfg.val_fraction > 0:
        rows, held = split_rows(rows, cfg.val_fraction, cfg.seed)
    else:
        held = []
    _check_texts(rows + held, PAIR_COLUMNS, "pair")
    if isinstance(model, RewardModel):
        rm = model
    else:
        rm = RewardModel(model, tokenizer, batch_size=2 * cfg.batch_size, max_length=cfg.max_length)
    set_packing(cfg.packing, rm)
    check_pairs_fit(rm, given)
    if eval_pairs is not None:
        check_pairs_fit(rm, held, "eval pair")

    def encode(rs: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
        prompts = [r["prompt"] for r in rs]
        return rm.encode(prompts, [r["chosen"] for r in rs]), rm.encode(prompts, [r["rejected"] for r in rs])

    train_c, train_r = encode(rows)
    held_c, held_r = encode(held) if held else ([], [])
    cut = _cut_rows(rm, rows)  # [2, len(rows)]: rows that max_length cut (logged as train/truncated)

    def stats(rc: torch.Tensor, rr: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -F.logsigmoid(rc - rr).mean()
        return loss, {"loss": loss.item(), "accuracy": (rc > rr).float().mean().item(),
                      "margin": (rc - rr).mean().item(), "reward_mean": torch.cat([rc, rr]).mean().item()}

    def step_loss(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        r = rm.forward_ids([train_c[i] for i in idx] + [train_r[i] for i in idx])
        rc, rr = r[: len(idx)], r[len(idx):]
        loss, s = stats(rc, rr)
        s["truncated"] = float(cut[:, idx].float().mean())
        if cfg.center_coef > 0:
            loss = loss + cfg.center_coef * ((rc + rr) ** 2).mean()
        return loss, s

    def evaluate() -> dict[str, float]:
        r = rm.score_ids(held_c + held_r)
        return stats(r[: len(held_c)], r[len(held_c):])[1]

    return fit(rm.model, len(train_c), step_loss, evaluate if held else None, cfg, callback)


def check_pairs_fit(rm: RewardModel, pairs: Sequence[Mapping[str, Any]], what: str = "pair") -> None:
    """``ValueError`` (one line) when a row of ``pairs`` (prompt + chosen or rejected + EOS, as ``rm`` encodes it,
    after its ``max_length``) is longer than the model's positions: it names the longest and what to do."""
    prompts = [r["prompt"] for r in pairs]
    lengths = [len(x) for c in ("chosen", "rejected") for x in rm.encode(prompts, [r[c] for r in pairs])]
    n = len(pairs)
    fix = "set max_length (--max-length) to at most that: each row keeps its last tokens (train/truncated logs the " \
        "fraction cut)" + (f"; max_length={rm.max_length} is over it" if rm.max_length else "")
    check_rows_fit(rm.model, lengths, lambda i: f"the longest row ({what} {i % n}: prompt + "
                   f"{'chosen' if i < n else 'rejected'} + EOS)", fix)


def _cut_rows(rm: RewardModel, rows: list[dict]) -> torch.Tensor:
    """``[2, N]`` bool: the chosen / rejected rows of ``rows`` longer than ``rm.max_length`` (cut to their end)."""
    if not rm.max_length or not rows:
        return torch.zeros(2, len(rows), dtype=torch.bool)
    prompts = [r["prompt"] for r in rows]
    return torch.tensor([[len(x) > rm.max_length for x in encode_texts(rm.tokenizer, prompts, [r[c] for r in rows])]
                         for c in ("chosen", "rejected")], dtype=torch.bool)


def fit(model: torch.nn.Module, n: int, step_loss: Callable[[list[int]], tuple[torch.Tensor, dict[str, float]]],
        evaluate: Callable[[], dict[str, float]] | None, cfg: Any,
        callback: Callable[[dict[str, float]], Any] | None = None) -> list[dict[str, float]]:
    """The loop both learned rewards train with: seeded shuffles, AdamW, clipping, periodic evaluation.

    ``step_loss(indices)`` returns the loss of a batch of training items and its statistics (logged as
    ``train/<key>``); ``evaluate()`` the held-out statistics (logged as ``eval/<key>``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OptimizerStep.adamw(params, cfg.lr, cfg.weight_decay, fused=False, max_grad_norm=cfg.max_grad_norm)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, float]] = []
    step, evaluated_at = 0, -1

    def log(record: dict[str, float]) -> bool:
        history.append(record)
        return callback is None or callback(record) is not False

    def run_eval(epoch: int) -> bool:
        nonlocal evaluated_at
        evaluated_at = step
        return log({"step": step, "epoch": epoch, **{f"eval/{k}": v for k, v in evaluate().items()}})

    model.train()
    try:
        for epoch in range(cfg.epochs):
            for batch in torch.randperm(n, generator=gen).split(cfg.batch_size):
                loss, s = step_loss(batch.tolist())
                opt.zero_grad()
                loss.backward()
                norm = opt.step()["grad_norm"]
                step += 1
                if not log({"step": step, "epoch": epoch, **{f"train/{k}": v for k, v in s.items()}, "train/grad_norm": float(norm)}):
                    return history
                if evaluate is not None and cfg.eval_every and step % cfg.eval_every == 0 and not run_eval(epoch):
                    return history
        if evaluate is not None and evaluated_at != step:
            run_eval(cfg.epochs - 1)
    finally:
        model.eval()
    return history

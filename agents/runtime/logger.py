"""``RunLogger``: one place that writes a run's metrics to ``metrics.jsonl`` and its trackers (``--report-to``)."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Any, Sequence

import torch

from tokengym.agents.runtime.trackers import make_tracker, parse_report_to
from tokengym.rewards.common import TokengymWarning

__all__ = ["RunLogger", "SignalWatch", "to_float"]


def to_float(v: Any) -> float:
    """A Python float from a number or a 0-dim/1-element tensor."""
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)


class RunLogger:
    """Append metrics for a run directory; ``None`` as ``run_dir`` keeps them in memory only.

    Every :meth:`log` call adds one JSON line ``{"step": ..., "time": ..., **metrics}`` to
    ``run_dir/metrics.jsonl`` and gives each tracker of ``report_to`` (default TensorBoard; see
    :mod:`~tokengym.agents.runtime.trackers`) the finite metrics (name = tag, e.g. ``reward/mean``); :meth:`close`
    gives them each metric's last value. ``history`` holds the same records in memory. ``purge_step`` (resume)
    hides TensorBoard events at and after that step written by an earlier, interrupted process. A tracker that
    raises is dropped with one warning: ``metrics.jsonl`` stays whole.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, tensorboard: bool = True, purge_step: int | None = None,
                 report_to: str | Sequence[str] | None = "tensorboard"):
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        self.history: list[dict[str, float]] = []
        self.trackers: dict[str, Any] = {}
        self._start = time.time()
        self._signal = SignalWatch()
        if self.run_dir is not None:
            os.makedirs(self.run_dir, exist_ok=True)
            names = [n for n in parse_report_to(report_to) if tensorboard or n != "tensorboard"]
            config = _run_config(self.run_dir)
            for name in names:
                tracker = make_tracker(name, purge_step=purge_step)
                if self._call(name, tracker, "start", self.run_dir, os.path.basename(os.path.abspath(self.run_dir)), config):
                    self.trackers[name] = tracker

    def _call(self, name: str, tracker: Any, method: str, *args: Any) -> bool:
        """``tracker.method(*args)``; on an exception warn once and drop the tracker (the run goes on)."""
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as e:
            self.trackers.pop(name, None)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warnings.warn(f"tracker {name} failed ({method}: {type(e).__name__}: {first}); it is dropped and the run "
                          "goes on (metrics.jsonl has every record)", TokengymWarning, stacklevel=3)
            return False

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        record = {"step": int(step), "time": round(time.time() - self._start, 3)}
        record.update({k: to_float(v) for k, v in metrics.items()})
        self.history.append(record)
        self._signal.update(record)
        if self.run_dir is not None:
            with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({k: (v if math.isfinite(v) else None) for k, v in record.items()}) + "\n")
        if self.trackers:
            scalars = {k: v for k, v in record.items() if k not in ("step", "time") and math.isfinite(v)}
            for name, tracker in list(self.trackers.items()):
                self._call(name, tracker, "log", record["step"], scalars)
        return record

    def summary(self) -> dict[str, float]:
        """Each metric's last finite value in ``history`` (what the trackers get at the end)."""
        out: dict[str, float] = {}
        for record in self.history:
            out.update({k: v for k, v in record.items() if k not in ("step", "time") and math.isfinite(v)})
        return out

    def close(self) -> None:
        """Finish every tracker with :meth:`summary` (once; a later call does nothing)."""
        if self.trackers:
            summary = self.summary()
            for name, tracker in list(self.trackers.items()):
                self._call(name, tracker, "finish", summary)
            self.trackers = {}


def _run_config(run_dir: str) -> dict[str, Any]:
    """The run's ``config.json`` for the trackers (``{}`` when the folder has none, e.g. a bare logger)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        return config if isinstance(config, dict) else {}
    except (OSError, ValueError):
        return {}


class SignalWatch:
    """Warns once when the rollouts give no learning signal for ``patience`` steps in a row: every GRPO group's
    rewards equal (``reward/frac_zero_std_groups`` = 1, so every advantage is 0), or every PPO episode's reward
    the same (``reward/std`` = 0). Training then changes nothing (GRPO) or only fits the critic (PPO). A record with
    a teacher's per-token signal (distillation's ``train/reverse_kl``) always has one."""

    def __init__(self, patience: int = 5):
        self.patience, self.flat, self.warned = patience, 0, False

    def update(self, record: dict[str, float]) -> None:
        frac, std = record.get("reward/frac_zero_std_groups"), record.get("reward/std")
        if (frac is None and std is None) or "train/reverse_kl" in record:
            return
        self.flat = self.flat + 1 if (frac >= 1.0 if frac is not None else std == 0) else 0
        if self.flat < self.patience or self.warned:
            return
        self.warned = True
        mean = record.get("reward/mean", record.get("objective/score", float("nan")))
        if record.get("reward/accuracy") == 1.0:  # every episode right: nothing left to learn, not a dead signal
            warnings.warn(f"solved: every episode was correct for {self.flat} steps in a row (mean reward {mean:.3g}), so "
                          "every group's rewards are equal and the policy gradient is 0; make the task harder (--env-kwargs) "
                          "or stop here", TokengymWarning, stacklevel=3)
            return
        what = "every group's rewards were equal" if frac is not None else "every episode got the same reward"
        warnings.warn(f"no learning signal: {what} for {self.flat} steps in a row (mean reward {mean:.3g}), so the policy "
                      "gradient is 0. If the model always fails, start from one that sometimes succeeds: SFT first "
                      "(tokengym train sft with the same --env), a bigger model, or an easier task setting",
                      TokengymWarning, stacklevel=3)

"""``tokengym plot``: PNG learning curves from a run's ``metrics.jsonl`` (needs matplotlib: ``pip install tokengym[plot]``)."""

from __future__ import annotations

import os
from typing import Any

from tokengym.agents.runtime.runs import UsageError, read_metrics

__all__ = ["PANELS", "plot_run"]

PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean", "objective/score", "eval/mean_reward", "rewards/margins"),
    "accuracy": ("eval/accuracy", "reward/accuracy", "rewards/accuracies", "eval/rewards/accuracies"),
    "kl": ("train/kl", "objective/kl", "train/approx_kl", "train/reverse_kl"),
    "loss": ("train/loss", "train/pg_loss", "train/policy_loss", "train/value_loss", "loss", "train/train_loss"),
    "entropy": ("train/entropy",),
    "clip_fraction": ("train/clipfrac", "train/clipfrac_low", "train/clipfrac_high", "train/vf_clipfrac"),
    "length": ("completion/length_mean", "completion/length_max", "eval/mean_length"),
    "throughput": ("perf/tokens_per_s", "perf/pairs_per_s"),
    "time": ("time/rollout", "time/reward", "time/update"),
}
"""One PNG per panel, with every listed metric the run logged."""


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write ``<panel>.png`` for every panel with data; return the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'tokengym[plot]'") from None
    records = read_metrics(run_dir)
    if not records:
        raise UsageError(f"{run_dir} has no metrics yet (metrics.jsonl is missing or empty)")
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for panel, keys in PANELS.items():
        series = {k: _series(records, k) for k in keys}
        series = {k: v for k, v in series.items() if v[0]}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for key, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(f"{os.path.basename(os.path.normpath(run_dir))}: {panel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{panel}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    if not written:
        raise UsageError(f"{run_dir}/metrics.jsonl has none of the plotted metrics ({', '.join(PANELS)})")
    return written


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get(key) is not None:
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys

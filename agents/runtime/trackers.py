"""Experiment trackers behind ``--report-to`` (``report_to``): TensorBoard, trackio, Weights & Biases and MLflow.

One seam, :class:`Tracker` (``start(run_dir, name, config)``, ``log(step, scalars)``, ``finish(summary)``), one small
adapter per tracker, and :func:`check_report_to` for the names and installed packages (one line each, before a run
folder exists). :class:`~tokengym.agents.runtime.logger.RunLogger` gives every tracker the same finite scalars, the
run's ``config.json`` and, at the end, the last value of each metric; ``metrics.jsonl`` stays the source of truth.

Everything stays offline and inside the run folder unless the user's environment says otherwise: W&B in offline mode
under ``RUN/wandb`` (``WANDB_MODE``/``WANDB_DIR`` win), trackio's SQLite store in ``RUN/trackio`` (``TRACKIO_DIR``
wins) and MLflow's SQLite store ``RUN/mlflow.db`` (``MLFLOW_TRACKING_URI`` wins). A resumed run logs to a new run of
each tracker, under the same name (TensorBoard's events after the checkpoint are purged, as before).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import time
from typing import Any, Protocol, Sequence

__all__ = ["Tracker", "TRACKERS", "PACKAGES", "parse_report_to", "check_report_to", "make_tracker", "where"]

PROJECT = "tokengym"
"""The project (W&B, trackio) or experiment (MLflow) the runs go to (``WANDB_PROJECT`` /
``MLFLOW_EXPERIMENT_NAME`` override it)."""


class Tracker(Protocol):
    """What ``RunLogger`` drives: one run of one tracker. An exception from any method drops the tracker with a
    warning (the run goes on)."""

    def start(self, run_dir: str, name: str, config: dict[str, Any]) -> None:
        """Open the tracker's run for the run folder ``run_dir`` named ``name`` with the run's ``config``."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the finite ``scalars`` of one step."""

    def finish(self, summary: dict[str, float]) -> None:
        """Close the tracker's run; ``summary`` holds each metric's last finite value."""


class TensorBoardTracker:
    """TensorBoard event files in the run folder itself (``tensorboard --logdir runs``); ``purge_step`` (resume)
    hides events at and after that step written by an earlier, interrupted process."""

    def __init__(self, purge_step: int | None = None):
        self.purge_step, self.writer = purge_step, None

    def start(self, run_dir: str, name: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run_dir, purge_step=self.purge_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, summary: dict[str, float]) -> None:  # the final scalars are in the event file already
        self.writer.close()


class TrackioTracker:
    """trackio's local SQLite store, ``RUN/trackio/tokengym.db`` (``trackio show --project tokengym`` with
    ``TRACKIO_DIR`` pointing there). trackio reads ``TRACKIO_DIR`` once, when first imported: a process that imported
    it before keeps its store (said in a warning)."""

    def __init__(self, **_: Any):
        self.run = None

    def start(self, run_dir: str, name: str, config: dict[str, Any]) -> None:
        store = os.path.join(run_dir, "trackio")
        if "TRACKIO_DIR" not in os.environ and "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = store  # read at import: set for the import only
            try:
                import trackio
            finally:
                del os.environ["TRACKIO_DIR"]
        import trackio
        from trackio import utils

        if "TRACKIO_DIR" not in os.environ and os.path.abspath(utils.TRACKIO_DIR) != os.path.abspath(store):
            from tokengym.rewards.common import TokengymWarning
            import warnings

            warnings.warn(f"trackio logs to {utils.TRACKIO_DIR}, not {store}: it was imported before this run",
                          TokengymWarning, stacklevel=2)
        with contextlib.redirect_stdout(io.StringIO()):  # its banner; train prints where to look
            self.run = trackio.init(project=PROJECT, name=name, config=config, embed=False, auto_log_gpu=False,
                                    auto_log_cpu=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self, summary: dict[str, float]) -> None:
        from trackio import context_vars

        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()
        if context_vars.current_run.get() is self.run:  # else trackio finishes it again at exit, printing
            context_vars.current_run.set(None)


class WandbTracker:
    """Weights & Biases, offline under ``RUN/wandb`` (``wandb sync RUN/wandb/offline-run-*`` uploads it) unless
    ``WANDB_MODE`` is set; the summary goes to the run's summary."""

    def __init__(self, **_: Any):
        self.run = None

    def start(self, run_dir: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, config=config,
                              dir=os.environ.get("WANDB_DIR", run_dir), settings=settings,
                              mode=None if os.environ.get("WANDB_MODE") else "offline", reinit="create_new")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self, summary: dict[str, float]) -> None:
        self.run.summary.update(summary)
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^\w\-. /]")


class MlflowTracker:
    """MLflow, in the SQLite store ``RUN/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db``)
    with artifacts in ``RUN/mlflow-artifacts``, unless ``MLFLOW_TRACKING_URI`` is set; the config as flat params and
    ``config.json``, the summary as ``summary.json`` (artifacts). Metric names keep the characters MLflow allows (others become ``_``)."""

    def __init__(self, **_: Any):
        self.client, self.run_id = None, None

    def start(self, run_dir: str, name: str, config: dict[str, Any]) -> None:
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its table creation, every new run
        logging.getLogger("alembic").setLevel(logging.WARNING)
        own = os.environ.get("MLFLOW_TRACKING_URI")
        uri = own or f"sqlite:///{os.path.abspath(os.path.join(run_dir, 'mlflow.db'))}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        found = self.client.get_experiment_by_name(experiment)
        artifacts = None if own else os.path.abspath(os.path.join(run_dir, "mlflow-artifacts"))  # not ./mlruns
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment, artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        from mlflow.entities import Param

        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_BAD.sub("_", k), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, summary: dict[str, float]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"run.env": ..., "config.lr": ...}`` (MLflow params are flat; values cut to 500 chars)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if not isinstance(v, str) else v[:500]
    return out


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "trackio": TrackioTracker, "wandb": WandbTracker,
                             "mlflow": MlflowTracker}
"""The adapters by ``--report-to`` name."""

PACKAGES = {"tensorboard": ("tensorboard", None), "trackio": ("trackio", "trackio"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
"""``name: (module it needs, the tokengym extra that installs it)``."""


def parse_report_to(value: str | Sequence[str] | None) -> list[str]:
    """The tracker names of ``value`` (a comma list or a sequence; ``none`` alone: no tracker), in order, once
    each; ``ValueError`` (one line) for an unknown or empty name, or ``none`` with others."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    names = [str(n).strip().lower() for n in items]
    choices = f"choose from {', '.join(TRACKERS)} or none (a comma list, e.g. tensorboard,wandb)"
    for n in names:
        if n not in TRACKERS and n != "none":
            raise ValueError(f"report_to: unknown tracker {n!r}; {choices}" if n else f"report_to: an empty name; {choices}")
    if "none" in names and len(names) > 1:
        raise ValueError("report_to: 'none' turns every tracker off and cannot be combined with others")
    return list(dict.fromkeys(n for n in names if n != "none"))


def check_report_to(value: str | Sequence[str] | None) -> list[str]:
    """:func:`parse_report_to`, and ``ValueError`` (one line naming the extra) for a tracker whose package is not
    installed; nothing is imported."""
    names = parse_report_to(value)
    for n in names:
        module, extra = PACKAGES[n]
        if importlib.util.find_spec(module) is None:
            how = f'pip install "tokengym[{extra}]"' if extra else f"pip install {module}"
            raise ValueError(f"report_to: {n} is not installed; {how}")
    return names


def make_tracker(name: str, purge_step: int | None = None) -> Tracker:
    """A fresh adapter for the tracker ``name``."""
    return TRACKERS[name](purge_step=purge_step)


def where(name: str, run_dir: str, runs_dir: str) -> str:
    """One line telling where a run's ``name`` tracker data is and how to look at it."""
    return {"tensorboard": f"TensorBoard: tensorboard --logdir {runs_dir}",
            "trackio": f"trackio: TRACKIO_DIR={os.environ.get('TRACKIO_DIR', os.path.join(run_dir, 'trackio'))} "
                       f"trackio show --project {PROJECT}",
            "wandb": (f"W&B ({os.environ.get('WANDB_MODE', 'offline')}): "
                      + ("" if os.environ.get("WANDB_MODE") else f"wandb sync {os.environ.get('WANDB_DIR', run_dir)}/wandb/offline-run-*")),
            "mlflow": "MLflow: mlflow ui --backend-store-uri "
                      + os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{os.path.join(run_dir, 'mlflow.db')}"),
            }.get(name, name)

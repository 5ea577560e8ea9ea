"""``--report-to``: every tracker, offline in the run folder, holds what ``metrics.jsonl`` holds; a tracker that
raises is dropped with one warning; bad names and missing packages are one line, exit 2, no run folder."""

import glob
import json
import os
import sqlite3
import struct
import subprocess
import sys

import pytest

from tokengym.agents.cli import main
from tokengym.agents.runtime import trackers
from tokengym.agents.runtime.trackers import check_report_to, parse_report_to

SHORT = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--eval-prompts", "0", "--threads", "1",
         "--progress", "false", "--seed", "3"]


def jsonl(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def wandb_records(path):
    """The protobuf records of a ``.wandb`` file (a LevelDB-style log: 32 KiB blocks of chunks, each with a 7-byte
    header crc32/length/type; the file opens with W&B's own 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunk, out = open(path, "rb").read(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def test_every_tracker_offline_holds_the_runs_final_reward(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_", "MLFLOW_"))}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = subprocess.run([sys.executable, "-m", "tokengym.agents.cli", "train", "grpo", *SHORT, "--runs-dir", str(tmp_path),
                        "--name", "t", "--report-to", "tensorboard,trackio,wandb,mlflow"],
                       capture_output=True, text=True, env=dict(env, WANDB_SILENT="true"), timeout=600, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.listdir(cwd) == []  # nothing outside the run folder (MLflow's default ./mlruns, wandb's ./wandb)
    run = str(tmp_path / "t")
    rows = [row for row in jsonl(run) if row.get("reward/mean") is not None]
    assert [row["step"] for row in rows] == [1, 2]
    final = rows[-1]["reward/mean"]
    assert "Trackio" not in r.stdout  # its banner is hidden; the run says where each tracker writes
    assert f"W&B (offline): wandb sync {run}/wandb/offline-run-*" in r.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(run)
    tb.Reload()
    events = tb.Scalars("reward/mean")
    assert [e.step for e in events] == [x["step"] for x in rows]
    assert [e.value for e in events] == pytest.approx([x["reward/mean"] for x in rows], rel=2**-23)  # TensorBoard's float32

    db = sqlite3.connect(os.path.join(run, "trackio", "tokengym.db"))  # trackio's local store, in the run folder
    logged = [(step, json.loads(m).get("reward/mean")) for step, m in db.execute("select step, metrics from metrics order by id")]
    assert [x for x in logged if x[1] is not None] == [(x["step"], x["reward/mean"]) for x in rows]
    (cfg,), = db.execute("select config from configs")
    assert json.loads(cfg)["algorithm"] == "grpo"

    (path,) = glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb"))
    recs = wandb_records(path)
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731 (W&B nests a name with a slash)
    history = [{key(i): json.loads(i.value_json) for i in rec.history.item} for rec in recs if rec.HasField("history")]
    assert [h["reward/mean"] for h in history if "reward/mean" in h] == pytest.approx([x["reward/mean"] for x in rows])
    summary = {}
    for rec in recs:
        if rec.HasField("summary"):
            summary.update({key(i): json.loads(i.value_json) for i in rec.summary.update})
    assert summary["reward/mean"] == pytest.approx(final)
    (run_rec,) = [rec.run for rec in recs if rec.HasField("run")]
    config = {i.key: json.loads(i.value_json) for i in run_rec.config.update}
    assert config["algorithm"] == "grpo" and run_rec.display_name == "t"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run}/mlflow.db")
    (ml,) = client.search_runs([client.get_experiment_by_name("tokengym").experiment_id])
    assert ml.info.run_name == "t" and ml.info.status == "FINISHED"
    assert ml.data.metrics["reward/mean"] == pytest.approx(final)
    assert ml.data.params["algorithm"] == "grpo" and ml.data.params["config.steps"] == "2"
    (summary_file,) = glob.glob(os.path.join(run, "mlflow-artifacts", "*", "artifacts", "summary.json"))  # in the run
    assert json.load(open(summary_file))["reward/mean"] == pytest.approx(final)


class Raising(trackers.TensorBoardTracker):
    """TensorBoard that fails at its second log."""

    calls = 0

    def log(self, step, scalars):
        Raising.calls += 1
        if Raising.calls == 2:
            raise OSError("the tracker's disk went away\nsecond line")
        super().log(step, scalars)


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_the_run_finishes(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Raising)
    Raising.calls = 0
    code = main(["train", "grpo", *SHORT, "--steps", "3", "--runs-dir", str(tmp_path), "--name", "r"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert Raising.calls == 2  # dropped at the failure: never called again
    lines = [line for line in err.splitlines() if "tracker tensorboard failed" in line]
    assert len(lines) == 1 and "OSError: the tracker's disk went away)" in lines[0], err
    rows = jsonl(str(tmp_path / "r"))
    assert [row["step"] for row in rows if row.get("reward/mean") is not None] == [1, 2, 3]
    assert os.path.isdir(tmp_path / "r" / "model")


@pytest.mark.parametrize("value, message", [
    ("tensorbord", "report_to: unknown tracker 'tensorbord'; choose from tensorboard, trackio, wandb, mlflow or none"),
    ("wandb,,mlflow", "report_to: an empty name"),
    ("none,wandb", "'none' turns every tracker off"),
    ("wandb", 'report_to: wandb is not installed; pip install "tokengym[wandb]"'),
])
def test_bad_or_missing_tracker_is_one_line_exit_2_and_no_folder(tmp_path, capsys, monkeypatch, value, message):
    monkeypatch.setitem(trackers.PACKAGES, "wandb", ("tokengym_no_such_module", "wandb"))
    code = main(["train", "grpo", *SHORT, "--runs-dir", str(tmp_path), "--name", "x", "--report-to", value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not os.path.exists(tmp_path / "x")


def test_report_to_parsing():
    assert parse_report_to("TensorBoard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert parse_report_to("none") == [] and parse_report_to(None) == [] and parse_report_to(["mlflow"]) == ["mlflow"]
    assert check_report_to("tensorboard,mlflow") == ["tensorboard", "mlflow"]

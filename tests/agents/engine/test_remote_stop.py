"""How a run with remote rollout workers stops (agents/engine/remote.py, worker_pool.py): a lost worker is named as
lost whichever thread notices first, Ctrl-C ends the run promptly and leaves it resumable, and ``--sync-dir``
follows ``--min-workers`` as the weight group does. The orders are forced with a mocked transport (no timing)."""

import os
import queue
import signal
import subprocess
import sys
import time

import pytest

import tokengym.agents.engine.remote as R
from tokengym.agents.engine.sources import WorkerError
from tokengym.agents.runtime.weight_sync import WeightSyncError

TIMEOUT_TEXT = ("weight sync of policy version 3 failed: rollout worker 127.0.0.1:9 did not take it within 300 s "
                "(sync_timeout) (no acknowledgement)")


def bare_pool(workers=1, min_workers=0):
    """A RemoteWorkers with ``workers`` live sessions and no process or socket behind them: the transport (``send``,
    ``call``) is the test's."""
    pool = object.__new__(R.RemoteWorkers)
    pool.addresses = [f"127.0.0.1:{9 + i}" for i in range(workers)]
    pool.secret, pool.timeout, pool.bucket, pool.sync_dir, pool.tls, pool.gate = b"s", 300.0, 1 << 20, "", None, None
    pool.min_workers, pool.next, pool.generation = min_workers or workers, 5, 1
    pool.live = {i: {"session": f"s{i}", "sync": object()} for i in range(workers)}
    pool.gone, pool.lost, pool.inbox, pool.files = {}, {}, queue.Queue(), []
    pool.named, pool.manifest = lambda: iter(()), []
    pool._pending, pool._failed, pool.sync_seconds, pool.version, pool.taken = None, None, 0.0, -1, b""
    return pool


def late(pool, slot=0):
    """A ``send`` whose sync of worker ``slot`` times out (late, not lost: ``lost`` unset)."""

    def send(syncs, version, named, manifest, bucket):
        err = WeightSyncError(TIMEOUT_TEXT)
        err.sync = pool.live[slot]["sync"]
        raise err

    return send


def answers(*replies):
    """A ``call`` that gives ``replies`` in turn (an exception is raised), recording each path asked."""
    asked, left = [], list(replies)

    def call(address, path, body, secret, timeout, tls=None):
        asked.append(path)
        reply = left.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    call.asked = asked
    return call


def lost_line(why, address="127.0.0.1:9"):
    return (f"rollout worker {address} was lost before rollout 5 ({why}); the run stops (its checkpoints are intact: "
            "resume it, or let it go on without the worker with --min-workers)")


# ---------------------------------------------------------------------------------------------- who noticed first
def test_the_fetcher_noticed_first_then_the_sync_timed_out_the_run_names_the_lost_worker(monkeypatch):
    """Forced order: the worker's fetcher found it gone (its session's entry in ``gone``), then the weight sync
    failed as late. The run stops naming the lost worker, not a 300-s timeout; no probe is needed."""
    pool = bare_pool()
    pool.gone["s0"] = "ConnectionRefusedError: [Errno 111] Connection refused"
    monkeypatch.setattr(R, "send", late(pool))
    monkeypatch.setattr(R, "call", answers())  # (asking the worker would fail the test: nothing is left to answer)
    pool.publish(3, wait=False)  # in the sync's thread, as a run does
    with pytest.raises(WorkerError) as caught:
        pool.settle()
    assert str(caught.value) == lost_line("ConnectionRefusedError: [Errno 111] Connection refused")


@pytest.mark.parametrize("reply,lost", [
    (ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: [Errno 111] Connection refused"),
    ((200, b'{"protocol": 1, "busy": false, "session": null}'),
     "its session ended (the worker was restarted, or its session failed: see the worker's log)"),
    (TimeoutError("timed out"), None),  # stopped or overloaded: late, and the timeout is the line
    ((200, b'{"protocol": 1, "busy": true, "session": "s0"}'), None),  # serving it: late
])
def test_the_sync_noticed_first_the_worker_is_asked_and_a_gone_one_is_named_as_lost(monkeypatch, reply, lost):
    """Forced order: the sync timed out before the fetcher said anything. The learner asks the worker: gone (no
    connection, or its session ended) is the lost worker's line; a worker that serves the session, or says nothing
    (SIGSTOP), is late and the timeout's line stands."""
    pool = bare_pool()
    call = answers(reply)
    monkeypatch.setattr(R, "send", late(pool))
    monkeypatch.setattr(R, "call", call)
    with pytest.raises(WorkerError) as caught:
        pool.publish(3)
    assert str(caught.value) == (lost_line(lost) if lost else TIMEOUT_TEXT) and call.asked == ["/v1/hello"]


def test_under_min_workers_the_lost_worker_goes_to_the_learner_thread_by_name(monkeypatch):
    """Two workers, one may go: the sync that timed out on a worker the fetcher found gone hands it to the learner's
    thread as lost (with the fetcher's reason), to be re-planned without."""
    pool = bare_pool(workers=2, min_workers=1)
    pool.gone["s1"] = "RemoteDisconnected: Remote end closed connection without response"
    monkeypatch.setattr(R, "send", late(pool, slot=1))
    monkeypatch.setattr(R, "call", answers())
    pool.publish(3)
    assert pool.inbox.get_nowait() == ("lost", 1, 1, "RemoteDisconnected: Remote end closed connection without response")


# ---------------------------------------------------------------------------------------------- --sync-dir
def weights_of_a_model():
    import torch

    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(16, 8, generator=g)), ("b.bias", torch.randn(8, generator=g)),
            ("c.weight", torch.randn(40, 30, generator=g)), ("d.weight", torch.randn(6, 5, generator=g))]


@pytest.mark.parametrize("min_workers,goes_on", [(1, True), (2, False)])
def test_a_worker_lost_during_a_file_sync_follows_min_workers(monkeypatch, tmp_path, min_workers, goes_on):
    """--sync-dir, two workers, the second gone when the version's file is offered (forced: its call fails). With
    --min-workers 1 the learner's thread gets it as lost (it re-plans and warns, as over a weight group); without,
    the run stops in the lost worker's line."""
    from tokengym.agents.engine.messages import manifest

    pool = bare_pool(workers=2, min_workers=min_workers)
    named = weights_of_a_model()
    pool.sync_dir, pool.learner, pool.named, pool.manifest = str(tmp_path), "L", lambda: iter(named), manifest(named)
    refused = ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(R, "call", answers((200, b'{"ok": true}'), refused))
    why = "weights of version 3: ConnectionRefusedError: [Errno 111] Connection refused"
    if goes_on:
        pool.publish(3)
        assert pool.inbox.get_nowait() == ("lost", 1, 1, why)
    else:
        with pytest.raises(WorkerError) as caught:
            pool.publish(3)
        assert str(caught.value) == lost_line(why, "127.0.0.1:10")


def two_models():
    """A learner's and a worker's copy of one architecture, with different weights: one tensor (4800 bytes) is larger
    than the bucket the test uses, the others fit several to a piece."""
    import torch

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 12), torch.nn.Linear(30, 40),
                                   torch.nn.Linear(40, 4))

    return model(0), model(1)


def test_a_file_sync_writes_pieces_within_the_bucket_and_the_worker_loads_them_exactly(tmp_path):
    import json
    import types

    import torch

    from tokengym.agents.engine.sync_files import write_version
    from tokengym.agents.engine.worker_loop import WorkerLoop, weight_manifest

    learner, worker = two_models()
    bucket = 2048
    paths = write_version(str(tmp_path), "L", 7, learner.named_parameters(), weight_manifest(learner), bucket)
    assert paths[-1] == str(tmp_path / "L-v7.json") and sorted(os.listdir(tmp_path)) == sorted(map(os.path.basename, paths))
    head = json.loads(open(paths[-1]).read())
    over = [p for p in head["pieces"] if os.path.getsize(tmp_path / p["file"]) > bucket]
    assert len(head["pieces"]) >= 3 and len(paths) == len(head["pieces"]) + 1
    assert [[t[0] for t in p["tensors"]] for p in over] == [["2.weight"]]  # the one larger than the bucket, alone
    assert all(os.path.getsize(tmp_path / p["file"]) == p["bytes"] for p in head["pieces"])

    loop = WorkerLoop({"exact": True}, None, types.SimpleNamespace(model=worker), None, None)
    assert loop.offer_file(7, paths[-1]) is None
    loop._load(loop.versions.pop(7))
    assert all(torch.equal(p, q) for p, q in zip(learner.parameters(), worker.parameters()))


@pytest.mark.parametrize("harm,line", [
    ("remove", r"^piece L-v7-1\.safetensors of the version is missing or unreadable \(FileNotFoundError: .*\)$"),
    ("flip", r"^piece L-v7-1\.safetensors of the version is damaged \(\d+ bytes of \d+, or its checksum differs\); the "
             r"version is refused$"),
    ("cut", r"^piece L-v7-1\.safetensors of the version is damaged \(\d+ bytes of \d+, or its checksum differs\); the "
            r"version is refused$"),
])
def test_a_missing_or_damaged_piece_is_refused_in_one_line_and_nothing_of_it_is_loaded(tmp_path, harm, line):
    import re
    import types

    import torch

    from tokengym.agents.engine.sync_files import write_version
    from tokengym.agents.engine.worker_loop import WorkerLoop, weight_manifest

    learner, worker = two_models()
    before = [p.detach().clone() for p in worker.parameters()]
    paths = write_version(str(tmp_path), "L", 7, learner.named_parameters(), weight_manifest(learner), 2048)
    piece = tmp_path / "L-v7-1.safetensors"
    data = piece.read_bytes()
    if harm == "remove":
        piece.unlink()
    else:
        piece.write_bytes(data[:-1] + bytes([data[-1] ^ 1]) if harm == "flip" else data[:-3])
    loop = WorkerLoop({"exact": True}, None, types.SimpleNamespace(model=worker), None, None)
    refusal = loop.offer_file(7, paths[-1])
    assert refusal is not None and re.match(line, refusal), refusal
    assert loop.versions == {} and all(torch.equal(p, q) for p, q in zip(before, worker.parameters()))


def test_a_file_sync_keeps_two_versions_and_the_pool_removes_its_files_at_the_end(monkeypatch, tmp_path):
    """Each version's pieces and manifest replace the version before last; closing the pool removes the rest."""
    from tokengym.agents.engine.messages import manifest

    pool = bare_pool()
    named = weights_of_a_model()
    pool.sync_dir, pool.learner, pool.named, pool.manifest = str(tmp_path), "L", lambda: iter(named), manifest(named)
    pool.bucket, pool.store = 1024, None
    monkeypatch.setattr(R, "call", lambda *a: (200, b'{"ok": true}'))
    for v in (1, 2, 3):
        pool.publish(v)
    left = sorted(os.listdir(tmp_path))
    assert {f.split("-")[1].split(".")[0] for f in left} == {"v2", "v3"} and "L-v3.json" in left
    assert len(left) > 4  # pieces (the 4800-byte tensor alone), not one file a version
    pool.close()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- Ctrl-C
def test_closing_after_ctrl_c_does_not_wait_for_a_sync_in_flight_and_still_ends_the_sessions(monkeypatch):
    """A sync stuck on a frozen worker (forced: its ``send`` blocks until the test lets it go, as a real one would
    for ``--sync-timeout``) while Ctrl-C closes the pool: the close returns without waiting for it and without
    sending the stop message behind it, and the worker's session is still ended."""
    import threading

    pool = bare_pool()
    pool.store = object()
    stuck, release = threading.Event(), threading.Event()

    def send(syncs, version, named, manifest, bucket):
        stuck.set()
        release.wait()
        return 0.0

    asked = []
    monkeypatch.setattr(R, "send", send)
    monkeypatch.setattr(R, "send_stop", lambda syncs: asked.append("stop"))
    monkeypatch.setattr(R, "call", lambda address, path, body, secret, timeout, tls=None: asked.append(path) or (200, b"{}"))
    pool.publish(3, wait=False)
    assert stuck.wait(60)
    closing = threading.Thread(target=pool.close, args=(True,), daemon=True)
    closing.start()
    closing.join(60)  # (a generous bound: the sync never ends on its own, so a close that waits for it never returns)
    try:
        assert not closing.is_alive(), "closing after Ctrl-C waited for the sync in flight"
        assert asked == ["/v1/leave"] and pool.live == {}
    finally:
        release.set()


SECRET = "ctrl-c-test-secret"


def start_worker():
    """A ``tokengym worker`` on loopback in a process group of its own; ``(process, address)`` once it listens."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", "worker", "--listen", "127.0.0.1:0",
                             "--threads", "1"], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TOKENGYM_SECRET=SECRET))
    found = re.search(r"listening on (\S+) ", proc.stdout.readline())
    assert found, "the worker did not start"
    return proc, found.group(1)


@pytest.mark.slow  # (about 75 s alone: two runs of the CLI and a worker)
def test_ctrl_c_while_a_worker_stopped_answering_exits_within_one_sync_timeout_and_the_run_resumes(tmp_path):
    """A remote worker frozen (SIGSTOP) while the learner trains, so a sync waits on it; Ctrl-C to the learner: it
    exits with its one line within one --sync-timeout and a few seconds (it used to wait out the sync in flight,
    and then the stop message), and the run resumes from its last checkpoint to the end."""
    import json

    timeout = 20
    worker, address = start_worker()
    env = dict(os.environ, TOKENGYM_SECRET=SECRET)
    run = tmp_path / "r"
    args = ["train", "grpo", "--steps", "12", "--prompts", "2", "--group-size", "4", "--eval-prompts", "0",
            "--threads", "1", "--progress", "false", "--save-every", "1", "--async-mode", "bounded",
            "--max-staleness", "1", "--rollout-workers", address, "--sync-timeout", str(timeout)]
    learner = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", *args, "--runs-dir", str(tmp_path),
                                "--name", "r"], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while learner.poll() is None and time.monotonic() < deadline:
            if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        assert learner.poll() is None, learner.stderr.read().decode()[-2000:]
        os.killpg(worker.pid, signal.SIGSTOP)
        learner.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout + 10  # (a generous bound: the fix exits in a few seconds)
        while learner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        exited = learner.poll() is not None
    finally:
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
            learner.wait()
        os.killpg(worker.pid, signal.SIGCONT)
    try:
        err = learner.stderr.read().decode()
        assert exited, f"the learner was still running {timeout + 10} s after Ctrl-C"
        assert learner.returncode == 130 and err.strip().splitlines()[-1] == "tokengym: interrupted", err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        resumed = subprocess.run([sys.executable, "-m", "tokengym.agents.cli", "train", "grpo", "--resume", str(run),
                                  "--progress", "false"], env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1] == 12 and sorted(set(steps)) == list(range(steps[0], 13))
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()

"""Rollout workers anywhere (agents/engine/remote.py): ``tokengym worker`` servers on loopback, each its own process
tree, serving 1-process and torchrun (FSDP2) learners; typed messages and the named, bucketed weight sync."""

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import gymnasium as gym
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tokengym.agents import GRPOAgent, GRPOConfig, Policy
from tokengym.agents.engine import messages as M
from tokengym.agents.engine.remote import call
from tokengym.agents.engine.rollout import collect
from tokengym.agents.engine.sources import WorkerError
from tokengym.agents.engine.worker_loop import weight_manifest
from tokengym.agents.runtime.weight_sync import WeightSync, WeightSyncError, layout, send, views
from tokengym.envs import TokenVectorEnv

SECRET = "loopback-test-secret"
FAST = dict(steps=4, lr=1e-3, mu=1, minibatches=1, seed=3)


def start_worker(port: int = 0, secret: str = SECRET) -> tuple[subprocess.Popen, str]:
    """A ``tokengym worker`` in a process group of its own; ``(process, "127.0.0.1:PORT")`` once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", "worker", "--listen", f"127.0.0.1:{port}",
                             "--threads", "1"], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TOKENGYM_SECRET=secret))
    line = proc.stdout.readline()
    found = re.search(r"listening on (\S+) ", line)
    assert found, f"the worker did not start: {line!r}"
    return proc, found.group(1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def pair():
    """Two workers that the tests below share (none of them harms its worker)."""
    procs = [start_worker() for _ in range(2)]
    yield [a for _, a in procs]
    for p, _ in procs:
        stop(p)


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("TOKENGYM_SECRET", SECRET)


def make_env():
    return gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4,
                        )


def learner(**kw):
    return GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**{**FAST, **kw}))


def changing(history):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in history]


# ---------------------------------------------------------------------------------------------- messages and weights
def test_a_rollout_crosses_as_json_and_safetensors_and_comes_back_equal():
    env = TokenVectorEnv(4, "arithmetic", group_size=2, max_new_tokens=6)
    policy = Policy.from_pretrained("tiny-arithmetic")
    ro = collect(env, policy, seed=0)
    ro.policy_version = 7
    stream = {"env": env.state_dict(), "rng": policy.generator.get_state()}
    data = M.encode_rollout(ro, {"index": 3, "worker": 1, "seconds": 0.5}, stream)
    assert data[8:9] == b"{"  # a JSON header, then safetensors: nothing a reader would unpickle
    back, meta, stream2 = M.decode_rollout(data)

    def same(v, w):
        if isinstance(v, torch.Tensor):
            return v.dtype == w.dtype and torch.equal(v, w)
        if isinstance(v, dict):
            return v.keys() == w.keys() and all(same(v[k], w[k]) for k in v)
        return v == w

    for name, v in vars(ro).items():
        assert same(v, getattr(back, name)) or name == "samples", name
    assert [s["prompt"] for s in back.samples] == [s["prompt"] for s in ro.samples]
    assert meta["index"] == 3 and torch.equal(stream2["rng"], stream["rng"]) and stream2["env"]["next_group"] == 2
    with pytest.raises(M.MessageError, match="^a message's header claims"):
        M.decode(b"\xff" * 16)
    with pytest.raises(M.MessageError, match=r"^a rollout of tokens \(4, \d+\) torch.int64, and this learner's env makes "
                                              r"\(8, \d+\) integer tokens"):
        M.check_rollout(back, 8, ro.tokens.shape[1], range(6, 8))
    with pytest.raises(M.MessageError, match="^a rollout sampled by policy version 7, outside 4..6"):
        M.check_rollout(back, 4, ro.tokens.shape[1], range(4, 7))


def test_a_manifest_or_weights_that_do_not_fit_the_model_are_refused_in_one_line():
    mine = weight_manifest(Policy.from_pretrained("tiny-arithmetic").model)
    name, shape, dtype = mine[1]
    wrong = [list(e) for e in mine]
    wrong[1][1] = [shape[0] + 1, *shape[1:]]
    with pytest.raises(M.MessageError, match=rf"^weights '{re.escape(name)}' are \[{shape[0] + 1}"):
        M.check_manifest(wrong, mine)
    with pytest.raises(M.MessageError, match="^weights name 'extra.weight', which this worker's model does not have"):
        M.check_manifest([*mine, ["extra.weight", [1], "float32"]], mine)
    with pytest.raises(M.MessageError, match="^the weights lack"):
        M.check_manifest(mine[:-1], mine)
    with pytest.raises(M.MessageError, match="^weights 'b' hold non-finite values"):
        M.check_weights([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("nan")]))])


@pytest.mark.parametrize("bucket", [64, 1000, 1 << 20])
def test_the_bucketed_stream_reassembles_every_tensor_exactly(bucket):
    """Tensors of several dtypes and odd sizes, split across buckets (or one bucket): each arrives bit for bit at its
    view of the receiver's stream; the sender never holds more than one bucket."""
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(7, 13, generator=g)), ("b", torch.randn(301, generator=g).to(torch.bfloat16)),
             ("c", torch.randint(0, 9, (5, 3), generator=g)), ("d", torch.randn(1000, generator=g))]
    manifest = M.manifest(named)
    _, total = layout(manifest)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    got = {}

    def worker():
        sync = WeightSync(WeightSync.connect(store.port, 1), 1, 1, 30, "cpu")
        version, buf = sync.receive(lambda n: torch.empty(n, dtype=torch.uint8), manifest)
        got.update(version=version, tensors=views(buf, manifest))
        sync.answer(version)

    t = threading.Thread(target=worker)
    t.start()
    sync = WeightSync(store, 0, 1, 30, "cpu")
    send([sync], 5, iter(named), manifest, bucket)
    t.join(30)
    assert got["version"] == 5 and total >= sum(t.numel() * t.element_size() for _, t in named)
    assert sync._bucket.numel() == min(bucket, total)  # the one buffer the sender held
    for (_, want), have in zip(named, got["tensors"]):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_a_worker_known_gone_during_a_sync_is_lost_at_once_not_late():
    """The worker took the bytes but will never answer, and the learner already knows it is gone (its fetcher's
    connection closed): the sync ends at once, as a lost worker (``lost`` set, so a pool stops in its one line or goes
    on without it), not as a sync that waited out its timeout."""
    manifest = M.manifest([("a", torch.ones(3))])
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    took = threading.Event()

    def worker():  # receives version 1, never answers
        sync = WeightSync(WeightSync.connect(store.port, 1), 1, 1, 30, "cpu")
        sync.receive(lambda n: torch.empty(n, dtype=torch.uint8), manifest)
        took.set()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    sync = WeightSync(store, 0, 1, 300, "cpu")
    sync.names = {1: "rollout worker w:1"}
    sync.gone = lambda: "RemoteDisconnected: closed" if took.is_set() else None
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as caught:
        send([sync], 1, iter([("a", torch.ones(3))]), manifest)
    assert time.monotonic() - t0 < 60 and caught.value.lost == "RemoteDisconnected: closed" and caught.value.sync is sync
    assert str(caught.value) == ("weight sync of policy version 1 failed: the connection to rollout worker w:1 broke "
                                 "(RemoteDisconnected: closed)")
    t.join(30)


# ---------------------------------------------------------------------------------------------- the worker's door
def test_a_worker_refuses_a_wrong_secret_unknown_messages_and_bad_joins(pair):
    address = pair[0]
    status, reply = call(address, "/v1/hello", {}, b"not-the-secret", 10)
    assert status == 401 and json.loads(reply) == {"error": "wrong or missing secret"}
    status, reply = call(address, "/v1/run_this", {}, SECRET.encode(), 10)
    assert status == 404 and "unknown message '/v1/run_this'" in json.loads(reply)["error"]
    status, reply = call(address, "/v1/join", {"protocol": 1}, SECRET.encode(), 10)
    assert status == 400 and json.loads(reply)["error"] == "a join message needs 'session' (str)"
    status, reply = call(address, "/v1/hello", {}, SECRET.encode(), 10)
    assert status == 200 and json.loads(reply)["busy"] is False
    import http.client

    host, port = address.rsplit(":", 1)
    for method, body, code, text in (("GET", None, 405, "every message is a POST"),
                                     ("POST", b"not json", 400, "the message is not JSON")):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request(method, "/v1/hello", body, {"Authorization": f"Bearer {SECRET}"})
        reply = conn.getresponse()
        assert reply.status == code and json.loads(reply.read())["error"].startswith(text)
        conn.close()


def test_a_worker_refuses_weights_of_the_wrong_shape_at_join_and_nan_weights_at_sync(pair, secret, tmp_path):
    env = make_env()
    agent = learner(async_mode="one-step", remote_workers=pair[0])
    with torch.no_grad():  # a layer of the wrong width: the learner's manifest names it
        agent.policy.model.lm_head.weight = torch.nn.Parameter(torch.zeros(3, 7))
    with pytest.raises(WorkerError, match=r"^rollout worker 127.0.0.1:\d+ refused to join: weights 'lm_head.weight' are "
                                          r"\[3, 7\] float32, and this worker's model has \[\d+, \d+\] float32$"):
        agent.learn(env)
    agent = learner(async_mode="one-step", remote_workers=pair[0])
    with torch.no_grad():
        next(agent.policy.model.parameters())[0, 0] = float("nan")
    with pytest.raises(WorkerError, match=r"^rollout worker 127.0.0.1:\d+ refused policy version 0: weights '[\w.]+' "
                                          r"hold non-finite values \(NaN or inf\)$"):
        agent.learn(env)
    agent.config.sync_dir = str(tmp_path)  # the same weights as a file in a shared folder
    with pytest.raises(WorkerError, match=r"^rollout worker 127.0.0.1:\d+ refused policy version 0: weights '[\w.]+' "
                                          r"hold non-finite values \(NaN or inf\)$"):
        agent.learn(env)


# ---------------------------------------------------------------------------------------------- learners
def test_remote_workers_equal_local_workers_bit_for_bit(pair, secret, tmp_path):
    """One-step-off with 2 remote workers (weights over a group, or as files in a shared folder) and with 2 local
    worker processes: the same rollouts, metrics and weights."""
    remote, local = learner(async_mode="one-step", remote_workers=",".join(pair)), learner(async_mode="one-step",
                                                                                          rollout_workers=2)
    files = learner(async_mode="one-step", remote_workers=",".join(pair), sync_dir=str(tmp_path))
    h_remote, h_local, h_files = remote.learn(make_env()), local.learn(make_env()), files.learn(make_env())
    assert changing(h_remote) == changing(h_local) == changing(h_files)
    assert not list(tmp_path.iterdir())  # the run's weight files are gone with it
    assert [r["async/workers"] for r in h_remote] == [2.0] * FAST["steps"]
    start = Policy.from_pretrained("tiny-arithmetic").model.state_dict()
    a, b = remote.policy.model.state_dict(), local.policy.model.state_dict()
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-5  # it trained
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_lost_worker_ends_the_run_in_one_line_or_the_run_goes_on_and_it_rejoins(secret, monkeypatch):
    from tokengym.agents.engine.remote import RemoteWorkers

    procs = [start_worker() for _ in range(2)]
    try:
        port = int(procs[1][1].rsplit(":", 1)[1])
        agent = learner(steps=40, async_mode="bounded", max_staleness=1, remote_workers=",".join(a for _, a in procs))
        with pytest.raises(WorkerError, match=rf"^rollout worker 127.0.0.1:{port} was lost before rollout \d+ \(.*\); the "
                                              "run stops \\(its checkpoints are intact"):
            agent.learn(make_env(), callback=lambda r: r["step"] != 2 or stop(procs[1][0]))
        procs[1] = start_worker(port)

        monkeypatch.setattr(RemoteWorkers, "PROBE_EVERY", 0.2)
        agent = learner(steps=12, async_mode="bounded", max_staleness=1, min_workers=1,
                        remote_workers=",".join(a for _, a in procs))

        def chaos(record):
            if record["step"] == 2:
                stop(procs[1][0])
            if record["step"] == 5:
                procs[1] = start_worker(port)  # the same address again

        with pytest.warns(Warning) as caught:
            history = agent.learn(make_env(), callback=chaos)
        assert len(history) == 12 and all(r["async/staleness"] <= 1 for r in history)
        live = [r["async/workers"] for r in history]
        assert 1.0 in live and live[-1] == 2.0 and live.index(1.0) >= 2  # lost, then back
        texts = [str(w.message) for w in caught]
        assert any("was lost before rollout" in t and "going on with 1 worker(s)" in t for t in texts)
        assert any("answered again and rejoins the run" in t for t in texts)
    finally:
        for p, _ in procs:
            stop(p)


def test_a_sync_that_cannot_complete_fails_within_its_timeout_and_a_killed_learners_workers_wait_again(secret, tmp_path):
    proc, address = start_worker()
    try:
        agent = learner(steps=30, async_mode="bounded", max_staleness=2, sync_timeout=2.0, remote_workers=address)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"weight sync of policy version \d+ failed: rollout worker {address} did "
                                              r"not take it within 2 s \(sync_timeout\)"):
            agent.learn(make_env(), callback=lambda r: r["step"] != 1 or os.killpg(proc.pid, signal.SIGSTOP))
        assert time.monotonic() - t0 < 60
        os.killpg(proc.pid, signal.SIGCONT)

        script = tmp_path / "learner.py"  # a learner SIGKILLed mid-run: its worker goes back to waiting
        script.write_text(
            "import gymnasium as gym, os, signal\nfrom tokengym.agents import GRPOAgent, GRPOConfig, Policy\n"
            "if __name__ == '__main__':\n"
            "    env = gym.make_vec('tokengym/Arithmetic-v0', num_envs=8, vectorization_mode='vector_entry_point', "
            "group_size=4, max_new_tokens=12)\n"
            f"    agent = GRPOAgent(Policy.from_pretrained('tiny-arithmetic'), GRPOConfig(steps=50, async_mode='one-step', "
            f"remote_workers='{address}'))\n"
            "    agent.learn(env, callback=lambda r: r['step'] != 2 or os.kill(os.getpid(), signal.SIGKILL))\n")
        killed = subprocess.run([sys.executable, str(script)], env=dict(os.environ), timeout=120)
        assert killed.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while json.loads(call(address, "/v1/hello", {}, SECRET.encode(), 10)[1])["busy"]:
            assert time.monotonic() < deadline, "the worker still serves a learner that was killed"
            time.sleep(0.2)
        history = learner(steps=2, async_mode="one-step", remote_workers=address).learn(make_env())
        assert len(history) == 2 and proc.poll() is None
    finally:
        stop(proc)


def test_a_torchrun_fsdp2_learner_with_two_tokengym_workers_equals_local_workers(pair, tmp_path, secret):
    """``torchrun --nproc_per_node=2 ... --sharding fsdp2``: one-step-off with the 2 remote workers equals the same run
    with 2 local workers bit for bit; the same learner with max_staleness 0 (synchronous through the workers) samples
    exactly what it trains (the gathered, bucketed weights arrive whole at every version). Its ranks together train
    on the global batch a 1-process learner gets from the same workers (the first two rollouts, of version 0, are the
    same: every rollout statistic equal)."""
    from tokengym.agents.cli import main

    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "dist_worker.py")
    common = ["train", "grpo", "--steps", "3", "--prompts", "2", "--group-size", "4", "--eval-prompts", "0",
              "--threads", "1", "--progress", "false", "--save-every", "0", "--lr", "1e-3", "--sharding", "fsdp2",
              "--runs-dir", str(tmp_path), "--sync-bucket-mb", "0.05"]
    runs = [[*common, "--name", "remote", "--async-mode", "one-step", "--rollout-workers", ",".join(pair)],
            [*common, "--name", "local", "--async-mode", "one-step", "--rollout-workers", "2"],
            [*common, "--name", "sync", "--async-mode", "bounded", "--max-staleness", "0", "--rollout-workers", pair[0]]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "torchrun.log", "w") as log:  # a file, not a pipe: nothing blocks on a full pipe
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-backend=c10d", worker,
                             str(tmp_path / "all_same"), json.dumps(runs)], stdout=log, stderr=subprocess.STDOUT,
                            timeout=300, env=dict(os.environ, TOKENGYM_SECRET=SECRET, OMP_NUM_THREADS="1")).returncode
    assert rc == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    a, b = (load_file(str(tmp_path / n / "model" / "model.safetensors")) for n in ("remote", "local"))
    start = Policy.from_pretrained("tiny-arithmetic").model.state_dict()
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-5
    assert all(torch.equal(a[k], b[k]) for k in a)
    single = [x for x in common if x not in ("--sharding", "fsdp2")]  # the same run, in this one process
    assert main([*single, "--name", "single", "--async-mode", "one-step", "--rollout-workers", ",".join(pair)]) == 0
    two, one = ([json.loads(line) for line in open(tmp_path / n / "metrics.jsonl")] for n in ("remote", "single"))
    keys = [k for k in one[0] if k.startswith(("reward/", "completion/"))]
    assert keys and [[r[k] for k in keys] for r in two[:2]] == [[r[k] for k in keys] for r in one[:2]]
    metrics = [json.loads(line) for line in open(tmp_path / "sync" / "metrics.jsonl")]
    gaps = [r["mismatch/abs_gap_max"] for r in metrics if "mismatch/abs_gap_max" in r]
    assert len(gaps) == 3 and max(gaps) < 1e-4
    assert [r["async/staleness"] for r in metrics if "async/staleness" in r] == [0.0] * 3

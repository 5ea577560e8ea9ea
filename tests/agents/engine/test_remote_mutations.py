"""The learner's side of rollout workers where a mutation pass found it untested (issue 52): the worker's door refuses
a Content-Length it cannot read, a resumed learner's workers start after the checkpoint's queued rollouts, the rollout
timeout holds for remote workers, the checkpoint keeps each worker's stream, the staleness window is exact, a bounded
checkpoint keeps nothing past the run's last rollout, and a manifest in another order is refused.

The pool's bookkeeping is driven by :class:`Feed`, a pool whose workers' messages are given in advance (real encoded
rollout messages); the rest talks to a :class:`~tokengym.agents.engine.remote.WorkerServer` in this process on
loopback."""

import dataclasses
import queue
import socket
import threading
import types

import gymnasium as gym
import pytest
import torch

from tokengym.agents import Policy
from tokengym.agents.engine import remote
from tokengym.agents.engine.messages import MessageError, check_manifest, encode_rollout
from tokengym.agents.engine.remote import RemoteWorkers, WorkerServer, call, parse_address
from tokengym.agents.engine.rollout import collect
from tokengym.agents.engine.worker_loop import weight_manifest
from tokengym.agents.engine.worker_pool import WorkerError, WorkerPool
from tokengym.envs import TokenVectorEnv

pytestmark = pytest.mark.usefixtures("one_thread")

SECRET = b"mutation-test-secret"


# ---------------------------------------------------------------------------------------------- a pool fed in advance
class Feed(WorkerPool):
    """A pool whose workers' rollout messages are given in advance, in arrival order."""

    def __init__(self, messages, **kw):
        super().__init__(**kw)
        self.messages = list(messages)

    def _message(self, waiting_for=None, wait=True):
        if self.messages:
            return self.messages.pop(0)
        if wait:
            raise AssertionError(f"the test gave no rollout {waiting_for}")
        return None

    def _send(self, version):
        return 0.0

    def _shutdown(self):
        pass


@pytest.fixture(scope="module")
def template():
    return collect(TokenVectorEnv(2, "arithmetic", max_new_tokens=2), Policy.from_pretrained("tiny-arithmetic"), seed=0)


def stream(text):
    return {"env": text, "rng": torch.arange(3, dtype=torch.uint8)}


def message(ro, j, version, worker):
    """Rollout ``j`` as worker ``worker`` sends it, sampled by ``version``; its stream after it is ``after j``."""
    return encode_rollout(dataclasses.replace(ro, policy_version=version),
                          {"index": j, "worker": worker, "seconds": 0.0}, stream(f"after {j}"))


def feed(ro, messages, *, k, exact=False, total=None, state=None, workers=1):
    return Feed(messages, max_staleness=k, exact=exact, state=state, workers=workers, total=total, rollout_timeout=1.0,
                rows=ro.tokens.shape[0], width=ro.tokens.shape[1], device="cpu")


@pytest.mark.parametrize("version", [2, 3, 4, 5, 6])
def test_a_rollout_is_accepted_exactly_within_its_staleness_window(template, version):
    """K = 2: rollout 5 may come from versions 3..5 and no other; one outside is the worker's fault (named) when it
    arrives, before the learner could train on it or checkpoint it."""
    pool = feed(template, [message(template, 5, version, 0)], k=2, state={"next": 5, "queue": [], "streams": [None]})
    if 3 <= version <= 5:
        ro, metrics = pool.take(5)
        assert ro.policy_version == version and metrics["async/staleness"] == 5 - version
        return
    with pytest.raises(WorkerError, match=rf"^rollout worker 0 sent a rollout this learner refuses: a rollout sampled "
                                          rf"by policy version {version}, outside 3..5$"):
        pool.take(5)


def test_the_checkpoint_keeps_each_workers_stream_after_its_last_taken_rollout(template):
    """Two workers, both rollouts taken, none queued: the checkpoint's streams are each worker's after its taken
    rollout, so a resumed worker goes on from there (not from where the run started)."""
    start = {"next": 0, "queue": [], "streams": [{"env": "s0", "rng": [9]}, {"env": "s1", "rng": [9]}]}
    pool = feed(template, [message(template, 0, 0, 0), message(template, 1, 0, 1)], k=1, state=start, workers=2)
    pool.take(0)
    pool.take(1)
    state = pool.state_dict()
    assert state["next"] == 2 and state["queue"] == []
    assert [s["env"] for s in state["streams"]] == ["after 0", "after 1"]
    assert state["streams"][0]["rng"] == [0, 1, 2]


def test_a_bounded_checkpoint_keeps_no_rollout_past_the_runs_last(template):
    """A 3-rollout run (K = 3) whose worker sampled past its end: the checkpoint after step 0 keeps rollouts 1 and 2
    and not 3, which the run never trains on; the worker's stream is the one after rollout 2."""
    msgs = [message(template, j, 0, 0) for j in range(4)]
    pool = feed(template, msgs, k=3, total=3)
    pool.take(0)
    state = pool.state_dict()
    assert [m["index"] for m in state["queue"]] == [1, 2]
    assert [s["env"] for s in state["streams"]] == ["after 2"]


def test_a_manifest_with_the_same_tensors_in_another_order_is_refused():
    """The stream is laid out by the manifest's order: two tensors of one shape and dtype swapped would load each
    into the other's parameter, so a manifest that differs only in order is refused."""
    mine = weight_manifest(Policy.from_pretrained("tiny-arithmetic").model)
    i, j = next((a, b) for a in range(len(mine)) for b in range(a + 1, len(mine)) if mine[a][1:] == mine[b][1:])
    theirs = [list(e) for e in mine]
    theirs[i], theirs[j] = theirs[j], theirs[i]
    check_manifest([list(e) for e in mine], mine)
    with pytest.raises(MessageError, match="another order"):
        check_manifest(theirs, mine)


# ---------------------------------------------------------------------------------------------- the rollout timeout
class Clock:
    now = 0.0

    def monotonic(self):
        return self.now


class SilentInbox(queue.Queue):
    """An inbox nothing arrives in: each poll takes one second of ``clock``; the test gives up after ``limit``."""

    def __init__(self, clock, limit):
        super().__init__()
        self.clock, self.limit, self.polls = clock, limit, 0

    def get(self, block=True, timeout=None):
        self.polls += 1
        if self.polls > self.limit:
            raise AssertionError(f"still waiting for a rollout after {self.limit} s of polls")
        self.clock.now += 1.0
        raise queue.Empty


def test_remote_workers_give_up_on_a_rollout_after_rollout_timeout(template, monkeypatch):
    """No rollout comes from the remote workers: the learner waits rollout_timeout (5 s of a fake clock, one second a
    poll) and then stops in one line, neither sooner nor forever."""
    clock = Clock()
    monkeypatch.setattr(remote, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    pool = RemoteWorkers.__new__(RemoteWorkers)
    WorkerPool.__init__(pool, max_staleness=1, exact=True, state=None, workers=1, total=None, rollout_timeout=5.0,
                        rows=2, width=template.tokens.shape[1], device="cpu")
    pool.inbox, pool.generation, pool.back, pool.lost, pool.live = SilentInbox(clock, 100), 1, set(), {}, {}
    pool.addresses = ["127.0.0.1:9"]
    with pytest.raises(WorkerError, match=r"^no rollout 0 came from the rollout workers for 5 s \(rollout_timeout\)"):
        pool.take(0)
    assert 5.0 < clock.now <= 6.0


# ---------------------------------------------------------------------------------------------- a worker on loopback
@pytest.fixture(scope="module")
def worker():
    server = WorkerServer("127.0.0.1", 0, secret=SECRET, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.address
    server.close()
    thread.join(30)


def post_raw(address, length):
    """A /v1/hello with ``Content-Length: length`` as given; ``(status, body)``."""
    host, port = parse_address(address)
    head = (f"POST /v1/hello HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {SECRET.decode()}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n{{}}")
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(head.encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def test_the_workers_door_refuses_a_content_length_it_cannot_read(worker):
    """A Content-Length that is not a number is refused (the body's end is unknown), not read as an empty message;
    the worker serves the next request as before."""
    for length in ("abc", "1e3", "0x10"):
        status, body = post_raw(worker, length)
        assert 400 <= status < 500 and b"Content-Length" in body, (length, status, body)
    status, body = post_raw(worker, "2")
    assert status == 200 and b'"protocol"' in body


def rollout_equal(a, b):
    return (a.policy_version == b.policy_version and torch.equal(a.tokens, b.tokens)
            and torch.equal(a.logprobs, b.logprobs) and torch.equal(a.rewards, b.rewards))


def test_a_resumed_learner_continues_after_the_checkpoints_queued_rollout(worker):
    """One-step schedule on one remote worker: the checkpoint after step 1 queues rollout 2; a learner resumed from
    it takes rollout 2 from the queue and has the worker start at rollout 3, so rollouts 2 and 3 equal the
    uninterrupted learner's bit for bit."""
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=4, vectorization_mode="vector_entry_point", group_size=2,
                       max_new_tokens=6)
    policy = Policy.from_pretrained("tiny-arithmetic")

    def pool(version, state):
        return RemoteWorkers([worker], SECRET, env, policy, rows=4, max_staleness=1, exact=True, version=version,
                             state=state, seed=3, timeout=60.0, rollout_timeout=120.0)

    first = pool(0, None)
    try:
        first.take(0)
        first.publish(1)
        first.take(1)
        state = first.state_dict()
        assert state["next"] == 2 and [m["index"] for m in state["queue"]] == [2]
        first.publish(2)
        want = [first.take(2)[0]]
        first.publish(3)
        want.append(first.take(3)[0])
    finally:
        first.close()
    resumed = pool(2, state)
    try:
        got = [resumed.take(2)[0]]
        resumed.publish(3)
        got.append(resumed.take(3)[0])
    finally:
        resumed.close()
    assert [r.policy_version for r in want] == [1, 2]
    assert all(rollout_equal(a, b) for a, b in zip(want, got))

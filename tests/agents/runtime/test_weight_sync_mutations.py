"""The weight sync where a mutation pass found it untested (issue 52): a tensor of exactly a quarter bucket is sent on
its own by the learner and expected on its own by the worker, and a learner waits for acknowledgements no longer than
sync_timeout. Both sides are real gloo ranks of one group, in two threads of this process."""

import datetime
import threading
import types

import pytest
import torch
import torch.distributed as dist

from tokengym.agents.engine import messages as M
from tokengym.agents.runtime import weight_sync as ws
from tokengym.agents.runtime.weight_sync import WeightSync, WeightSyncError, schedule, send, views


def learner_store():
    return dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def test_a_tensor_of_exactly_a_quarter_bucket_crosses_on_its_own_and_intact():
    """Bucket 256 bytes: ``b`` is 64 bytes, exactly bucket / 4, the smallest tensor sent from its own memory; ``d``
    (60 bytes) is the largest packed with its neighbours. The worker computes the same regions as the learner sends,
    so every tensor arrives bit for bit (at the 16 MiB default: a 4 MiB tensor)."""
    bucket = 256
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(8, generator=g)), ("b", torch.randn(16, generator=g)), ("c", torch.randn(8, generator=g)),
             ("d", torch.randn(15, generator=g)), ("e", torch.randn(3, generator=g))]
    manifest = M.manifest(named)
    assert (64, 128) in schedule(manifest, bucket)  # b's own region
    store = learner_store()
    got = {}

    def worker():
        try:
            sync = WeightSync(WeightSync.connect(store.port, 1, timeout=30), 1, 1, 30, "cpu")
            version, buf = sync.receive(lambda n: torch.empty(n, dtype=torch.uint8), manifest)
            got.update(version=version, tensors=[t.clone() for t in views(buf, manifest)])
            sync.answer(version)
        except Exception as e:  # noqa: BLE001 (the assertions below name it)
            got["error"] = e

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    sync = WeightSync(store, 0, 1, 30, "cpu")
    send([sync], 2, iter(named), manifest, bucket)
    t.join(60)
    assert "error" not in got and got["version"] == 2, got.get("error")
    for (name, want), have in zip(named, got["tensors"]):
        assert torch.equal(have, want), name


class Clock:
    """A fake clock for the sync's polling: each pause takes one second; the test gives up after ``limit``."""

    def __init__(self, limit):
        self.now, self.pauses, self.limit = 0.0, 0, limit

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.pauses += 1
        if self.pauses > self.limit:
            raise AssertionError(f"still waiting for an acknowledgement after {self.limit} s")
        self.now += 1.0


def test_a_learner_waits_for_an_acknowledgement_no_longer_than_sync_timeout(monkeypatch):
    """The worker takes version 1's bytes and never answers (and is not known to be gone): the learner waits its
    sync_timeout (5 s of a fake clock) and fails naming the worker as late, not as lost and not never."""
    manifest = M.manifest([("a", torch.ones(3))])
    store = learner_store()
    took = threading.Event()

    def worker():  # receives version 1, never answers
        sync = WeightSync(WeightSync.connect(store.port, 1, timeout=30), 1, 1, 30, "cpu")
        sync.receive(lambda n: torch.empty(n, dtype=torch.uint8), manifest)
        took.set()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    sync = WeightSync(store, 0, 1, 5, "cpu")
    sync.names = {1: "rollout worker w:1"}
    clock = Clock(limit=100)
    real = ws.time
    monkeypatch.setattr(ws, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep,
                                                          perf_counter=real.perf_counter))
    # (the broadcast itself is waited for in one blocking call here: its polling would spend the fake clock's pauses
    # while the worker's thread receives in real time; this test is about the acknowledgement's deadline)
    monkeypatch.setattr(ws, "_wait", lambda work, sync, version: work.wait())
    with pytest.raises(WeightSyncError) as caught:
        send([sync], 1, iter([("a", torch.ones(3))]), manifest)
    assert caught.value.lost is None and caught.value.sync is sync
    assert str(caught.value) == ("weight sync of policy version 1 failed: rollout worker w:1 did not take it within 5 s "
                                 "(sync_timeout) (no acknowledgement)")
    assert 5.0 < clock.now <= 6.0 and took.wait(30)
    t.join(30)

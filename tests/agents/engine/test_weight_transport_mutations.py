"""A worker's checks of the weights it receives (issue 52's missed mutations): over a real two-rank gloo sync, a
non-finite value in any tensor, the one that ends at the stream's end included, makes the worker refuse the version,
and the learner's error names the tensor; ``check_weights`` finds -inf as well as NaN and +inf; a safetensors file's
float16 and bfloat16 tensors are taken as what they are."""

import datetime
import threading
import types

import pytest
import torch
import torch.distributed as dist

from tokengym.agents.engine.messages import MessageError, check_weights, manifest
from tokengym.agents.engine.worker_loop import WorkerLoop, receive_checked
from tokengym.agents.runtime.weight_sync import WeightSync, WeightSyncError, layout, send, views

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _named(bad_name=None, bad=None):
    """Three float32 tensors; 'c' is 16 floats (64 bytes), so it ends exactly at the stream's end (aligned to 64).
    ``bad_name`` gets one ``bad`` value in its second element (not its first: a check that reads another tensor's
    bytes would miss it)."""
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(16, generator=g)), ("b", torch.randn(5, generator=g)), ("c", torch.randn(16, generator=g))]
    for name, t in named:
        if name == bad_name:
            t[1] = bad
    return named


def _sync_once(named, bucket):
    """Send ``named`` as version 5 over a 2-rank gloo group; the worker receives with :func:`receive_checked` and
    answers its refusal. Returns ``(learner's error or None, worker's refusal, worker's tensors)``."""
    mf = manifest(named)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    got = {}

    def worker():
        sync = WeightSync(WeightSync.connect(store.port, 1), 1, 1, 30, "cpu")
        version, buf, refusal = receive_checked(sync, mf, lambda n: torch.empty(n, dtype=torch.uint8))
        got.update(version=version, refusal=refusal, tensors=views(buf, mf))
        sync.answer(version, refusal)

    t = threading.Thread(target=worker)
    t.start()
    error = None
    try:
        send([WeightSync(store, 0, 1, 30, "cpu")], 5, iter(named), mf, bucket)
    except WeightSyncError as e:
        error = str(e)
    t.join(30)
    assert got["version"] == 5
    return error, got["refusal"], got["tensors"]


def test_the_last_tensor_ends_at_the_streams_end():
    """(What the refusal test below relies on: 'c' is the last tensor and fills the stream to its end.)"""
    offsets, total = layout(manifest(_named()))
    assert offsets[-1] + 16 * 4 == total


@pytest.mark.parametrize("bucket", [64, 1 << 20])  # each tensor on its own, and all in one bucket
def test_finite_weights_are_taken_bit_for_bit(bucket):
    named = _named()
    error, refusal, tensors = _sync_once(named, bucket)
    assert error is None and refusal is None
    for (_, want), have in zip(named, tensors):
        assert torch.equal(have, want)


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("bad_name", ["b", "c"])  # inside the stream, and the tensor that ends at its end
def test_a_non_finite_value_in_any_tensor_is_refused_and_named(bad_name, bad):
    error, refusal, _ = _sync_once(_named(bad_name, BAD[bad]), 1 << 20)
    assert refusal == f"weights {bad_name!r} hold non-finite values (NaN or inf)"
    assert error == f"rollout worker 0 refused policy version 5: {refusal}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_check_weights_finds_every_kind_of_non_finite_value(dtype, bad):
    t = torch.tensor([1.0, -2.0, 3.0], dtype=dtype)
    check_weights([("w", t), ("ints", torch.tensor([1, 2]))])  # finite: nothing to say
    t[1] = BAD[bad]
    with pytest.raises(MessageError, match=r"^weights 'w' hold non-finite values \(NaN or inf\)$"):
        check_weights([("ok", torch.zeros(2)), ("w", t)])


def _worker(model):
    return WorkerLoop({"exact": False}, None, types.SimpleNamespace(model=model), None, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_weights_file_is_taken_in_its_own_half_precision(tmp_path, dtype):
    """A worker whose model is float16 (bfloat16) takes a ``sync_dir`` version of float16 (bfloat16) tensors bit for
    bit, and refuses one of the other half precision in one line naming both dtypes."""
    from tokengym.agents.engine.sync_files import write_version

    model = torch.nn.Linear(4, 3).to(dtype)
    loop = _worker(model)
    g = torch.Generator().manual_seed(1)
    weights = {"weight": torch.randn(3, 4, generator=g).to(dtype), "bias": torch.randn(3, generator=g).to(dtype)}
    mine = [list(e) for e in loop.manifest]
    same = write_version(str(tmp_path), "r", 1, [(n, weights[n]) for n, _, _ in mine], mine, 1 << 20)[-1]
    assert loop.offer_file(1, same) is None
    for (name, _, _), have in zip(loop.manifest, views(loop.versions[1], loop.manifest)):
        assert have.dtype == dtype and torch.equal(have, weights[name])
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    ours, theirs = str(dtype).removeprefix("torch."), str(other).removeprefix("torch.")
    their_manifest = [[n, shape, theirs] for n, shape, _ in mine]
    path = write_version(str(tmp_path), "r", 2, [(n, weights[n].to(other)) for n, _, _ in mine], their_manifest,
                         1 << 20)[-1]
    assert loop.offer_file(2, path) == f"weights 'weight' are [3, 4] {theirs}, and this worker's model has [3, 4] {ours}"
    assert 2 not in loop.versions

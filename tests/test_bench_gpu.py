"""``bench/gpu.py`` end to end on the CPU (``--smoke``: tiny sizes, in process), its real model shapes, and its
refusal to run the full bench without a GPU. The GPU figures themselves need a lent GPU (bench/RESULTS.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits at barriers


@pytest.fixture(scope="module")
def gpu():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


def run(gpu, monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["gpu.py", *argv])
    gpu.main()
    return capsys.readouterr()


def test_the_models_have_their_published_sizes(gpu):
    """Qwen2.5-0.5B: 0.49B parameters, 0.36B without the embedding; Qwen3-0.6B: 0.6B and 0.44B (their model cards)."""
    for name, total, body in (("qwen2.5-0.5b", 0.49, 0.36), ("qwen3-0.6b", 0.6, 0.44)):
        model, _ = gpu.build(name, smoke=False, device="meta")
        n = sum(p.numel() for p in model.parameters())  # tied embeddings count once
        emb = model.get_input_embeddings().weight.numel()
        assert (round(n / 1e9, 2 if total < 0.5 else 1), round((n - emb) / 1e9, 2)) == (total, body), (name, n, emb)


def test_smoke_runs_every_contender_and_checks_varlen_against_padded(gpu, monkeypatch, capsys):
    out = json.loads(run(gpu, monkeypatch, capsys, "--smoke", "--json").out.strip().splitlines()[-1])
    assert out["smoke"] and out["device"] == "cpu" and out["cuda_graph_decode"].startswith("not measured")
    tokens = int(gpu.schedule(8, gpu.TINY["budget"]).sum())
    assert set(out["decode"]) == {"qwen2.5-0.5b/8", "qwen3-0.6b/8"} and set(out["update"]) == {"qwen2.5-0.5b", "qwen3-0.6b"}
    for group in out["decode"].values():
        tg, gen = group["tokengym"], group["generate"]
        assert tg["tokens"] == gen["tokens"] == tokens and tg["peak_mib"] is None
        assert group["tokengym_vs_generate"] == round(tg["tok_s"] / gen["tok_s"], 3)
    for model in ("qwen2.5-0.5b/8", "qwen3-0.6b/8"):  # both run on the fast decoder (Qwen3 with its q/k norms)
        assert out["decode"][model]["tokengym"]["fast_path"] is True, model
    for group in out["update"].values():
        assert group["packed_speedup"] == round(group["padded"]["seconds"] / group["packed"]["seconds"], 3)
        varlen = group["varlen"]
        assert varlen["kernel"] == out["varlen_kernel"] == "sdpa per segment (CPU stand-in)"
        # fp32, two layers: a wrong segment or position gives gaps of order 1; float rounding stays below 1e-5
        assert varlen["max_logp_gap"] < 1e-4, varlen


def test_without_cuda_the_full_bench_refuses_in_one_line(gpu, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run(gpu, monkeypatch, capsys, "--json")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "bench/gpu.py needs a CUDA device; use --smoke on CPU\n"

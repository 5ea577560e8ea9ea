"""``tokengym train --sampler vllm`` and bad input: what vLLM cannot serve is one line on stderr, exit 2 and no run
folder, found before the engine starts (these tests start none); a SIGTERM while the engine starts leaves no
temporary folder behind (that test stops the start it signals). Skipped where vLLM is not installed."""

import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest

from tokengym.agents.cli import main

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed: pip install 'tokengym[vllm]'"),
              pytest.mark.usefixtures("one_thread")]

V = ["train", "grpo", "--sampler", "vllm", "--steps", "1", "--prompts", "2", "--group-size", "2", "--eval-prompts",
     "0", "--progress", "false", "--threads", "1"]


@pytest.fixture
def no_engine(monkeypatch):
    """An engine start fails the test: these refusals come before it."""
    import vllm

    def start(*args, **kwargs):
        raise AssertionError("the vLLM engine was started")

    monkeypatch.setattr(vllm, "LLM", start)


def one_line_exit_2(capsys, code: int, runs) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("tokengym: error: "), err
    assert not os.path.exists(runs)
    return err


def test_a_head_size_vllm_cannot_serve_is_refused_before_the_engine_starts(tmp_path, capsys, no_engine):
    """A model whose attention heads are 16 wide (tiny, 8 heads): vLLM's CPU attention serves none that narrow."""
    from tokengym.agents.engine.models import build_preset

    model, tok = build_preset("tiny", num_attention_heads=8, num_key_value_heads=8)
    model.save_pretrained(tmp_path / "narrow")
    tok.save_pretrained(tmp_path / "narrow")
    capsys.readouterr()  # save_pretrained's progress bar is the test's, not the command's
    code = main([*V, "--model", str(tmp_path / "narrow"), "--runs-dir", str(tmp_path / "runs"), "--name", "x"])
    err = one_line_exit_2(capsys, code, tmp_path / "runs")
    assert "its attention heads are 16 wide, and vLLM's CPU attention serves head sizes 32, 64," in err, err


def test_torchrun_with_the_vllm_sampler_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch, no_engine):
    """A 1-process torchrun launch (its environment variables; the rendezvous would succeed): refused before the
    process group is joined, so no model is loaded and no folder made."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    try:
        code = main([*V, "--runs-dir", str(tmp_path / "runs"), "--name", "x"])
    finally:
        joined = dist.is_initialized()
        if joined:
            dist.destroy_process_group()
    err = one_line_exit_2(capsys, code, tmp_path / "runs")
    assert "sampler='vllm' runs one engine in one learner process; data-parallel learners (torchrun)" in err, err
    assert not joined


def test_sigterm_while_the_engine_starts_leaves_no_temporary_folder(tmp_path):
    """The engine starts from the policy's weights written to a temporary folder: a SIGTERM sent as soon as the folder
    appears (the engine is starting) stops the run, and the folder is gone (as is any run folder)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", *V, "--runs-dir", str(tmp_path / "runs"),
                             "--name", "x"], env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        folders = []
        while not folders and proc.poll() is None:
            folders = [f for f in os.listdir(tmp) if f.startswith("tokengym-vllm-")]
            time.sleep(0.02)
        assert folders, f"the run ended before its engine started: {proc.stderr.read()[-2000:]}"
        proc.terminate()
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    assert [f for f in os.listdir(tmp) if f.startswith("tokengym-vllm-")] == [], err[-2000:]
    assert not os.path.exists(tmp_path / "runs" / "x")

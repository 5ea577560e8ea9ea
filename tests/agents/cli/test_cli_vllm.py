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


def test_a_model_vllm_has_no_implementation_of_is_refused_before_the_engine_starts(tmp_path, capsys, no_engine):
    """A tiny BioGpt: vLLM would serve it through its Transformers fallback, which patches transformers' BioGpt
    classes in this process, and the trainer's own forward then failed inside vLLM's compile wrapper (exit 1, a
    traceback, the run folder left)."""
    import torch
    from transformers import BioGptConfig, BioGptForCausalLM

    from tokengym.agents.engine.models import build_preset

    tok = build_preset("tiny")[1]
    torch.manual_seed(0)
    BioGptForCausalLM(BioGptConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=256)).save_pretrained(tmp_path / "bio")
    tok.save_pretrained(tmp_path / "bio")
    capsys.readouterr()
    code = main([*V, "--model", str(tmp_path / "bio"), "--runs-dir", str(tmp_path / "runs"), "--name", "x"])
    err = one_line_exit_2(capsys, code, tmp_path / "runs")
    assert "vLLM has no implementation of BioGptForCausalLM" in err and "sampler='tokengym'" in err, err


def test_an_engine_that_fails_to_start_is_one_line_naming_its_output_and_prints_nothing(tmp_path, capfd, monkeypatch):
    """What vLLM writes while it starts (below Python, on file descriptor 2) goes to a log file, not the screen; a
    start that fails names the file in its one line, and the file holds that output."""
    import vllm

    from tokengym.agents import Policy
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    def start(*args, **kwargs):
        os.write(2, b"NUMA binding: a C++ warning\n")
        os.write(1, b"an INFO line of vLLM's logger\n")  # its logger's stream, sys.stdout, is descriptor 1 outside pytest
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    monkeypatch.setattr(vllm, "LLM", start)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(ValueError) as caught:
        VLLMGenerator(Policy.from_pretrained("tiny"))
    out, err = capfd.readouterr()
    assert "NUMA" not in out + err and "INFO" not in out + err, (out, err)
    msg = str(caught.value)
    assert "\n" not in msg and msg.startswith("vLLM cannot load model LlamaForCausalLM: Engine core initialization "
                                             "failed"), msg
    log = msg.rsplit("(vLLM's output: ", 1)[1].rstrip(")")
    with open(log) as f:
        text = f.read()
    assert "NUMA binding: a C++ warning" in text and "an INFO line of vLLM's logger" in text, text


def test_vllm_prints_nothing_before_the_header_and_a_dead_end_in_a_rollout_is_one_line(tmp_path):
    """A real engine start: the first line on the screen (stdout and stderr together) is tokengym's header. The
    grammar's dead end is deeper than its shortest answer, so the check before the run passes it; the untrained
    model samples letters, vLLM's matcher refuses the special it samples there, and the run stops naming the prefix."""
    proc = subprocess.run([sys.executable, "-m", "tokengym.agents.cli", *V, "--model", "tiny", "--prompts", "4",
                           "--group-size", "4", "--env-kwargs", '{"grammar": {"regex": "[0-9]|[a-z]{3}\\u20ac"}}',
                           "--runs-dir", str(tmp_path / "runs"), "--name", "x"],
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("tokengym train grpo: tokengym/Arithmetic-v0 from tiny -> "), proc.stdout[-3000:]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert lines[-1].startswith("tokengym: error: the grammar of request ") and "is at a dead end after '" in lines[-1] \
        and "under vLLM" in lines[-1], proc.stdout[-3000:]

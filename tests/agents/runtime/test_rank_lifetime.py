"""Ranks end with their launcher: ``torchrun`` starts each rank in a session of its own, so when torchrun is SIGKILLed
(it cannot stop them then) only the kernel's parent-death signal, which every rank asks for when it joins
(``distributed.init``), ends them."""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).parents[3]
_spec = importlib.util.spec_from_file_location("_numerics", ROOT / "tests" / "agents" / "_numerics.py")
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)
_spec = importlib.util.spec_from_file_location("_processes", ROOT / "tests" / "_processes.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_ranks_die_when_torchrun_is_killed(tmp_path):
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--rdzv-endpoint=127.0.0.1:{numerics.free_port()}", "--rdzv-backend=c10d", "-m", "tokengym.agents.cli",
           "train", "grpo", "--steps", "100000", "--prompts", "2", "--group-size", "2", "--eval-prompts", "0",
           "--save-every", "0", "--threads", "1", "--progress", "false", "--runs-dir", str(tmp_path), "--name", "r"]
    with open(log, "w") as f:
        launcher = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=f, stderr=subprocess.STDOUT)
    ranks = []
    try:
        for _ in range(1200):  # until both ranks have joined the group (a bound on a hang, not a timing assertion)
            ranks = [p for p in P.descendants(launcher.pid) if "tokengym.agents.cli" in P.command(p)]
            if "tokengym train grpo:" in log.read_text() or launcher.poll() is not None:
                break
            time.sleep(0.5)
        assert launcher.poll() is None and len(ranks) == 2, log.read_text()[-3000:]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        for _ in range(120):  # generous: the kernel signals at once
            if not left(ranks):
                break
            time.sleep(0.5)
        assert not left(ranks), [f"{p} {P.command(p)}" for p in left(ranks)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in left(ranks):
            os.kill(p, signal.SIGKILL)


def left(ranks: list[int]) -> list[int]:
    """The ranks still running (a reused pid runs another command)."""
    return [p for p in ranks if P.alive(p) and "tokengym.agents.cli" in P.command(p)]

"""How a rank's process ends. With its launcher: ``torchrun`` starts each rank in a session of its own, so when
torchrun is SIGKILLed (it cannot stop them then) only the kernel's parent-death signal, which every rank asks for when
it joins (``distributed.init``), ends them. And by itself: past its work, ``distributed.exit_process`` runs the exit
handlers and leaves without the interpreter's teardown, where a process group's C++ threads can abort a finished run."""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tokengym.agents.runtime import distributed as D

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


RANK_EXIT = """
import atexit, os, sys
from tokengym.agents.runtime import distributed as D

class Teardown:  # stands for a C++ object whose destructor aborts at interpreter teardown (a joinable std::thread)
    def __del__(self, abort=os.abort):
        abort()

keep = Teardown()
atexit.register(lambda: open(sys.argv[1], "w").write("exit handlers ran"))
D.init()
D.shutdown(done=True)
sys.stdout.write("done (not flushed yet)")
D.exit_process(int(sys.argv[2]))
"""


def test_a_finished_rank_exits_after_the_exit_handlers_and_without_teardown(tmp_path):
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(numerics.free_port()), TORCHELASTIC_RUN_ID="t")
    run = lambda code: subprocess.run([sys.executable, "-c", RANK_EXIT, str(tmp_path / "atexit.txt"), str(code)],  # noqa: E731
                                      env=env, capture_output=True, text=True, timeout=300)
    out = run(0)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout == "done (not flushed yet)" and (tmp_path / "atexit.txt").read_text() == "exit handlers ran"
    assert run(1).returncode == -signal.SIGABRT  # a failed rank: a plain exit, teardown included (here: the abort)
    del env["TORCHELASTIC_RUN_ID"]  # not a torchrun rank: a plain exit
    assert run(0).returncode == -signal.SIGABRT


def test_a_plain_run_exits_as_usual():
    with pytest.raises(SystemExit) as e:
        D.exit_process(2)
    assert e.value.code == 2

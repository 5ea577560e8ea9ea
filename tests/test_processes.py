"""``tests/_processes.py``, which the session-end check of ``conftest.py`` uses: it finds a process a test left
behind, a stopped one too, names it and ends it."""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys

import pytest

_spec = importlib.util.spec_from_file_location("_processes", pathlib.Path(__file__).parent / "_processes.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_leftovers_names_and_ends_running_and_stopped_descendants():
    """A shell that started a sleeping grandchild, and a stopped child: both found (with their state and command),
    then gone; an ended process is not reported."""
    shell = subprocess.Popen(["sh", "-c", "sleep 307 & wait"])
    stopped = subprocess.Popen(["sleep", "308"])
    done = subprocess.Popen(["true"])
    done.wait()
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        for _ in range(200):  # (until the shell has started its child: a bound, not a timing assertion)
            if any("sleep 307" in P.command(p) for p in P.descendants(shell.pid)):
                break
            subprocess.run(["sleep", "0.05"])
        report = P.leftovers(os.getpid(), grace=0.5)
        assert sorted(r.split(" ", 2)[2] for r in report) == ["sh -c sleep 307 & wait", "sleep 307", "sleep 308"], report
        assert any(r.startswith(f"{stopped.pid} T ") for r in report), report
        assert shell.wait(timeout=60) == -signal.SIGKILL and stopped.wait(timeout=60) == -signal.SIGKILL
        assert P.leftovers(os.getpid(), grace=0) == []
    finally:
        for p in (shell, stopped):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()

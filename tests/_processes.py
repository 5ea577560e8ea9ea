"""The test suite's own processes, read from ``/proc`` (Linux): which descendants of a process are alive, and ending
the ones a test left behind. Used by ``conftest.py``'s end-of-session check and by tests that kill a launcher."""

import os
import signal
import time

KEEP = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")
"""Helpers that live as long as the process that started them, by design (their command line names them)."""


def _stat(pid: int) -> tuple[int, str] | None:
    """``(parent pid, state letter)`` of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # (the command name in parentheses may hold spaces)
    return int(fields[1]), fields[0]


def command(pid: int) -> str:
    """``pid``'s command line (empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    st = _stat(pid)
    return st is not None and st[1] != "Z"


def descendants(root: int) -> list[int]:
    """The live (non-zombie) descendants of ``root``, children before grandchildren."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None and st[1] != "Z":
            children.setdefault(st[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        kids = sorted(children.get(todo.pop(0), []))
        out += kids
        todo += kids
    return out


def leftovers(root: int, grace: float = 10.0) -> list[str]:
    """Descendants of ``root`` still alive after up to ``grace`` seconds (but the :data:`KEEP` helpers), each as
    ``"pid STATE command"``; they are then continued and SIGKILLed. Empty when none remain."""
    deadline = time.monotonic() + grace
    while True:
        left = [p for p in descendants(root) if not any(k in command(p) for k in KEEP)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report = []
    for pid in left:
        st = _stat(pid)
        report.append(f"{pid} {st[1] if st else '?'} {command(pid)[:200]}")
        for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process ends only once continued (or SIGKILLed)
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    return report

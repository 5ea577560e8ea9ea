"""Run one bench contender in a fresh Python process.

In one process, whichever trainer runs after another inherits its heap, imports and allocator state, which
slows it measurably (``bench/RESULTS.md``). So the speed benches run every contender as ``python <bench> --one ...``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_child(script: str, argv: list[str], timeout: float | None = None) -> Any:
    """``python script *argv`` in a fresh process; the JSON value of the last line it prints. A child still running
    after ``timeout`` seconds is killed (``RuntimeError``)."""
    try:
        out = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(argv)} ran past {timeout:.0f} s and was stopped") from None
    if out.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(argv)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trl_step_timer(state: dict, after_step: Any = None) -> Any:
    """A ``transformers`` ``TrainerCallback`` that adds each optimiser step's seconds to ``state["times"]`` and
    ``state["train_s"]``; ``after_step(step_state, control)``, if given, then evaluates or stops the run."""
    import time

    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            dt = time.perf_counter() - state["t0"]
            state["times"].append(dt)
            state["train_s"] += dt
            if after_step is not None:
                after_step(st, control)

    return Timer()

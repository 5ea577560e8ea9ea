"""Comparing two float32 computations of the same training run: gradients in lockstep, not weights.

Two code paths that are equal in exact arithmetic (trimmed vs full-width passes, rows left out of the backward,
1 vs 2 processes, packed vs stacked sequences, ...) sum the same terms in a different order, so their gradients
agree only up to float32 rounding. Comparing the *weights* after AdamW steps amplifies that without bound:
AdamW's first step is ``lr * g / (|g| + eps)``, i.e. ``lr * sign(g)``, so an entry whose gradient is at the
rounding level can move by ``+lr`` on one path and ``-lr`` on the other, and every later gradient is then
computed at (slightly) different weights, so the paths drift apart by more than rounding.

:class:`Lockstep` avoids both effects: a reference run records the gradients its optimisers step on; the run
under comparison records its own gradients at each optimiser step, then steps on the reference's instead. Its
weights and optimiser state therefore stay bit-identical to the reference's, so every compared gradient (and
every logged statistic) of the two runs is computed from the same weights and differs by rounding alone.
:func:`assert_gradients_match` checks that rounding with a tolerance derived from float32 arithmetic.

Run as a script, ``_numerics.py RECORD_DIR SCRIPT ARGS...`` runs ``SCRIPT ARGS...`` (e.g. ``dist_worker.py``
under ``torchrun``) and rank 0 saves every optimiser step's gradients to ``RECORD_DIR`` (see
:class:`RecordedSteps`), for a reference run in another process.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: the spacing of float32 numbers at 1

SAFETY = 4.0
"""Safety factor of :func:`rounding_tolerance` over the typical reassociation error (see there)."""


def rounding_tolerance(n_terms: int, safety: float = SAFETY) -> float:
    """Largest expected ``|g_a - g_b| / max|g_a|`` per tensor between two float32 computations of one gradient.

    Every gradient entry is built from float32 sums of at most ``n_terms`` products (bound it by the tokens
    in the minibatch times the widest layer: the backward sums over tokens for a weight gradient and over
    features for an activation gradient). Summing n terms in another order (another BLAS blocking, more or
    fewer zero-padding terms, partial sums per process) changes the result by about ``sqrt(n) * eps32``
    times the terms' magnitude (rounding errors add like a random walk; the worst case ``n * eps32`` needs
    every rounding to go one way), and a tensor's largest gradient entry stands in for that magnitude.
    ``safety`` covers the chaining of such sums through the layers. In the tests that use it the measured
    differences are 13x (2 vs 1 processes) to 1400x (trimmed passes) below this, and the wiring bugs tried (a
    lost token column, a live row left out of the backward, a lost rejected token, a dropped loss share, an
    all-reduce that halves) are 90x to 4000x above it.
    """
    return safety * EPS32 * math.sqrt(n_terms)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class Lockstep:
    """Context manager that watches every ``optimizer.step()`` in this process (any optimiser).

    Without ``replay`` it records each step's gradients (``steps``: one list per step, ``None`` where a
    parameter has no gradient): those are what the step uses, after backward, any all-reduce and clipping.
    With ``replay`` (the ``steps`` of a reference run, or :class:`RecordedSteps`) it records, per step, how
    its own gradients differ from the replayed ones (``diffs``) and then hands the replayed gradients to the
    optimiser, so the run follows the reference's weights exactly.
    """

    def __init__(self, replay=None):
        self.replay = replay
        self.steps: list[list[torch.Tensor | None]] = []
        self.diffs: list[list[tuple[float, float] | str]] = []
        self._handle = None

    def __enter__(self) -> "Lockstep":
        self._handle = register_optimizer_step_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _hook(self, optimizer, args, kwargs) -> None:
        params = _params(optimizer)
        if self.replay is None:
            self.steps.append([None if p.grad is None else p.grad.detach().clone() for p in params])
            return
        k = len(self.diffs)
        try:
            ref = self.replay[k]
        except IndexError:
            self.diffs.append([f"optimizer step {k + 1} has no counterpart in the reference run"])
            return
        if len(ref) != len(params):
            self.diffs.append([f"{len(params)} parameters against {len(ref)} in the reference"])
            return
        diffs: list[tuple[float, float] | str] = []
        for i, (p, g) in enumerate(zip(params, ref)):
            if (p.grad is None) != (g is None) or (g is not None and g.shape != p.shape):
                mine = None if p.grad is None else tuple(p.grad.shape)
                diffs.append(f"parameter {i}: gradient {mine} against {None if g is None else tuple(g.shape)}")
                continue
            if g is None:
                diffs.append((0.0, 0.0))
                continue
            diffs.append((float((p.grad - g).abs().max()), float(g.abs().max())))
            p.grad.copy_(g)
        self.diffs.append(diffs)


class RecordedSteps:
    """The gradients :func:`record_to` saves in ``folder``, one optimiser step at a time; ``steps[k]`` waits
    for step k while ``producer`` (a ``subprocess.Popen`` writing them) runs, and raises IndexError when the
    producer has finished without it (or after ``timeout`` seconds)."""

    def __init__(self, folder: str, producer=None, timeout: float = 300.0):
        self.folder, self.producer, self.timeout = folder, producer, timeout

    def __len__(self) -> int:
        return len([f for f in os.listdir(self.folder) if f.endswith(".pt")]) if os.path.isdir(self.folder) else 0

    def __getitem__(self, k: int) -> list[torch.Tensor | None]:
        path = os.path.join(self.folder, f"{k:06d}.pt")
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(path):
            running = self.producer is not None and self.producer.poll() is None
            if os.path.exists(path):
                break
            if not running or time.monotonic() > deadline:
                raise IndexError(k)
            time.sleep(0.01)
        return torch.load(path, weights_only=True)


def _full(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient as one tensor: an FSDP2 shard (DTensor) gathered from every rank (each rank must call it)."""
    if grad is None:
        return None
    full = getattr(grad, "full_tensor", None)
    return (full() if full is not None else grad).detach().clone()


def record_to(folder: str, save: bool = True):
    """Save the gradients of every optimiser step in this process to ``folder/NNNNNN.pt`` (each file appears
    complete: written under another name, then renamed); returns the hook's handle. Every rank of a sharded run
    installs it (gathering a sharded gradient takes them all); only the one with ``save`` writes."""
    os.makedirs(folder, exist_ok=True)
    count = [0]

    def hook(optimizer, args, kwargs):
        grads = [_full(p.grad) for p in _params(optimizer)]
        if not save:
            return
        path = os.path.join(folder, f"{count[0]:06d}.pt")
        torch.save(grads, path + ".tmp")
        os.replace(path + ".tmp", path)
        count[0] += 1

    return register_optimizer_step_pre_hook(hook)


def assert_gradients_match(diffs, n_steps: int, n_terms: int, what: str = "", safety: float = SAFETY) -> float:
    """Assert that a replaying :class:`Lockstep`'s ``diffs`` cover ``n_steps`` optimiser steps and that every
    gradient agreed with the reference's to :func:`rounding_tolerance` ``(n_terms)`` of that tensor's largest
    entry (an all-zero reference gradient must be matched exactly). Returns the largest ``diff / (tol * max|g|)``."""
    tol = rounding_tolerance(n_terms, safety)
    assert len(diffs) == n_steps, f"{what}: {len(diffs)} optimizer steps against {n_steps} in the reference run"
    worst = 0.0
    for step, per_param in enumerate(diffs, 1):
        for i, d in enumerate(per_param):
            assert not isinstance(d, str), f"{what} optimizer step {step}: {d}"
            err, scale = d
            assert err <= tol * scale, (f"{what} optimizer step {step}, parameter {i}: max |g - g_ref| = {err:.3g} "
                                        f"> {tol:.2g} x max |g_ref| = {tol * scale:.3g}")
            if scale > 0:
                worst = max(worst, err / (tol * scale))
    return worst


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_against_one(root, worker: str, two: list[list[str]], one: list[list[str]], main) -> list[list]:
    """Run the command lines ``two`` in a 2-process ``torchrun`` of ``worker`` (rank 0 records every optimiser
    step's gradients under ``root/grads``) and ``one`` in this process as a 1-process torch.distributed job in
    lockstep with it (``main``: the CLI's entry point); return each command's gradient diffs (see
    :class:`Lockstep`). The 2-process run's output is in ``root/two.log``."""
    import json
    import shutil
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(root / "two.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-backend=c10d", __file__, str(root / "grads"), worker,
         str(root / "two"), json.dumps(two)],
        env=env, stdout=log, stderr=subprocess.STDOUT, text=True)  # a file, not a pipe: nothing blocks on a full pipe
    threads = torch.get_num_threads()
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    recorded = RecordedSteps(str(root / "grads"), producer=proc)  # each step waits for the 2-process run's
    diffs = []
    try:
        with Lockstep(replay=recorded) as lockstep:
            for argv in one:
                start = len(lockstep.diffs)
                assert main(argv) == 0
                diffs.append(lockstep.diffs[start:])
        proc.wait(timeout=300)
    except BaseException:
        proc.terminate()  # torchrun passes SIGTERM on to its workers
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        log.close()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        torch.set_num_threads(threads)
    assert proc.returncode == 0, (root / "two.log").read_text()[-4000:]
    assert len(recorded) == sum(len(d) for d in diffs)  # no optimizer step of the 2-process run left over
    shutil.rmtree(root / "grads")  # ~100 MB of gradients, compared already
    return diffs


if __name__ == "__main__":
    import runpy

    record_dir, script, *script_args = sys.argv[1:]
    # the ranks hold the same (all-reduced, or gathered from FSDP2's shards) gradients: one saves them
    record_to(record_dir, save=os.environ.get("RANK", "0") == "0")
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")

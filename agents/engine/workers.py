"""Rollout worker processes: rollouts of an older policy version while the learner updates (async training).

:class:`RolloutWorkers` starts ``workers`` processes (``torch.multiprocessing``, spawn). Each holds its own copy of
the env (tool replies of a multi-turn env run there) and of the policy, takes the learner's weights by name over
:class:`~tokengym.agents.runtime.weight_sync.WeightSync`, and sends back finished rollouts tagged with the policy
version that sampled them, as typed messages (:mod:`~tokengym.agents.engine.messages`). The learner's side is a
:class:`~tokengym.agents.engine.sources.WorkerPool`; the worker's schedule is
:class:`~tokengym.agents.engine.worker_loop.WorkerLoop`, which remote workers (:mod:`~tokengym.agents.engine.remote`)
run too. Rollout ``j`` (the ``j``-th the learner will train on) is worker ``j % workers``'s, and is
sampled with a policy version ``v`` where ``v >= j - max_staleness``; the learner trains on it at step ``j``
(version ``j``), so its staleness ``j - v`` is at most ``max_staleness``.

* ``exact`` (one-step-off, and ``max_staleness = 0``): ``v = max(0, j - max_staleness)`` exactly. The schedule is
  fixed, so a run is deterministic, and ``max_staleness = 0`` is synchronous training, bit for bit.
* otherwise (bounded staleness): the newest version the worker holds when it starts the rollout, at least
  ``j - max_staleness``; which one depends on timing.

Worker ``i`` draws prompts and samples from its own stream (env seed and sampler seed ``seed + i``; worker 0's is
the synchronous run's). A checkpoint after step ``s`` holds rollouts sampled with versions before ``s``, which it does
not hold (exact modes: ``s .. s + max_staleness - 1``, waited for; bounded: those of them that have arrived, in
order, waiting for none), and each worker's stream position after the newest of its rollouts that it keeps;
rollouts further ahead are dropped and sampled again after a resume. So exact modes resume bit for bit, and bounded
runs resume within their staleness bound.

Faults: a worker that dies or fails stops the run with one line naming it (its checkpoints stay intact); workers
exit when the learner does, however it ends (the kernel kills them if it dies: ``PR_SET_PDEATHSIG``), and ignore
Ctrl-C, which the learner handles.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from typing import Any

import torch

from tokengym.agents.engine.config import ASYNC_MODES
from tokengym.agents.engine.messages import encode_rollout
from tokengym.agents.engine.models import skip_sklearn_import
from tokengym.agents.engine.remote import model_name
from tokengym.agents.engine.worker_pool import WorkerError, WorkerPool, full_named
from tokengym.agents.engine.worker_loop import WorkerLoop, weight_manifest
from tokengym.agents.runtime.distributed import die_with_parent
from tokengym.agents.runtime.weight_sync import DEFAULT_BUCKET, WeightSync, send, send_stop

__all__ = ["ASYNC_MODES", "RolloutWorkers", "WorkerError", "check_crosses", "check_workers"]



class RolloutWorkers(WorkerPool):
    """The learner's handle on its local rollout worker processes (see the module docstring).

    Args:
        env, policy: the run's env (every row of the global batch) and policy; each worker gets a copy (weights
            follow over the weight sync).
        workers: how many worker processes.
        max_staleness: ``K``; ``exact``: the fixed version schedule ``max(0, j - K)`` (one-step-off, ``K = 0``).
        version: the learner's policy version now (its ``global_step``); published at once unless ``publish=False``.
        state: :meth:`state_dict` of a checkpoint (resume), else ``None`` (a fresh run from rollout 0).
        seed: the run's seed (worker ``i`` seeds its env and sampler with ``seed + i``).
        threads: torch threads of each worker; ``bf16``: the rollout's autocast; ``timeout``: a weight sync's limit.
        sampler: each worker's rollout backend (:data:`~tokengym.agents.engine.backends.BACKENDS`): its copy of the
            policy, or an inference engine of its own that each received version is loaded into.
        total: the run's number of rollouts (``None``: open-ended); a bounded run's checkpoint keeps none past it.
        rollout_timeout: seconds the learner waits for a rollout it needs before stopping with a :class:`WorkerError`.
        bucket: bytes per weight-sync bucket. ``publish``: send ``version`` at once (else the caller does).
        rebuild: each worker builds its policy from the model's name (a sharded learner's policy cannot be copied).
    """

    def __init__(self, env: Any, policy: Any, *, workers: int, max_staleness: int, exact: bool, version: int,
                 state: dict[str, Any] | None, seed: int, threads: int = 1, bf16: bool = False, timeout: float = 300.0,
                 sampler: str = "tokengym", total: int | None = None, rollout_timeout: float = 1800.0,
                 bucket: int = DEFAULT_BUCKET, publish: bool = True, rebuild: bool = False):
        import torch.multiprocessing as mp

        if getattr(mp.current_process(), "_inheriting", False):  # the user's script, re-run by a worker being spawned,
            _exit_unguarded()  # reached its training: it has no __main__ guard (the learner names the cause)
        super().__init__(max_staleness=max_staleness, exact=exact, state=state, workers=workers, total=total,
                         rollout_timeout=rollout_timeout, rows=env.num_envs, width=env.seq_len, device=env.device)
        self.timeout, self.bucket = timeout, bucket
        self.named = lambda: full_named(policy.model)
        self.manifest = weight_manifest(policy.model)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        store = WeightSync.serve(workers, timeout)
        self.procs = []
        device = str(policy.device)
        script_classes = check_crosses(env)
        try:
            guard = WorkerError(f"the env uses a class defined in your script ({_main_name()}), so each worker runs the "
                                "script again to find it, and the script trained again there: put its training under "
                                "`if __name__ == \"__main__\":`, or define the class in a module")
            for i in range(workers):
                copy = {"model": model_name(policy), "temperature": float(getattr(policy, "temperature", 1.0))} \
                    if rebuild else policy
                spec = {"env": env, "policy": copy, "workers": workers, "worker": i, "k": max_staleness, "exact": exact,
                        "start": self.first, "stream": self.streams[i], "seed": seed + i, "port": store.port,
                        "threads": threads, "bf16": bf16, "device": device, "sampler": sampler}
                # the spec (the policy's weights) goes over a pipe of its own after the start: a spawned child that
                # dies before reading its start-up data would leave proc.start() writing it forever
                spec_in, spec_out = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, args=(spec_in, self.results), name=f"tokengym-rollout-{i}",
                                   daemon=True)
                with contextlib.nullcontext() if script_classes else _script_not_rerun():
                    proc.start()
                self.procs.append(proc)
                spec_in.close()
                try:
                    spec_out.send_bytes(_pack(spec))
                except OSError:  # it exited first (BrokenPipeError): named below, by its exit code
                    proc.join(5)
                finally:
                    spec_out.close()
            ready: set[int] = set()
            try:
                while len(ready) < workers:  # a worker that fails to start is named, not waited for
                    ready.add(self._next_message()[1])
            except WorkerError:
                if script_classes and any(p.exitcode == _UNGUARDED for p in self.procs):
                    raise guard from None
                raise
            self.sync = WeightSync(store, 0, workers, timeout, device)
            self.sync.names = self.names()
            self.sync.gone = self._gone
            self._previous_sigterm = None
            if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds the learner, closing the workers
                self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
            if publish:
                self.publish(version)
        except BaseException:
            self.close()
            raise

    def names(self) -> dict[int, str]:
        return {i + 1: f"rollout worker {i} (pid {p.pid})" for i, p in enumerate(self.procs)}

    def _name(self, worker: Any) -> str:
        return self.names().get(int(worker) + 1, "a rollout worker") if isinstance(worker, int) else "a rollout worker"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _send(self, version: int) -> float:
        return send([self.sync], version, self.named(), self.manifest, self.bucket)

    def _gone(self) -> str | None:
        dead = next((p for p in self.procs if p.exitcode is not None), None)
        return None if dead is None else f"{dead.name} (pid {dead.pid}) exited with {dead.exitcode}"

    def _check_alive(self, wait: float = 0.0) -> None:
        deadline = time.monotonic() + wait
        while wait and all(p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                raise WorkerError(f"rollout worker {i} (pid {p.pid}) died ({how}) before rollout {self.next}; the run "
                                  "stops (its checkpoints are intact: resume it)")

    def _next_message(self, waiting_for: int | None = None, wait: bool = True) -> tuple | None:
        t0 = time.monotonic()
        while True:
            try:
                msg = self.results.get(timeout=0.5) if wait else self.results.get_nowait()
            except queue_mod.Empty:
                if not wait:
                    return None
                self._check_alive()
                if waiting_for is not None and time.monotonic() - t0 > self.rollout_timeout:
                    i = waiting_for % self.workers
                    raise WorkerError(f"rollout worker {i} (pid {self.procs[i].pid}) sent no rollout {waiting_for} for "
                                      f"{self.rollout_timeout:g} s (rollout_timeout): a task's sample() or reward(), or "
                                      "a tool, may never return; the run stops (its checkpoints are intact: resume it)")
                self._pending_failed()
                continue
            if msg[0] == "error":
                _, i, text = msg
                raise WorkerError(f"rollout worker {i} (pid {self.procs[i].pid}) failed: {text}")
            return msg

    def _message(self, waiting_for: int | None = None, wait: bool = True) -> bytes | None:
        msg = self._next_message(waiting_for, wait)
        return None if msg is None else msg[1]

    def _shutdown(self) -> None:
        """Stop the workers (a stop message, then SIGTERM and SIGKILL for any that linger)."""
        if getattr(self, "_previous_sigterm", None) is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        sync = getattr(self, "sync", None)
        if sync is not None and all(p.exitcode is None for p in self.procs) and not self._in_flight():
            send_stop([sync])  # (after Ctrl-C a sync may still run: the workers are ended below instead)
        for p in self.procs:
            p.join(timeout=2.0)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=2.0)
            if p.exitcode is None:
                p.kill()
                p.join()
        with contextlib.suppress(Exception):
            self.results.close()
            self.results.cancel_join_thread()


def check_crosses(env: Any) -> bool:
    """Raise ``ValueError`` (one line) if ``env`` cannot be sent to a rollout worker process, which receives it
    pickled: a lock, a client or an open file in its attributes, or a class of a ``__main__`` that has no file.
    Checked before a run starts, not in the spawn. Returns whether the env refers to ``__main__`` (a task class
    defined in the user's script, which each worker then imports by running the script)."""
    import pickle

    try:
        data = pickle.dumps(env)
    except Exception as e:
        why = (str(e).splitlines() or [""])[0]
        raise ValueError(f"async training sends the env to each rollout worker process, and {type(env).__name__} cannot "
                         f"be pickled ({type(e).__name__}: {why}); create what cannot cross (a lock, a client, an open "
                         "file) on first use, or give the env __getstate__/__setstate__, or train with async_mode='off'") from None
    needs_main = b"__main__" in data
    if needs_main and not os.path.isfile(getattr(sys.modules["__main__"], "__file__", None) or ""):
        raise ValueError("async training sends the env to each rollout worker process, and it uses a class defined in "
                         "__main__ without a file (stdin, python -c, a notebook), which a worker cannot import; define "
                         "the class in a module, or train with async_mode='off'")
    return needs_main


def check_workers(policy: Any, env: Any, workers: int, threads: int) -> None:
    """Raise ``ValueError`` (one line) for more rollout workers than the machine can hold, before any is spawned: more
    worker processes than CPU cores, or more copies of the weights and a rollout's KV cache than free memory."""
    from tokengym.agents.engine.resources import available_memory_bytes, batch_memory_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers > cores:
        raise ValueError(f"rollout_workers={workers} is more worker processes than the {cores} CPU cores this process "
                         f"may use (each runs {threads} torch thread(s), beside the learner); use at most {cores}")
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    need = workers * (weights + batch_memory_bytes(policy.model, env.num_envs, env.seq_len, 0))
    free = available_memory_bytes(policy.device)
    if free is not None and need > free:
        raise ValueError(f"rollout_workers={workers} need at least {need / 2**30:.1f} GiB (a copy of the weights and a "
                         f"rollout's KV cache each), but {policy.device} has {free / 2**30:.1f} GiB free; use fewer workers")


_UNGUARDED = 87  # a spawned worker's exit code when the script it re-ran started training again


def _exit_unguarded() -> None:
    print("tokengym: this script trains when it is imported (no `if __name__ == \"__main__\":` guard); a rollout worker "
          "that re-ran it stops here", file=sys.stderr, flush=True)
    os._exit(_UNGUARDED)  # at once: no thread or store the script made may keep this process (and the learner) waiting


def _main_name() -> str:
    return getattr(sys.modules["__main__"], "__file__", None) or "__main__"


@contextlib.contextmanager
def _script_not_rerun():
    """Start a spawned worker without running the user's script (``__main__``) again in it: a plain script that
    trains without an ``if __name__ == "__main__":`` guard must not train again in every worker."""
    import types

    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------------------------------------- in the worker
def _pack(obj: Any) -> bytes:
    """The start-up spec (the env and the policy, pickled: the learner's own child on this machine, never another
    machine) as plain bytes, not torch's shared-memory tensors (whose file descriptors fail for some storages and
    outlive a killed sender). Everything after it is a typed message."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def _worker_main(spec_in: Any, results: Any) -> None:
    """A local rollout worker's process: :class:`WorkerLoop` with the learner's queue as its outbox."""
    die_with_parent()  # no worker outlives a killed learner
    skip_sklearn_import()  # before the spec's policy brings transformers in
    spec = _unpack(spec_in.recv_bytes())
    spec_in.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the learner stops us
    code = 0
    try:
        torch.set_num_threads(spec["threads"])
        env, policy, i = spec["env"], spec["policy"], spec["worker"]
        if isinstance(policy, dict):  # rebuilt from its name: the weights come with the first sync
            from tokengym.agents.engine.policy import Policy

            policy = Policy.from_pretrained(policy["model"], device=spec["device"], temperature=policy["temperature"])
        store = WeightSync.connect(spec["port"], spec["workers"])
        results.put(("ready", i))  # the learner joins the group only once every worker got this far
        sync = WeightSync(store, i + 1, spec["workers"], WeightSync.WORKER_TIMEOUT, spec["device"])

        def put(j: int, v: int, ro: Any, stream: dict, seconds: float) -> None:
            results.put(("rollout", encode_rollout(ro, {"index": j, "worker": i, "seconds": seconds}, stream)))

        WorkerLoop(spec, env, policy, sync, put).run()
    except BaseException as e:  # one line to the learner, which names this worker
        code = 1
        with contextlib.suppress(Exception):
            results.put(("error", spec["worker"], f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]))
    with contextlib.suppress(Exception):
        results.close()
        results.join_thread()  # what was put reaches the learner before the process ends
    os._exit(code)

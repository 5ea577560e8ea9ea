"""Rollout worker processes: rollouts of an older policy version while the learner updates (async training).

:class:`RolloutWorkers` starts ``workers`` processes (``torch.multiprocessing``, spawn). Each holds its own copy of
the env (tool replies of a multi-turn env run there) and of the policy, takes the learner's weights over
:class:`~tokengym.agents.runtime.weight_sync.WeightSync`, and sends back finished rollouts tagged with the policy
version that sampled them. Rollout ``j`` (the ``j``-th the learner will train on) is worker ``j % workers``'s, and is
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
import dataclasses
import json
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from typing import Any

import torch

from tokengym.agents.engine.generation import make_sampler
from tokengym.agents.engine.rollout import Rollout, collect
from tokengym.envs.masks import TokenMasks
from tokengym.agents.runtime.weight_sync import STOP, WeightSync, WeightSyncError

__all__ = ["ASYNC_MODES", "RolloutWorkers", "WorkerError", "check_crosses", "check_workers"]

ASYNC_MODES = ("off", "one-step", "bounded")


class WorkerError(RuntimeError):
    """A rollout worker died or failed; the message names it."""


def _rollout_checkpoint(ro: Rollout) -> dict[str, Any]:
    """A :class:`Rollout` as a dict that ``torch.load(weights_only=True)`` loads: the task's samples (any Python
    values; no update reads them) as JSON text."""
    state = {f.name: getattr(ro, f.name) for f in dataclasses.fields(ro)}
    masks = state["token_masks"].state() if state.get("token_masks") is not None else None
    return {**state, "samples": json.dumps(state["samples"], default=repr), "token_masks": masks}


def _rollout_from_checkpoint(state: dict[str, Any]) -> Rollout:
    return Rollout(**{**state, "samples": json.loads(state["samples"]),
                      "token_masks": TokenMasks.from_state(state.get("token_masks"))})


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so no worker outlives a killed learner."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RolloutWorkers:
    """The learner's handle on its rollout workers (see the module docstring).

    Args:
        env, policy: the run's env and policy; each worker gets a copy (weights follow over the weight sync).
        workers: how many worker processes.
        max_staleness: ``K``; ``exact``: the fixed version schedule ``max(0, j - K)`` (one-step-off, ``K = 0``).
        version: the learner's policy version now (its ``global_step``); published at once.
        state: :meth:`state_dict` of a checkpoint (resume), else ``None`` (a fresh run from rollout 0).
        seed: the run's seed (worker ``i`` seeds its env and sampler with ``seed + i``).
        threads: torch threads of each worker; ``bf16``: the rollout's autocast; ``timeout``: a weight sync's limit.
        sampler: each worker's rollout backend (:data:`~tokengym.agents.engine.generation.SAMPLERS`): its copy of the
            policy, or an inference engine of its own that each received version is loaded into.
        total: the run's number of rollouts (``None``: open-ended); a bounded run's checkpoint keeps none past it.
        rollout_timeout: seconds the learner waits for a rollout it needs before stopping with a :class:`WorkerError`.
    """

    def __init__(self, env: Any, policy: Any, *, workers: int, max_staleness: int, exact: bool, version: int,
                 state: dict[str, Any] | None, seed: int, threads: int = 1, bf16: bool = False, timeout: float = 300.0,
                 sampler: str = "tokengym", total: int | None = None, rollout_timeout: float = 1800.0):
        import torch.multiprocessing as mp

        if getattr(mp.current_process(), "_inheriting", False):  # the user's script, re-run by a worker being spawned,
            _exit_unguarded()  # reached its training: it has no __main__ guard (the learner names the cause)
        self.workers, self.k, self.exact, self.timeout, self.total = workers, max_staleness, exact, timeout, total
        self.rollout_timeout = rollout_timeout
        self._pending: threading.Thread | None = None  # a sync in flight (publish(wait=False))
        self._failed: WeightSyncError | None = None
        self.params = list(policy.model.parameters())
        state = state or {"next": 0, "queue": [], "streams": [None] * workers}
        if len(state["streams"]) != workers:
            raise ValueError(f"the checkpoint's async state has {len(state['streams'])} rollout workers' streams, and this "
                             f"run has rollout_workers={workers}; resume with the same number of workers")
        self.next = int(state["next"])  # the next rollout the learner trains on
        self.received: dict[int, tuple] = {int(m["index"]): (_rollout_from_checkpoint(m["rollout"]), int(m["version"]),
                                                              int(m["worker"]), m["stream"], 0.0) for m in state["queue"]}
        self.streams: list[Any] = list(state["streams"])  # each worker's stream after its newest kept rollout
        first = self.next + len(self.received)  # the first rollout a worker samples
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
                spec = {"env": env, "policy": policy, "workers": workers, "worker": i, "k": max_staleness, "exact": exact,
                        "start": first, "stream": self.streams[i], "seed": seed + i, "port": store.port,
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
                    ready.add(self._message()[1])
            except WorkerError as e:
                if script_classes and any(p.exitcode == _UNGUARDED for p in self.procs):
                    raise guard from None
                raise
            self.sync = WeightSync(store, 0, workers, timeout, device)
            self._previous_sigterm = None
            if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds the learner, closing the workers
                self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
            self.sync_seconds = 0.0
            self.publish(version)
        except BaseException:
            self.close()
            raise

    def names(self) -> dict[int, str]:
        return {i + 1: f"rollout worker {i} (pid {p.pid})" for i, p in enumerate(self.procs)}

    def publish(self, version: int, wait: bool = True) -> None:
        """Send the policy's weights as ``version`` to every worker. ``wait=False``: in a thread, while the learner
        goes on; the weights must not change until :meth:`settle` (the learner calls it before its optimiser
        step, so the next update's forward and backward overlap the sync)."""
        self.settle()
        if wait:
            self._publish(version)
            self._raise_failed()
            return
        self._pending = threading.Thread(target=self._publish, args=(version,), name="weight-publish", daemon=True)
        self._pending.start()

    def _publish(self, version: int) -> None:
        try:
            self.sync_seconds = self.sync.publish(version, self.params, self.names())
        except WeightSyncError as e:
            self._failed = e

    def settle(self) -> None:
        """Wait for a sync started with ``wait=False``; raise its failure as a :class:`WorkerError`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            self._check_alive()
            raise WorkerError(str(failed)) from None

    def _check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                raise WorkerError(f"rollout worker {i} (pid {p.pid}) died ({how}) before rollout {self.next}; the run "
                                  "stops (its checkpoints are intact: resume it)")

    def _message(self, waiting_for: int | None = None, wait: bool = True) -> tuple | None:
        """The workers' next message (``wait=False``: None if none has come); a worker's error or death is a
        :class:`WorkerError` naming it, and so is a rollout ``waiting_for`` that has not come within
        ``rollout_timeout`` seconds."""
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
                if self._pending is not None and not self._pending.is_alive():
                    self.settle()  # a sync that failed meanwhile: its worker will send nothing
                continue
            if msg[0] == "error":
                _, i, text = msg
                raise WorkerError(f"rollout worker {i} (pid {self.procs[i].pid}) failed: {text}")
            return msg

    def _receive(self, index: int) -> float:
        """Wait until rollout ``index`` has arrived; return the seconds waited."""
        t0 = time.perf_counter()
        while index not in self.received:  # (each message restarts the clock: the others' rollouts are progress too)
            self._store(self._message(waiting_for=index))
        return time.perf_counter() - t0

    def _store(self, msg: tuple) -> None:
        _, j, version, i, packed, seconds = msg
        ro, stream = _unpack(packed)
        self.received[j] = (ro, version, i, stream, seconds)

    def take(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """The rollout the learner trains on at ``step`` (its policy version) and its ``async/*`` metrics."""
        if step != self.next:
            raise RuntimeError(f"the learner asked for rollout {step}, and the next one is {self.next}")
        waited = self._receive(self.next)
        ro, version, i, stream, seconds = self.received.pop(self.next)
        self.streams[i] = stream
        self.next += 1
        lag = step - version
        if not 0 <= lag <= self.k:  # the schedule makes this impossible; a broken invariant must not train silently
            raise RuntimeError(f"rollout {step} was sampled by policy version {version}: staleness {lag} is outside "
                               f"[0, max_staleness={self.k}]")
        return ro, {"async/staleness": float(lag), "async/policy_version": float(version),
                    "time/async_wait": waited, "time/worker_rollout": seconds, "time/weight_sync": self.sync_seconds}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint after the learner's current step keeps (see the module docstring). An exact schedule waits
        for its K (at most 1) rollouts sampled with versions before the step, so it resumes bit for bit; a bounded run
        keeps those that have arrived (in order, none past the run's last) and waits for none, so a large K never
        holds up a checkpoint or a SIGTERM: the rest are sampled again after a resume, with newer weights."""
        self.settle()
        if self.exact:
            keep = range(self.next, self.next + self.k)
            for j in keep:
                self._receive(j)
        else:
            while (msg := self._message(wait=False)) is not None:
                self._store(msg)
            end, j = self.next + self.k if self.total is None else min(self.next + self.k, self.total), self.next
            while j < end and j in self.received:
                j += 1
            keep = range(self.next, j)
        streams = list(self.streams)
        for j in keep:
            _, _, i, stream, _ = self.received[j]
            streams[i] = stream  # j ascending: the newest kept rollout of worker i wins
        queue = [{"index": j, "version": self.received[j][1], "worker": self.received[j][2],
                  "stream": self.received[j][3], "rollout": _rollout_checkpoint(self.received[j][0])}
                 for j in keep]
        return {"next": self.next, "queue": queue, "streams": streams}

    def close(self) -> None:
        """Stop the workers (a stop message, then SIGTERM and SIGKILL for any that linger); idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.settle()
        if getattr(self, "_previous_sigterm", None) is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        sync = getattr(self, "sync", None)
        if sync is not None and all(p.exitcode is None for p in self.procs):
            with contextlib.suppress(Exception):
                sync.publish(STOP, [])
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
    """``obj`` as bytes (``torch.save``): the workers' messages carry plain bytes, not torch's shared-memory tensors
    (whose file descriptors fail for some storages and outlive a killed sender)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def _worker_main(spec_in: Any, results: Any) -> None:
    """A rollout worker's process: receive weights in a thread, sample rollouts by the version schedule, send them."""
    _die_with_parent()
    spec = _unpack(spec_in.recv_bytes())
    spec_in.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the learner stops us
    code = 0
    try:
        _worker_loop(spec, results)
    except BaseException as e:  # one line to the learner, which names this worker
        code = 1
        with contextlib.suppress(Exception):
            results.put(("error", spec["worker"], f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]))
    with contextlib.suppress(Exception):
        results.close()
        results.join_thread()  # what was put reaches the learner before the process ends
    os._exit(code)


def _worker_loop(spec: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(spec["threads"])
    env, policy, w, i, k, exact = (spec[key] for key in ("env", "policy", "workers", "worker", "k", "exact"))
    policy.train(False)
    sampler = make_sampler(spec["sampler"], policy, rows=env.num_envs, row_len=env.seq_len, bf16=spec["bf16"])
    params = list(policy.model.parameters())
    store = WeightSync.connect(spec["port"], w)
    results.put(("ready", i))  # the learner joins the group only once every worker got this far
    sync = WeightSync(store, i + 1, w, WeightSync.WORKER_TIMEOUT, spec["device"])
    versions: dict[int, list[torch.Tensor]] = {}  # received, not loaded yet: version -> its tensors
    free: list[list[torch.Tensor]] = []  # buffers to receive into, reused (a fresh one costs page faults)
    cond = threading.Condition()
    status: dict[str, Any] = {"stop": False, "error": None}

    def receive() -> None:
        try:
            while True:
                with cond:
                    into = free.pop() if free else None
                into = into or [torch.empty_like(p) for p in params]
                v = sync.receive(into)
                with cond:
                    if v == STOP:
                        status["stop"] = True
                    else:
                        if not exact:  # bounded: only the newest is ever used
                            free.extend(versions.values())
                            versions.clear()
                        versions[v] = into
                    cond.notify_all()
                if v == STOP:
                    return
        except BaseException as e:  # the learner is gone or the channel broke
            with cond:
                status["error"], status["stop"] = e, True
                cond.notify_all()

    threading.Thread(target=receive, name="weight-sync", daemon=True).start()
    j = spec["start"] + (i - spec["start"]) % w  # this worker's first rollout
    seed = None
    if spec["stream"] is not None:
        env.load_state_dict(spec["stream"]["env"])
        policy.generator.set_state(spec["stream"]["rng"])
    else:
        policy.seed(spec["seed"])
        seed = spec["seed"]
    loaded = -1  # the version in the policy's weights (none yet)
    device = torch.device(spec["device"])
    while True:
        lo = max(0, j - k)  # the oldest version rollout j may use; exact modes use it and no other
        with cond:
            cond.wait_for(lambda: status["stop"] or loaded >= lo or any(u >= lo for u in versions))
            if status["stop"]:
                break
            v = lo if exact else max([loaded, *versions])
            if v != loaded and v not in versions:  # exact: a version it needs was skipped; fail, never wait forever
                raise RuntimeError(f"rollout {j} needs policy version {lo} exactly, and the worker holds versions "
                                   f"{sorted(versions) or [loaded]}")
            slot = versions.pop(v) if v != loaded else None
            for old in [u for u in versions if u < v]:
                free.append(versions.pop(old))
        if slot is not None:
            WeightSync.load(params, slot)
            if sampler is not policy:  # the worker's engine takes them by name
                sampler.load_weights(None, v)
            loaded = v
            with cond:
                free.append(slot)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["bf16"]):
            ro = collect(env, sampler, seed=seed)
        ro.policy_version = v
        seed = None
        stream = {"env": env.state_dict(), "rng": policy.generator.get_state()}
        results.put(("rollout", j, v, i, _pack((ro, stream)), time.perf_counter() - t0))
        j += w
    if status["error"] is not None and not isinstance(status["error"], SystemExit):
        raise RuntimeError(f"the weight sync broke (is the learner gone?): {status['error']}")

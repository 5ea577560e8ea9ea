"""What a rollout worker runs, local or remote: receive weights in a thread, sample rollouts by the version schedule.

Rollout ``j`` (the ``j``-th the learner trains on) is worker ``i``'s when ``j = start + i (mod workers)``, and is
sampled with policy version ``v >= j - k``: exactly ``max(0, j - k)`` in exact modes, else the newest it holds (see
:mod:`~tokengym.agents.engine.workers`). Each received version is checked (every tensor finite) before it is
acknowledged; a refused version is never loaded.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from tokengym.agents.engine.backends import make_backend
from tokengym.agents.engine.messages import check_weights, manifest
from tokengym.agents.engine.rollout import collect
from tokengym.agents.runtime.weight_sync import STOP, WeightSync, views

__all__ = ["WorkerLoop", "weight_manifest", "receive_checked"]


def weight_manifest(model: torch.nn.Module) -> list[list[Any]]:
    """The manifest of ``model``'s parameters (full shapes, also under FSDP2), in ``named_parameters`` order."""
    return manifest([(n, p) for n, p in model.named_parameters()])


class WorkerLoop:
    """One worker's schedule (see the module docstring).

    ``spec``: ``workers``, ``worker`` (its slot ``i``), ``k``, ``exact``, ``start`` (the first rollout the learner
    needs), ``stream`` (``{"env", "rng"}`` to continue, or None), ``seed``, ``bf16``, ``device``, ``sampler``.
    ``put(j, version, rollout, stream, seconds)`` sends a finished rollout. :meth:`stop` ends :meth:`run` (from
    another thread); so does a ``STOP`` version or a broken channel.
    """

    def __init__(self, spec: dict[str, Any], env: Any, policy: Any, sync: WeightSync, put: Callable[..., None]):
        self.spec, self.env, self.policy, self.sync, self.put = spec, env, policy, sync, put
        self.params = [p for _, p in policy.model.named_parameters()]
        self.manifest = weight_manifest(policy.model)
        self.cond = threading.Condition()
        self.versions: dict[int, torch.Tensor] = {}  # received, not loaded yet: version -> its byte stream
        self.free: list[torch.Tensor] = []  # streams to receive into, reused (a fresh one costs page faults)
        self.stopped, self.error = False, None

    def stop(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.stopped = True
            self.error = self.error or error
            self.cond.notify_all()

    def _buffer(self, n: int) -> torch.Tensor:
        with self.cond:
            while self.free:
                buf = self.free.pop()
                if buf.numel() == n:
                    return buf
        return torch.empty(n, dtype=torch.uint8, device=self.sync.comm_device if self.sync is not None else "cpu")

    def _receive(self) -> None:
        try:
            while not self.stopped:
                v, buf, refusal = receive_checked(self.sync, self.manifest, self._buffer)
                if v == STOP:
                    self.stop()
                    return
                self.sync.answer(v, self._accept(v, buf, refusal))
        except BaseException as e:  # the learner is gone or the channel broke
            self.stop(e)

    def _accept(self, v: int, buf: torch.Tensor, refusal: str | None = None) -> str | None:
        """Keep a received version (checked) for the schedule, or say why it is refused (then it is never loaded)."""
        if refusal is not None:
            with self.cond:
                self.free.append(buf)
            return refusal
        with self.cond:
            if not self.spec["exact"]:  # bounded: only the newest is ever used
                self.free.extend(self.versions.values())
                self.versions.clear()
            self.versions[v] = buf
            self.cond.notify_all()
        return None

    def offer_file(self, v: int, path: str) -> str | None:
        """Take version ``v`` from the folder both sides read (a sync through a shared folder, where no weight group
        can be formed): its manifest at ``path``, then its pieces one by one into a receive buffer
        (:func:`~tokengym.agents.engine.sync_files.read_version`: checked against this model's manifest, each
        piece's size and checksum), then every tensor for non-finite values. Returns why it was refused, or None; a
        refused version is never loaded, not even in part."""
        from tokengym.agents.engine.sync_files import read_version
        from tokengym.agents.runtime.weight_sync import layout

        buf = self._buffer(layout(self.manifest)[1])
        try:
            check_weights(read_version(path, self.manifest, buf))
        except (OSError, ValueError) as e:
            with self.cond:
                self.free.append(buf)
            return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"[:300]
        return self._accept(v, buf)

    @torch.no_grad()
    def _load(self, buf: torch.Tensor) -> None:
        for p, t in zip(self.params, views(buf, self.manifest)):
            p.copy_(t.to(p.device))

    def run(self) -> None:
        spec, env, policy = self.spec, self.env, self.policy
        w, i, k, exact = spec["workers"], spec["worker"], spec["k"], spec["exact"]
        policy.train(False)
        backend = make_backend(spec["sampler"], policy, rows=env.num_envs, row_len=env.seq_len, bf16=spec["bf16"])
        if self.sync is not None:  # (else versions come as files: offer_file)
            threading.Thread(target=self._receive, name="weight-sync", daemon=True).start()
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
            with self.cond:
                self.cond.wait_for(lambda: self.stopped or loaded >= lo or any(u >= lo for u in self.versions))
                if self.stopped:
                    break
                v = lo if exact else max([loaded, *self.versions])
                if v != loaded and v not in self.versions:  # exact: a version it needs was skipped; never wait forever
                    raise RuntimeError(f"rollout {j} needs policy version {lo} exactly, and the worker holds versions "
                                       f"{sorted(self.versions) or [loaded]}")
                slot = self.versions.pop(v) if v != loaded else None
                for old in [u for u in self.versions if u < v]:
                    self.free.append(self.versions.pop(old))
            if slot is not None:
                self._load(slot)
                if backend is not policy:  # the worker's engine takes them by name
                    backend.load_weights(None, v)
                loaded = v
                with self.cond:
                    self.free.append(slot)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["bf16"]):
                ro = collect(env, backend, seed=seed)
            ro.policy_version = v
            seed = None
            stream = {"env": env.state_dict(), "rng": policy.generator.get_state()}
            self.put(j, v, ro, stream, time.perf_counter() - t0)
            j += w
        if self.error is not None and not isinstance(self.error, SystemExit):
            raise RuntimeError(f"the weight sync broke (is the learner gone?): {self.error}")


def receive_checked(sync: WeightSync, manifest: list, buffer: Callable[[int], torch.Tensor]) -> tuple:
    """A worker's receive of the next version: ``(version, stream, refusal)``. Each tensor is checked (finite) as soon
    as its bytes have arrived, while the next bucket is in flight, so the check costs little beyond the transfer;
    ``refusal`` says why the version must not be loaded (``None``: it may)."""
    from tokengym.agents.runtime.weight_sync import layout, nbytes

    offsets, _ = layout(manifest)
    ends = [o + n for o, n in zip(offsets, nbytes(manifest))]
    checked, refusal = [0], []

    def arrived(buf: torch.Tensor, n: int) -> None:
        i = checked[0]
        while i < len(ends) and ends[i] <= n:
            if not refusal:
                try:
                    check_weights([(manifest[i][0], views(buf, manifest[i:i + 1], offsets[i])[0])])
                except ValueError as e:
                    refusal.append(str(e))
            i += 1
        checked[0] = i

    version, buf = sync.receive(buffer, manifest, arrived)
    return version, buf, (refusal[0] if refusal else None)

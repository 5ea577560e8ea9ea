"""Rollout workers anywhere: ``tokengym worker`` servers, and the learner's handle on them.

A worker (:class:`WorkerServer`) listens for one learner at a time on HTTP, or HTTPS with a certificate
(:mod:`~tokengym.agents.engine.tls`; loopback by default). Every request carries the shared secret
(``Authorization: Bearer ...``); control messages are JSON, rollouts come back as typed
messages (:mod:`~tokengym.agents.engine.messages`). Paths:

* ``POST /v1/hello``: the worker's protocol, device and whether it serves a learner now; given the learner's env
  (its ``module:Class`` or id and the modules to import), whether this worker can make it.
* ``POST /v1/join``: serve a learner. The message says how to build the env (its id and JSON arguments) and the model
  (a preset or a folder on the worker's machine; ``tokengym worker --model`` overrides it), the worker's place in the
  version schedule, its stream, the weight manifest (checked against the model: names, shapes, dtypes), where
  the learner's store is and the token that opens it (:mod:`~tokengym.agents.runtime.store_gate`). The worker then
  joins a 2-rank weight group with the learner (gloo on CPU, nccl on CUDA), both prove the token in its first
  exchange, and it runs :class:`~tokengym.agents.engine.worker_loop.WorkerLoop`. A join replaces the session before it
  when that is the same learner's (re-planned) or its learner stopped asking (:data:`SESSION_IDLE`); else it is
  refused (409: the worker serves another learner).
* ``POST /v1/next``: the next finished rollout (waits up to ``wait`` seconds; 204 when none came).
* ``POST /v1/leave``: end the session; the worker goes back to waiting for a learner.

A killed learner closes the weight group's connection, which ends the session: the worker waits for the next one.
The learner (:class:`RemoteWorkers`) polls each worker for rollouts in a thread of its own; a worker that stops
answering (or whose session failed) is lost: the run stops with one line naming it, or with ``min_workers`` goes on
with the rest (their schedule is re-planned from the next rollout, and the current weights sent again). A lost
worker that answers again (restarted at the same address) joins the running learner the same way.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import os
import queue as queue_mod
import socket
import threading
import time
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tokengym.envs.json_http import BadRequest, JsonHandler, log_line
from tokengym.rewards.common import TokengymWarning, read_secret_file
from tokengym.agents.engine.backends import BACKENDS
from tokengym.agents.engine.messages import MessageError, check_manifest, encode_rollout
from tokengym.agents.engine.worker_pool import WorkerError, WorkerPool, full_named, stream_from_state, stream_state
from tokengym.agents.engine.worker_loop import WorkerLoop, weight_manifest
from tokengym.agents.engine.tls import TLS_REFUSAL, ClientTLS, WorkerHTTPServer
from tokengym.agents.runtime.store_gate import HandshakeError, StoreGate, StoreTunnel, handshake
from tokengym.agents.runtime.weight_sync import DEFAULT_BUCKET, STOP, WeightSync, WeightSyncError, send, send_stop

__all__ = ["WorkerServer", "RemoteWorkers", "parse_address", "read_secret", "worker_env_spec", "build_env", "PROTOCOL",
           "check_workers_reachable", "check_sync_dir", "check_sync_host"]

PROTOCOL = 2  # 2: the weight store's token (store_token) and the group's handshake
MAX_BODY = 16 << 20
"""A control message's limit in bytes. The largest is a join: its stream holds a dataset task's shuffled order, about
8 bytes a row (16 MiB: some 2M rows); the manifest is ~60 bytes a tensor, the env's arguments what the user gave."""
MAX_DEPTH = 64
"""How deeply a control message may nest arrays and objects (a join nests 5 levels, plus the env arguments' own)."""
READ_TIMEOUT = 10.0
"""Seconds for a request's line and headers to arrive (then as long again plus a second per MB for its body); a
connection that sends nothing, or too slowly, is closed."""
SESSION_IDLE = 30.0
"""Seconds after its learner last asked (it polls every :attr:`RemoteWorkers.POLL`) that a session counts as
abandoned: a learner that died without a word (killed, with ``--sync-dir``) frees its workers for the next one."""
MAX_CONNECTIONS = 64
"""Connections a worker serves at once, one thread each (a learner holds one per worker, plus a short call now and
then); more are answered 503 and closed."""


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; ``ValueError`` (one line) otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


def read_secret(path: str | None, missing: str = "rollout workers need a shared secret: --secret-file PATH "
                "(--worker-secret-file for a learner)") -> bytes:
    """The shared secret: the file's first line (``path``), else ``$TOKENGYM_SECRET``; ``ValueError`` when neither
    gives one (``missing``, then ``or TOKENGYM_SECRET``: who needs it and how to give it)."""
    if path:
        return read_secret_file(path, "the secret file").encode()
    secret = os.environ.get("TOKENGYM_SECRET", "").strip()
    if not secret:
        raise ValueError(f"{missing} or TOKENGYM_SECRET")
    return secret.encode()


def check_sync_dir(path: str) -> None:
    """``ValueError`` (one line) unless ``path`` (``sync_dir``) is an existing folder on a disk that this learner can
    write a file in (each weight version goes there for the workers to read)."""
    import tempfile

    real = os.path.realpath(path)
    if not os.path.exists(path):
        raise ValueError(f"--sync-dir {path} does not exist: create the shared folder (every worker reads it at the same "
                         "path)")
    if not os.path.isdir(path):
        raise ValueError(f"--sync-dir {path} is a file, not a folder")
    if any(real == v or real.startswith(v + os.sep) for v in ("/proc", "/sys", "/dev")):
        raise ValueError(f"--sync-dir {path} is on a virtual filesystem ({real}); pick a folder on a shared disk")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tokengym-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"--sync-dir {path} is not writable ({e.strerror or e}); pick a folder this learner can write "
                         "and every worker can read") from None


def check_sync_host(host: str) -> None:
    """``ValueError`` (one line) unless ``host`` (``sync_host``) resolves to an address of this machine: the learner's
    weight store listens there."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--sync-host {host} is not a host name or address this machine can resolve ({e}); give the "
                         "address the workers reach this learner at, or leave it out") from None
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(address)
    except OSError as e:
        raise ValueError(f"--sync-host {host} ({address[0]}) is not an address of this machine ({e.strerror or e}); the "
                         "learner's weight store listens there: give one of its own addresses, or leave it out") from None


def _route_to(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


# ---------------------------------------------------------------------------------------------- building the env
def worker_env_spec(env: Any, num_envs: int) -> dict[str, Any]:
    """What a remote worker builds ``env`` from (its Gymnasium id and JSON arguments), for ``num_envs`` rows;
    ``ValueError`` (one line) when part of the env cannot be recorded (a callable reward, a class in ``__main__``)."""
    from tokengym.agents.runtime.session import env_record

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = env_record(env)
    if caught:
        why = str(caught[0].message).split(";")[0].removeprefix("config.json ")
        raise ValueError(f"remote rollout workers build the env from its id and JSON arguments, and they {why}: make "
                         "the env from an id with JSON arguments, or use local workers (rollout_workers=N)")
    from tokengym.envs.tasks.registry import env_imports, env_source

    return {"env": env_source(record["env"]), "imports": env_imports(record["env"]),
            "env_kwargs": record["env_kwargs"] or {}, "num_envs": int(num_envs),
            "group_size": int(env.group_size), "device": str(env.device)}


def build_env(spec: dict[str, Any], tokenizer: Any) -> Any:
    """The env of a :func:`worker_env_spec` (its modules imported first: a task of the user's own)."""
    import gymnasium as gym

    from tokengym.envs import resolve_env

    env_id = resolve_env(spec["env"], spec.get("imports") or ())
    return gym.make_vec(env_id, num_envs=spec["num_envs"], vectorization_mode="vector_entry_point",
                        group_size=spec["group_size"], device=spec["device"], tokenizer=tokenizer, **spec["env_kwargs"])


def model_name(policy: Any) -> str | None:
    """How a worker finds the policy's architecture: a shipped checkpoint's name, else the folder it came from."""
    path = getattr(getattr(policy.model, "config", None), "_name_or_path", None) or getattr(policy, "source", None)
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")
    if path and os.path.dirname(os.path.abspath(path)) == shipped:
        return os.path.basename(path)
    return path


# ---------------------------------------------------------------------------------------------- the worker
class _Session:
    """One learner's session on a worker: its weight group and its :class:`WorkerLoop` thread."""

    def __init__(self, server: "WorkerServer", spec: dict[str, Any], env: Any, policy: Any):
        self.id, self.spec = spec["session"], spec
        self.outbox: queue_mod.Queue = queue_mod.Queue()
        self.error: str | None = None
        self.loop: WorkerLoop | None = None
        self.done, self.ready = threading.Event(), threading.Event()
        self.seen, self.leaving = time.monotonic(), False  # when its learner last asked; whether it left
        self.thread = threading.Thread(target=self._run, args=(server, env, policy), name=f"session-{self.id[:8]}",
                                       daemon=True)
        self.thread.start()

    def _run(self, server: "WorkerServer", env: Any, policy: Any) -> None:
        spec = self.spec
        tunnel = None
        try:
            sync = None  # (no store: versions come as files, /v1/weights)
            if spec["store"] is not None:
                host, port = spec["store"]
                tunnel = StoreTunnel(host, port, bytes.fromhex(spec["store_token"]), spec["timeout"])
                store = dist.PrefixStore(spec["prefix"], WeightSync.connect(tunnel.port, 1, "127.0.0.1",
                                                                            timeout=spec["timeout"]))
                sync = WeightSync(store, 1, 1, WeightSync.WORKER_TIMEOUT, spec["device"], hostname=_route_to(host))
                tunnel.stop_listening()  # (the store client is connected: nobody else on this machine gets in)
                handshake(sync, bytes.fromhex(spec["store_token"]), spec["session"])
            slot = spec["slot"]

            def put(j: int, v: int, ro: Any, stream: dict, seconds: float) -> None:
                self.outbox.put(encode_rollout(ro, {"index": j, "worker": slot, "seconds": seconds}, stream))

            self.loop = WorkerLoop({**spec, "stream": stream_from_state(spec["stream"])}, env, policy, sync, put)
            self.ready.set()
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 (the learner reads it as one line)
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            server.log(f"session {self.id[:8]} ended: {self.error}")
        finally:
            if tunnel is not None:
                tunnel.close()
            self.done.set()

    def stop(self, wait: float = 120.0) -> None:
        if self.loop is not None:
            self.loop.stop()
        self.done.wait(wait)  # a rollout in progress finishes first: the env and the policy are the next session's


class WorkerServer:
    """``tokengym worker``: serves rollouts to one learner at a time (see the module docstring).

    Args:
        host, port: where to listen (port 0: a free one; :attr:`address` says which).
        secret: the shared secret every request must carry.
        model: the model folder or preset to build (default: what the learner names).
        threads: torch CPU threads for sampling.
        tls: serve HTTPS with this context (:func:`~tokengym.agents.engine.tls.server_context`); None: HTTP.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes, model: str | None = None,
                 threads: int | None = None, quiet: bool = False, tls: Any = None):
        self.secret, self.model, self.quiet = secret, model, quiet
        if threads:
            torch.set_num_threads(threads)
        self.lock = threading.Lock()
        self.session: _Session | None = None
        self.built: dict[str, tuple[Any, Any]] = {}  # the last env and policy, reused by a session with the same spec
        server = self

        class Handler(_Handler):
            owner = server

        self.httpd = WorkerHTTPServer((host, port), Handler, tls)
        self.address = f"{host}:{self.httpd.server_address[1]}"

    def log(self, text: str) -> None:
        if not self.quiet:
            log_line(f"tokengym worker {self.address}: {text}")

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.5)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.session is not None:
            self.session.stop(wait=5.0)

    # ------------------------------------------------------------------ messages
    def hello(self, body: dict[str, Any]) -> dict[str, Any]:
        """The worker's protocol and whether it is busy; given a learner's ``env`` (a :func:`worker_env_spec`), also
        ``env_error``: why this worker cannot make it, or None: a module of the user's it cannot import, or (given the
        learner's ``model``, or the worker's own ``--model``) an env its version refuses to build, tried on one
        group of rows with the model's tokenizer."""
        live = self._serving()
        reply = {"protocol": PROTOCOL, "busy": live is not None, "session": None if live is None else live.id}
        env = body.get("env")
        if isinstance(env, dict) and isinstance(env.get("env"), str):
            from tokengym.envs import resolve_env

            try:
                resolve_env(env["env"], [m for m in env.get("imports") or () if isinstance(m, str)])
                reply["env_error"] = None
            except ValueError as e:
                reply["env_error"] = str(e).splitlines()[0][:400]
                return reply
            model = self.model or body.get("model")
            complete = isinstance(env.get("env_kwargs"), dict) and {"group_size", "device"} <= set(env)
            if isinstance(model, str) and complete:
                reply["env_error"] = _env_build_error(env, model)
        return reply

    def join(self, body: dict[str, Any]) -> dict[str, Any]:
        need = {"protocol": int, "session": str, "env": dict, "model": (str, type(None)), "temperature": (int, float),
                "workers": int, "worker": int, "slot": int, "k": int, "exact": bool, "start": int,
                "stream": (dict, type(None)), "seed": int, "store": (list, type(None)), "store_token": (str, type(None)), "prefix": str, "manifest": list,
                "timeout": (int, float), "bf16": bool, "sampler": str}
        for key, tp in need.items():
            if not isinstance(body.get(key), tp) or isinstance(body.get(key), bool) and tp is int:
                raise MessageError(f"a join message needs {key!r} ({getattr(tp, '__name__', tp)})")
        if body["protocol"] != PROTOCOL:
            raise MessageError(f"the learner speaks protocol {body['protocol']}, this worker {PROTOCOL}: install the "
                               "same tokengym on both")
        if body["store"] is not None and not (isinstance(body["store_token"], str) and len(body["store_token"]) == 64):
            raise MessageError("a join with a weight store needs its 'store_token' (64 hex digits)")
        if body["sampler"] not in BACKENDS:
            raise MessageError(f"unknown rollout backend sampler={body['sampler']!r}; this worker has: "
                               f"{', '.join(BACKENDS.names())}")
        with self.lock:
            live = self._serving()
            if live is not None and _learner_of(live.id) != _learner_of(body["session"]):
                raise _Busy(f"serves another learner now (session {live.id[:8]}): stop that run, or name another "
                            "worker")
            if self.session is not None:  # the same learner re-planned, or one gone quiet: its session is replaced
                self.session.stop()
                self.session = None
            env, policy = self._build(body)
            check_manifest(body["manifest"], weight_manifest(policy.model))
            spec = {**body, "device": str(policy.device)}
            self.session = _Session(self, spec, env, policy)
        self.log(f"serving learner session {body['session'][:8]} as worker {body['worker']} of {body['workers']}")
        return {"ok": True, "device": str(policy.device)}

    def _build(self, body: dict[str, Any]) -> tuple[Any, Any]:
        from tokengym.agents.engine.policy import Policy

        model = self.model or body["model"]
        if model is None:
            raise MessageError("the learner names no model; start the worker with --model PATH")
        key = json.dumps([model, body["env"], body["temperature"]], sort_keys=True)
        if key not in self.built:
            self.built.clear()  # one model at a time
            try:
                policy = Policy.from_pretrained(model, device=body["env"].get("device", "cpu"),
                                                temperature=float(body["temperature"]))
                env = build_env(body["env"], policy.tokenizer)
            except Exception as e:
                raise MessageError(f"cannot build model {model!r} and env {body['env'].get('env')!r}: "
                                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
            self.built[key] = (env, policy)
        return self.built[key]

    def next(self, body: dict[str, Any]) -> bytes | None:
        session = self._session(body)
        try:
            return session.outbox.get(timeout=min(float(body.get("wait", 2.0)), 30.0))
        except queue_mod.Empty:
            if session.done.is_set() and session.outbox.empty():
                raise _Gone(session.error or "the session ended")
            return None

    def weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """A version as a safetensors file on a path this worker reads (a sync through a shared folder)."""
        session = self._session(body)
        if not isinstance(body.get("version"), int) or not isinstance(body.get("path"), str):
            raise MessageError("a weights message needs 'version' (int) and 'path' (str)")
        if not session.ready.wait(60.0) or session.loop is None:
            raise _Gone(session.error or "the session did not start")
        refusal = session.loop.offer_file(body["version"], body["path"])
        if refusal is not None:
            raise MessageError(f"refused policy version {body['version']}: {refusal}")
        return {"ok": True}

    def leave(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._session(body)
        session.leaving = True  # (free for the next learner at once, while a rollout in progress finishes)
        session.stop(wait=10.0)
        with self.lock:
            if self.session is session:
                self.session = None
        self.log(f"learner session {session.id[:8]} left; waiting for a learner")
        return {"ok": True}

    def _session(self, body: dict[str, Any]) -> _Session:
        session = self.session
        if session is None or body.get("session") != session.id:
            raise _Gone("no such session (the worker serves another learner now, or was restarted)")
        session.seen = time.monotonic()
        return session

    def _serving(self) -> _Session | None:
        """The session of a learner that is here: not ended, not left, and asking (within :data:`SESSION_IDLE`)."""
        s = self.session
        if s is None or s.done.is_set() or s.leaving or time.monotonic() - s.seen > SESSION_IDLE:
            return None
        return s


def _learner_of(session: str) -> str:
    """The learner a session id belongs to (``<learner>-<generation>-<slot>``)."""
    return session.split("-", 1)[0]


class _Gone(Exception):
    """The session a request names is not this worker's (HTTP 409)."""


class _Busy(Exception):
    """A join while another learner's session is live (HTTP 409, logged)."""


class _Handler(JsonHandler):
    """The worker's door: the secret, then the message (bounded: :data:`MAX_BODY`, :data:`MAX_DEPTH`), then its route.
    At most :data:`MAX_CONNECTIONS` connections are served at once, each request arriving within :data:`READ_TIMEOUT`."""

    owner: WorkerServer
    max_connections, read_timeout, max_body, max_depth = MAX_CONNECTIONS, READ_TIMEOUT, MAX_BODY, MAX_DEPTH

    def _refuse(self, code: int, text: str, unread: bool = False) -> None:
        """Answer ``code`` with one line; ``unread``: the request's body was not read, so the connection ends."""
        self.close_connection = self.close_connection or unread
        self.owner.log(f"refused {self.command} {self.path} from {self.client_address[0]}: {text}")
        self.send_json(code, {"error": text})

    def do_GET(self) -> None:
        self._refuse(405, "every message is a POST", unread=True)

    def do_POST(self) -> None:
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), b"Bearer " + self.owner.secret):
            return self._refuse(401, "wrong or missing secret", unread=True)
        routes = {"/v1/hello": self.owner.hello, "/v1/join": self.owner.join, "/v1/next": self.owner.next,
                  "/v1/leave": self.owner.leave, "/v1/weights": self.owner.weights}
        if self.path not in routes:
            return self._refuse(404, f"unknown message {self.path!r}", unread=True)
        try:
            body = self.read_json()
            if body is None:
                body = {}
            if not isinstance(body, dict):
                raise BadRequest(400, "the message is not JSON: not a JSON object")
        except BadRequest as e:
            return self._refuse(e.code, str(e))
        except (ConnectionError, TimeoutError) as e:  # the client went away (or stalled) mid-body: one line, no reply
            self.close_connection = True
            return self.owner.log(f"dropped {self.command} {self.path} from {self.client_address[0]}: {e}")
        try:
            out = routes[self.path](body)
        except _Gone as e:  # (not logged: a learner's fetcher meets it whenever a session ends)
            return self.send_json(409, {"error": str(e)})
        except _Busy as e:
            return self._refuse(409, str(e))
        except MessageError as e:
            return self._refuse(400, str(e))
        except Exception as e:  # noqa: BLE001
            return self._refuse(500, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if out is None:
            self.send_body(204, b"")
        elif isinstance(out, bytes):
            self.send_body(200, out, "application/octet-stream")
        else:
            self.send_json(200, out)


# ---------------------------------------------------------------------------------------------- the learner
def call(address: str, path: str, body: dict[str, Any], secret: bytes, timeout: float,
         tls: ClientTLS | None = None) -> tuple[int, bytes]:
    """POST ``body`` to a worker (over HTTPS with ``tls``, the certificate checked first); ``(status, reply)``.
    Network and TLS failures raise ``OSError``."""
    host, port = parse_address(address)
    conn = tls.connection(host, port, timeout) if tls is not None else http.client.HTTPConnection(host, port,
                                                                                                  timeout=timeout)
    try:
        data = json.dumps(body).encode()
        conn.request("POST", path, data, {"Authorization": "Bearer " + secret.decode(),
                                          "Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _env_build_error(spec: dict[str, Any], model: str) -> str | None:
    """Why this machine cannot build the env of ``spec`` (one group of its rows) with ``model``'s tokenizer, or None."""
    from tokengym.agents.engine.models import model_tokenizer

    def why(e: Exception) -> str:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    try:
        tok = model_tokenizer(model)
    except Exception as e:  # (join would fail the same way: say so now)
        return f"cannot load the tokenizer of model {model!r}: {why(e)}"[:400]
    try:
        build_env({**spec, "num_envs": int(spec["group_size"])}, tok)
    except Exception as e:  # the user's env code, or kwargs this machine's version of it refuses
        return f"cannot build env {spec['env']!r} with {spec['env_kwargs']}: {why(e)}"[:400]
    return None


def check_workers_reachable(addresses: list[str], secret: bytes, env: dict[str, Any] | None = None,
                            model: str | None = None, tls: ClientTLS | None = None) -> None:
    """``ValueError`` (one line) for a worker that does not answer, speaks TLS to a plain learner or the converse,
    shows another certificate than ``tls`` wants, refuses the secret, speaks another protocol or (given ``env``, a
    :func:`worker_env_spec`, and the ``model`` it will load) cannot make the env, before anything of a run is made."""
    for address in addresses:
        try:
            status, reply = call(address, "/v1/hello", {} if env is None else {"env": env, "model": model}, secret,
                                 10.0 if env is None else 60.0, tls)  # (building the env takes a while)
        except OSError as e:
            if tls is not None and (why := tls.explain(address, e)) is not None:
                raise ValueError(why) from None
            raise ValueError(f"rollout worker {address} cannot be reached ({type(e).__name__}: {e}); is `tokengym "
                             "worker` running there, and is the port open?") from None
        if status == TLS_REFUSAL:
            raise ValueError(f"{address} speaks TLS: pass --worker-ca or --worker-fingerprint")
        hello = _json_object(reply)
        if hello is None or ("error" if status != 200 else "protocol") not in hello:  # another server on that port
            raise ValueError(f"{address} answered but is not a tokengym worker (HTTP {status}); is the address right, "
                             "and is `tokengym worker` running there?")
        if status != 200:
            raise ValueError(f"rollout worker {address} refused this learner: {_error_text(reply)}")
        theirs = hello.get("protocol")
        if theirs != PROTOCOL:
            raise ValueError(f"rollout worker {address} speaks protocol {theirs}, this learner {PROTOCOL}: install the "
                             "same tokengym on both")
        if hello.get("busy"):
            raise ValueError(f"rollout worker {address} serves another learner now (session "
                             f"{str(hello.get('session'))[:8]}): stop that run, or name another worker (a learner that "
                             f"died frees its workers within {SESSION_IDLE:g} s)")
        why = hello.get("env_error")
        if why:
            raise ValueError(f"rollout worker {address} cannot make this run's env on its machine: {why}")


def _json_object(reply: bytes) -> dict[str, Any] | None:
    """A reply's JSON object, or None (not JSON, or not an object)."""
    try:
        value = json.loads(reply)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_text(reply: bytes) -> str:
    try:
        return str(json.loads(reply)["error"])
    except (ValueError, KeyError, TypeError):
        return reply[:200].decode(errors="replace")


class RemoteWorkers(WorkerPool):
    """The learner's handle on ``tokengym worker`` servers (see the module docstring).

    Args:
        addresses: the workers' ``host:port``, one slot each (slot ``i`` keeps stream ``i`` in checkpoints).
        secret: the shared secret. ``env``/``policy``: the learner's (the worker builds its own from their record:
            :func:`worker_env_spec`, :func:`model_name`); ``rows``: a rollout's rows (the global batch).
        min_workers: how many may remain and the run go on (0: every worker is needed; a lost one stops the run).
        sync_host, sync_port: where the learner's weight store listens (empty host: this machine's address on the
            route to the first worker; port 0: a free one).
        sync_dir: a folder the learner and every worker read (a shared filesystem): versions go there as safetensors
            pieces of at most ``bucket`` bytes and a manifest (:mod:`~tokengym.agents.engine.sync_files`) instead
            of over a weight group (where none can be formed).
        tls: talk HTTPS to the workers, their certificates checked (:class:`~tokengym.agents.engine.tls.ClientTLS`).
        The rest as :class:`~tokengym.agents.engine.workers.RolloutWorkers`.
    """

    POLL = 2.0  # seconds a /v1/next waits on the worker
    CALL_TIMEOUT = 60.0  # seconds any other call may take (a join builds the env and the model)
    PROBE_EVERY = 5.0  # seconds between asking a lost worker whether it is back
    LEAVE_TIMEOUT = 5.0  # seconds a worker has to take the end of its session (all workers at once)
    PROBE_TIMEOUT = 5.0  # seconds a worker that did not take a sync has to say whether it still serves the session

    def __init__(self, addresses: list[str], secret: bytes, env: Any, policy: Any, *, rows: int, max_staleness: int,
                 exact: bool, version: int, state: dict[str, Any] | None, seed: int, bf16: bool = False,
                 timeout: float = 300.0, sampler: str = "tokengym", total: int | None = None,
                 rollout_timeout: float = 1800.0, bucket: int = DEFAULT_BUCKET, min_workers: int = 0,
                 sync_host: str = "", sync_port: int = 0, sync_dir: str = "", publish: bool = True,
                 tls: ClientTLS | None = None):
        for a in addresses:
            parse_address(a)
        super().__init__(max_staleness=max_staleness, exact=exact, state=state, workers=len(addresses), total=total,
                         rollout_timeout=rollout_timeout, rows=rows, width=env.seq_len, device=env.device)
        self.addresses, self.secret, self.timeout, self.bucket = list(addresses), secret, float(timeout), bucket
        self.tls = tls
        self.min_workers = min_workers or len(addresses)
        self.seed, self.bf16, self.sampler = seed, bf16, sampler
        self.named = lambda: full_named(policy.model)
        self.manifest = weight_manifest(policy.model)
        self.env_spec = {**worker_env_spec(env, rows), "device": "cpu" if env.device.type == "cpu" else str(env.device)}
        self.model, self.temperature = model_name(policy), float(getattr(policy, "temperature", 1.0))
        self.learner = uuid.uuid4().hex
        self.generation = 0
        self.live: dict[int, dict[str, Any]] = {}  # slot -> {"session", "sync", "thread"}
        self.lost: dict[int, str] = {}  # slot -> why
        self.gone: dict[str, str] = {}  # session -> why its fetcher found the worker gone (ends a sync's wait)
        self.inbox: queue_mod.Queue = queue_mod.Queue()
        self.back: set[int] = set()  # lost slots that answer again (filled by _watch threads)
        self.version = version
        host = sync_host or _route_to(parse_address(addresses[0])[0])
        self.sync_host, self.sync_dir, self.files = host, sync_dir, []
        self.gate = None if sync_dir else StoreGate(len(addresses), timeout, host, sync_port)
        self.store = None if self.gate is None else self.gate.store
        try:
            self._plan(list(range(len(addresses))), first=True)
            if publish:
                self.publish(version)
        except BaseException:
            self.close()
            raise

    def live_count(self) -> float:
        return float(len(self.live))

    def take(self, step: int):
        self._probe()
        return super().take(step)

    def _label(self, slot: int) -> str:
        return f"rollout worker {self.addresses[slot]}"

    def _name(self, worker: Any) -> str:
        return self._label(worker) if isinstance(worker, int) and 0 <= worker < len(self.addresses) else "a rollout worker"

    # ------------------------------------------------------------------ membership
    def _plan(self, slots: list[int], first: bool = False) -> None:
        """(Re)start the schedule on ``slots``: every worker joins a new session generation from rollout ``next``."""
        self._end_sessions()
        self.generation += 1
        if not first:  # rollouts of the old plan: sampled again by the new one (newer weights where allowed)
            self.received = {j: r for j, r in self.received.items() if j < self.next}
        start = self.next + len(self.received) if first else self.next
        exact = self.exact and first
        for pos, slot in enumerate(slots):
            session = f"{self.learner}-{self.generation}-{slot}"
            prefix = f"g{self.generation}/s{slot}/"
            body = {"protocol": PROTOCOL, "session": session, "env": self.env_spec, "model": self.model,
                    "temperature": self.temperature, "workers": len(slots), "worker": pos, "slot": slot, "k": self.k,
                    "exact": exact, "start": start, "stream": stream_state(self.streams[slot]),
                    "seed": self.seed + slot, "prefix": prefix,
                    "store": None if self.gate is None else [self.sync_host, self.gate.port],
                    "store_token": None if self.gate is None else self.gate.token.hex(),
                    "manifest": self.manifest, "timeout": self.timeout, "bf16": self.bf16, "sampler": self.sampler}
            try:
                status, reply = call(self.addresses[slot], "/v1/join", body, self.secret, self.CALL_TIMEOUT, self.tls)
            except OSError as e:
                raise WorkerError(f"{self._label(slot)} cannot be reached ({type(e).__name__}: {e}); is "
                                  "`tokengym worker` running there?") from None
            if status == 409:  # another learner's: the run stops now, in one line
                raise WorkerError(f"{self._label(slot)} {_error_text(reply)}")
            if status != 200:
                raise WorkerError(f"{self._label(slot)} refused to join: {_error_text(reply)}")
            sync = None
            if self.store is not None:
                sync = WeightSync(dist.PrefixStore(prefix, self.store), 0, 1, self.timeout, str(self.device),
                                  hostname=self.sync_host)
                sync.names = {1: self._label(slot)}
                sync.gone = lambda slot=slot, session=session: self.gone.get(session)
                try:
                    handshake(sync, self.gate.token, session)
                except HandshakeError as e:
                    raise WorkerError(f"{self._label(slot)}: {e}") from None
            self.live[slot] = {"session": session, "sync": sync}
            self.lost.pop(slot, None)
            t = threading.Thread(target=self._fetch, args=(slot, session, self.generation), daemon=True,
                                 name=f"fetch-{slot}")
            self.live[slot]["thread"] = t
            t.start()

    def _end_sessions(self) -> None:
        """Tell every live worker its session ends, all at once: a worker that does not answer (stopped, or its
        machine gone) costs one ``LEAVE_TIMEOUT``, not one per worker."""

        def leave(slot: int, session: str) -> None:
            with contextlib.suppress(Exception):
                call(self.addresses[slot], "/v1/leave", {"session": session}, self.secret, self.LEAVE_TIMEOUT, self.tls)

        threads = [threading.Thread(target=leave, args=(slot, s["session"]), name=f"leave-{slot}", daemon=True)
                   for slot, s in self.live.items()]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.LEAVE_TIMEOUT + 1.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.live.clear()

    def _fetch(self, slot: int, session: str, generation: int) -> None:
        """A slot's rollouts into the inbox, until its session ends or the worker is lost."""
        while self.live.get(slot, {}).get("session") == session:
            try:
                status, reply = call(self.addresses[slot], "/v1/next", {"session": session, "wait": self.POLL},
                                     self.secret, self.POLL + self.CALL_TIMEOUT, self.tls)
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
            else:
                if status == 200:
                    self.inbox.put(("rollout", slot, generation, reply))
                    continue
                if status == 204:
                    continue
                why = _error_text(reply)
            self.gone[session] = why
            self.inbox.put(("lost", slot, generation, why))
            return

    def _lose(self, slot: int, why: str) -> None:
        """A worker is gone: stop the run (one line), or go on with the rest under ``min_workers``."""
        if slot not in self.live:
            return
        left = [s for s in self.live if s != slot]
        if len(left) < self.min_workers:
            raise WorkerError(self._lost_text(slot, why))
        warnings.warn(f"{self._label(slot)} was lost before rollout {self.next} ({why}); going on with {len(left)} "
                      "worker(s) (--min-workers)", TokengymWarning, stacklevel=2)
        self.lost[slot] = why
        threading.Thread(target=self._watch, args=(slot,), name=f"watch-{slot}", daemon=True).start()
        self._replan(left)

    def _lost_text(self, slot: int, why: str) -> str:
        return (f"{self._label(slot)} was lost before rollout {self.next} ({why}); the run stops (its checkpoints are "
                "intact: resume it, or let it go on without the worker with --min-workers)")

    def _replan(self, slots: list[int]) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        self._raise_failed()
        self._plan(slots)
        self.sync_seconds = self._send(self.version)

    def _watch(self, slot: int) -> None:
        """Ask a lost worker, in a thread, whether it is back (restarted at its address); :meth:`_probe` lets it in."""
        while slot in self.lost and not getattr(self, "_closed", False):
            time.sleep(self.PROBE_EVERY)
            with contextlib.suppress(OSError, ValueError):
                status, reply = call(self.addresses[slot], "/v1/hello", {}, self.secret, 5.0, self.tls)
                hello = (_json_object(reply) or {}) if status == 200 else {}
                mine = not hello.get("busy") or _learner_of(str(hello.get("session"))) == self.learner
                if hello.get("protocol") == PROTOCOL and mine:  # (not while it serves another learner)
                    self.back.add(slot)
                    return

    def _probe(self) -> None:
        """Let lost workers that answered again join the running learner (a re-plan with them)."""
        back = sorted(s for s in self.back if s in self.lost)
        self.back.clear()
        if back:
            warnings.warn(f"{', '.join(self._label(s) for s in back)} answered again and rejoins the run",
                          TokengymWarning, stacklevel=2)
            self._replan(sorted([*self.live, *back]))

    # ------------------------------------------------------------------ WorkerPool
    def _message(self, waiting_for: int | None = None, wait: bool = True) -> bytes | None:
        t0 = time.monotonic()
        while True:
            try:
                kind, slot, generation, payload = self.inbox.get(timeout=0.5) if wait else self.inbox.get_nowait()
            except queue_mod.Empty:
                if not wait:
                    return None
                if waiting_for is not None and time.monotonic() - t0 > self.rollout_timeout:
                    raise WorkerError(f"no rollout {waiting_for} came from the rollout workers for "
                                      f"{self.rollout_timeout:g} s (rollout_timeout): a task's sample() or reward(), "
                                      "or a tool, may never return; the run stops (its checkpoints are intact)")
                self._pending_failed()
                self._probe()
                continue
            if generation != self.generation:
                continue  # from a plan that was replaced
            if kind == "lost":
                self._lose(slot, payload)
                continue
            return payload

    def _send(self, version: int) -> float:
        if self.sync_dir:
            return self._send_file(version)
        syncs = [self.live[s]["sync"] for s in sorted(self.live)]
        try:
            return send(syncs, version, self.named(), self.manifest, self.bucket)
        except WeightSyncError as e:
            slot = next((s for s in self.live if e.sync is self.live[s]["sync"]), None)
            if slot is None or version == STOP:
                raise
            lost = e.lost or self._gone_why(slot)  # a worker that is gone is named as lost, not as late
            if len(self.live) - 1 < self.min_workers:
                if lost is None:  # late or refused: the message says which
                    raise
                raise WorkerError(self._lost_text(slot, lost)) from None
            # the learner's thread handles it (re-plans without the worker and sends these weights again)
            self.inbox.put(("lost", slot, self.generation, lost or str(e)))
            return 0.0

    def _gone_why(self, slot: int) -> str | None:
        """Why worker ``slot`` is gone, after a sync it did not take: its fetcher's finding if it has one, else the
        worker's own answer (no connection, or its session ended); None when it answers as serving the session or
        does not answer within ``PROBE_TIMEOUT`` (stopped or overloaded: late, not lost). Whichever thread notices
        a lost worker first, the run names it as lost."""
        session = self.live.get(slot, {}).get("session")
        if session in self.gone:
            return self.gone[session]
        try:
            status, reply = call(self.addresses[slot], "/v1/hello", {}, self.secret, self.PROBE_TIMEOUT, self.tls)
        except TimeoutError:
            return None
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        hello = _json_object(reply)
        if status == 200 and hello is not None and hello.get("session") != session:
            return "its session ended (the worker was restarted, or its session failed: see the worker's log)"
        return None

    def _send_file(self, version: int) -> float:
        """A version as safetensors pieces of at most ``bucket`` bytes and a manifest written last
        (:func:`~tokengym.agents.engine.sync_files.write_version`), which each worker reads and checks piece by
        piece; the files of the version before stay until the next one is taken."""
        from tokengym.agents.engine.sync_files import write_version

        t0 = time.perf_counter()
        try:
            paths = write_version(self.sync_dir, self.learner, version, self.named(), self.manifest, self.bucket)
        except OSError as e:
            raise WorkerError(f"policy version {version} cannot be written to --sync-dir {self.sync_dir} "
                              f"({type(e).__name__}: {e.strerror or e}); the run stops (its checkpoints are intact)") from None
        self.files.append(paths)
        path = paths[-1]
        dropped = 0
        for slot, s in sorted(self.live.items()):
            try:
                status, reply = call(self.addresses[slot], "/v1/weights",
                                     {"session": s["session"], "version": version, "path": path}, self.secret,
                                     self.timeout, self.tls)
            except OSError as e:
                lost = f"weights of version {version}: {type(e).__name__}: {e}"
            else:
                if status == 200:
                    continue
                lost = self._gone_why(slot)  # (its session ended: lost; else it refused the version)
                if len(self.live) - dropped - 1 < self.min_workers and lost is None:
                    raise WorkerError(f"{self._label(slot)} {_error_text(reply)}")
            if len(self.live) - dropped - 1 < self.min_workers:
                raise WorkerError(self._lost_text(slot, lost or _error_text(reply)))
            # as over a weight group: the learner's thread re-plans without the worker (--min-workers)
            self.inbox.put(("lost", slot, self.generation, lost or _error_text(reply)))
            dropped += 1
        while len(self.files) > 2:
            self._remove(self.files.pop(0))
        return time.perf_counter() - t0

    @staticmethod
    def _remove(paths: list[str]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                os.remove(path)

    def _shutdown(self) -> None:
        if self.live and self.store is not None and not self._in_flight():  # (after Ctrl-C a sync may still run)
            send_stop([s["sync"] for s in self.live.values()])
        self._end_sessions()
        for paths in self.files:
            self._remove(paths)
        if self.gate is not None:
            self.gate.close()

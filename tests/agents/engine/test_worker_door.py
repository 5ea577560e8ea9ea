"""The rollout worker's HTTP door (agents/engine/remote.py ``_Handler`` on envs/json_http.py): what a caller on the
network can send it, with or without the secret, and the worker keeps serving; and one learner at a time.

The worker runs in this process (``WorkerServer``), so each test can set its bounds small and read its log."""

import json
import os
import re
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import pytest

from tokengym.agents.engine import remote, tls
from tokengym.agents.engine.remote import WorkerServer, call
from tokengym.envs.json_http import too_deep

SECRET = b"door-test-secret"
AUTH = b"Authorization: Bearer " + SECRET + b"\r\n"


@pytest.fixture
def worker():
    """A worker on loopback, in this process, logging to this process's stderr."""
    server = WorkerServer(secret=SECRET)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.close()
    thread.join(30)


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)


def exchange(address: str, request: bytes) -> tuple[int, dict, bool]:
    """Send raw bytes, read one reply: ``(status, its JSON, whether the worker closes the connection after it)``."""
    import http.client

    with connect(address) as s:
        s.sendall(request)
        reply = http.client.HTTPResponse(s)
        reply.begin()
        body = json.loads(reply.read() or b"{}")
        closes = (reply.getheader("Connection") or "").lower() == "close"
        assert not closes or s.recv(1) == b""  # (it says so, and does)
        return reply.status, body, closes


def post(body: bytes, headers: bytes = b"", length: bool = True) -> bytes:
    size = b"Content-Length: %d\r\n" % len(body) if length else b""
    return b"POST /v1/hello HTTP/1.1\r\nHost: w\r\n" + AUTH + size + headers + b"\r\n" + body


def hello_ok(address: str) -> bool:
    status, reply = call(address, "/v1/hello", {}, SECRET, 30)
    return status == 200 and json.loads(reply)["protocol"] == remote.PROTOCOL


def log_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- the body
def test_a_body_nested_too_deep_or_too_large_is_refused_in_one_line_and_the_worker_keeps_serving(worker, capfd):
    deep = b"[" * 100_000 + b"]" * 100_000  # (the parser would recurse 100k levels)
    assert exchange(worker.address, post(deep)) == (400, {"error": "the message nests more than 64 levels deep"}, False)
    nest = lambda n: b'{"x": ' + b"[" * (n - 1) + b"]" * (n - 1) + b"}"  # noqa: E731
    assert exchange(worker.address, post(nest(remote.MAX_DEPTH)))[0] == 200  # the bound itself: served
    assert exchange(worker.address, post(nest(remote.MAX_DEPTH + 1)))[0] == 400
    big = b"POST /v1/hello HTTP/1.1\r\n" + AUTH + b"Content-Length: %d\r\n\r\n" % (remote.MAX_BODY + 1)
    status, reply, closed = exchange(worker.address, big)  # refused before a byte of the body is sent
    assert (status, closed) == (413, True) and reply["error"] == (f"a message of {remote.MAX_BODY + 1} bytes is over "
                                                                  f"the limit of {remote.MAX_BODY}")
    assert hello_ok(worker.address)
    lines = log_lines(capfd)
    assert len(lines) == 3 and all(re.search(r": refused POST /v1/hello from 127.0.0.1: ", x) for x in lines), lines
    # brackets inside strings are text, not nesting; escaped quotes do not end a string
    assert not too_deep(b'["[[[[", "\\"[[[[", {"a": [1]}]', 3) and too_deep(b'[[["]"]]]', 2)
    assert too_deep(b"[" * 5, 4) and not too_deep(b"[" * 4, 4) and not too_deep(b"", 0)


@pytest.mark.parametrize("headers, text", [
    (b"Content-Length: 2\r\nContent-Length: 40\r\n", "conflicting Content-Length headers (2, 40)"),
    (b"Content-Length: 2, 40\r\n", "conflicting Content-Length headers (2, 40)"),
    (b"Content-Length: abc\r\n", "Content-Length 'abc' is not a number of bytes"),
    (b"Content-Length: -2\r\n", "Content-Length '-2' is not a number of bytes"),
    (b"Content-Length: +2\r\n", "Content-Length '+2' is not a number of bytes"),
    (b"Content-Length: \r\n", "Content-Length '' is not a number of bytes"),
    (b"Transfer-Encoding: chunked\r\n", "a body sent with Transfer-Encoding is not read here; send a Content-Length"),
])
def test_a_content_length_that_does_not_frame_the_body_is_refused_and_the_connection_closed(worker, headers, text):
    status, reply, closed = exchange(worker.address, post(b"{}", headers, length=False))
    assert (status, reply, closed) == (400, {"error": text}, True)


def test_one_content_length_repeated_alike_frames_the_body(worker):
    assert exchange(worker.address, post(b"{}", b"Content-Length: 2\r\nContent-Length: 2\r\n", length=False))[0] == 200


# ---------------------------------------------------------------------------------------------- connections
def test_idle_connections_are_bounded_and_timed_out_and_a_learner_still_gets_in(worker, monkeypatch):
    monkeypatch.setattr(tls, "HANDSHAKE_SECONDS", 600.0)  # a silent client waits the read timeout, not the handshake's
    handler = worker.httpd.RequestHandlerClass
    handler.max_connections, handler.read_timeout = 4, 600.0  # (held for the whole first part)
    ours = lambda: [t for t in threading.enumerate() if t.name.endswith("(process_request_thread)")]  # noqa: E731
    before = set(ours())
    idle = [connect(worker.address) for _ in range(20)]
    for s in idle[4:]:  # past the bound: answered 503 and closed at once, no thread
        reply = b"".join(iter(lambda s=s: s.recv(4096), b""))
        assert reply.startswith(b"HTTP/1.1 503 ") and b"holds 4 connections, its limit" in reply, reply
    assert len(set(ours()) - before) == 4
    for s in idle:
        s.close()
    handler.read_timeout = 0.5
    deadline = time.monotonic() + 60
    while True:  # the idle ones' threads end as the worker sees them closed
        try:
            if hello_ok(worker.address):
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the worker never served a learner again"
        time.sleep(0.1)
    silent, dripping = connect(worker.address), connect(worker.address)
    dripping.sendall(b"POST /v1/hello HTTP/1.1\r\n" + AUTH)  # the headers never end
    for s in (silent, dripping):  # closed by the worker within its read timeout (generous deadline: a loaded machine)
        s.settimeout(60)
        assert s.recv(4096) == b""
        s.close()
    assert hello_ok(worker.address)


def test_fifty_learners_calling_at_once_are_all_answered(worker):
    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda _: hello_ok(worker.address), range(50)))
    assert answers == [True] * 50


def test_a_client_gone_mid_body_costs_at_most_one_log_line(worker, capfd):
    """One client closes after part of its body (FIN), one resets (RST): each costs the worker's log at most one line
    naming what happened (the first one a line for sure), no traceback, and the worker keeps serving."""
    for how in ("close", "reset"):
        s = connect(worker.address)
        s.sendall(post(b'{"env": ' + b" " * 100)[:-50])  # Content-Length says 108, 58 bytes come
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    assert hello_ok(worker.address)
    lines, deadline = [], time.monotonic() + 60
    while not any(x.endswith("the client left after 58 of 108 bytes") for x in lines):
        assert time.monotonic() < deadline, lines
        lines += log_lines(capfd)
        time.sleep(0.05)
    assert len(lines) <= 2 and all(x.startswith(f"tokengym worker {worker.address}: dropped POST /v1/hello from "
                                                "127.0.0.1: ") for x in lines), lines


# ---------------------------------------------------------------------------------------------- one learner at a time
def test_a_second_learner_stops_at_once_before_its_run_folder_while_the_worker_serves_another(worker, tmp_path, capsys,
                                                                                             monkeypatch):
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy
    from tokengym.agents.cli import main

    monkeypatch.setenv("TOKENGYM_SECRET", SECRET.decode())
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4)
    first = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                      GRPOConfig(steps=3, lr=1e-3, mu=1, minibatches=1, seed=3, async_mode="one-step",
                                 remote_workers=worker.address, sync_timeout=600.0))
    seen = {}

    def second(record):
        if record["step"] == 1:  # the first learner is mid-run: a second one names its worker
            seen["code"] = main(["train", "grpo", "--steps", "2", "--eval-prompts", "0", "--progress", "false",
                                 "--threads", "1", "--async-mode", "one-step", "--rollout-workers", worker.address,
                                 "--sync-timeout", "600", "--runs-dir", str(tmp_path / "runs"), "--name", "second"])
            session = json.loads(call(worker.address, "/v1/hello", {}, SECRET, 30)[1])["session"]
            body = {"protocol": remote.PROTOCOL, "session": "another-1-0", "env": {}, "model": None, "temperature": 1,
                    "workers": 1, "worker": 0, "slot": 0, "k": 1, "exact": True, "start": 0, "stream": None, "seed": 0,
                    "store": None, "prefix": "", "manifest": [], "timeout": 1, "bf16": False, "sampler": "tokengym"}
            seen["join"] = call(worker.address, "/v1/join", body, SECRET, 30)  # (a learner past the check: refused)
            seen["session"] = session

    history = first.learn(env, callback=second)
    assert len(history) == 3  # the first learner was not disturbed
    err = capsys.readouterr().err.strip().splitlines()  # (the in-process worker logs to the same stderr)
    errors = [x for x in err if x.startswith("tokengym: error: ")]
    assert seen["code"] == 2 and errors == [(f"tokengym: error: rollout worker {worker.address} serves another learner "
                                             f"now (session {seen['session'][:8]}): stop that run, or name another "
                                             "worker (a learner that died frees its workers within 30 s)")], err
    assert not (tmp_path / "runs").exists()
    assert seen["join"][0] == 409 and json.loads(seen["join"][1])["error"] == (
        f"serves another learner now (session {seen['session'][:8]}): stop that run, or name another worker")
    assert hello_ok(worker.address) and not json.loads(call(worker.address, "/v1/hello", {}, SECRET, 30)[1])["busy"]


def test_the_documented_limits_are_the_code_s():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "scaling.md")) as f:
        page = " ".join(f.read().split())
    for claim in (f"at most {remote.MAX_BODY >> 20} MiB", f"{remote.MAX_DEPTH} levels of nested",
                  f"within {remote.READ_TIMEOUT:g} s", f"At most {remote.MAX_CONNECTIONS} connections",
                  f"has not asked for {remote.SESSION_IDLE:g} s"):
        assert claim in page, claim


def test_lines_logged_by_many_handler_threads_at_once_stay_whole(worker, lines_logged_at_once):
    lines = lines_logged_at_once(worker.log)
    assert len(lines) == 8 * 300 and all(re.fullmatch(rf"tokengym worker {worker.address}: line \d\.\d+", x) for x in lines)

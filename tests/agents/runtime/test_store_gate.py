"""The learner's weight store behind a token (agents/runtime/store_gate.py): a connection that does not prove the token
gets nothing but a nonce, cannot reach the store, and a run with a remote worker that strangers knock at goes on
exactly as one without them; a weight group's peer without the token is refused before any weights move."""

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import gymnasium as gym
import pytest
import torch
import torch.distributed as dist

from tokengym.agents.runtime.store_gate import HandshakeError, StoreGate, StoreTunnel, handshake
from tokengym.agents.runtime.weight_sync import WeightSync

SECRET = "store-gate-secret"


def knock(port: int, answer: bytes | None) -> bytes:
    """A stranger at the gate: reads what it is sent, answers ``answer`` (None: nothing), returns all it got."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        while len(got) < 32:
            part = s.recv(64)
            if not part:
                return got
            got += part
        if answer is None:
            return got
        s.sendall(answer)
        while part := s.recv(64):
            got += part
    return got


def test_only_a_connection_that_proves_the_token_reaches_the_store():
    gate = StoreGate(1, 30.0, "127.0.0.1")
    try:
        gate.store.set("weights/secret", "learner-only")
        first, second = knock(gate.port, b"\0" * 32), knock(gate.port, b"\0" * 32)
        assert len(first) == len(second) == 32 and first != second  # a fresh nonce each, then the door shuts
        assert gate.refused == 2  # (counted before the gate closes the connection)
        assert gate.conns == []  # (and forgotten: strangers knocking for days hold nothing of the gate's)
        tunnel = StoreTunnel("127.0.0.1", gate.port, gate.token)
        client = dist.TCPStore("127.0.0.1", tunnel.port, 2, False, timeout=datetime.timedelta(seconds=30))
        assert client.get("weights/secret") == b"learner-only"  # the proof opens it, both ways
        client.set("ack/1/0", "ok")
        assert gate.store.get("ack/1/0") == b"ok" and gate.refused == 2
        tunnel.close()
        wrong = StoreTunnel("127.0.0.1", gate.port, os.urandom(32))
        with pytest.raises((RuntimeError, dist.DistStoreError)):
            dist.TCPStore("127.0.0.1", wrong.port, 2, False, timeout=datetime.timedelta(seconds=5))
        wrong.close()
        assert gate.refused > 2  # (the store client retries its connection a few times: each one refused)
        assert _listening(gate.inner_port) == ["127.0.0.1"]  # the store itself: on loopback only
    finally:
        gate.close()


def _listening(port: int) -> list[str]:
    """The local addresses this machine listens on at ``port`` (from /proc/net/tcp and tcp6; IPv6 ones as hex)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.append(socket.inet_ntoa(bytes.fromhex(host)[::-1]) if len(host) == 8 else host)
    return out


def test_a_group_peer_without_the_token_is_refused_before_any_weights():
    store = dist.HashStore()
    token, errors = os.urandom(32), {}

    def side(rank: int, key: bytes) -> None:
        try:
            sync = WeightSync(dist.PrefixStore("t/", store), rank, 1, 10.0, "cpu", hostname="127.0.0.1")
            handshake(sync, key, "session-1")
            errors[rank] = None
        except Exception as e:  # noqa: BLE001
            errors[rank] = e

    for keys in ((token, token), (token, os.urandom(32))):
        store = dist.HashStore()
        threads = [threading.Thread(target=side, args=(r, k)) for r, k in enumerate(keys)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if keys[0] == keys[1]:
            assert errors == {0: None, 1: None}
        else:  # the worker side sees the learner's proof fail, and never shows its own
            assert isinstance(errors[1], HandshakeError) and "learner did not prove the store token" in str(errors[1])
            assert errors[0] is not None


# ---------------------------------------------------------------------------------------------- a run
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker():
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", "worker", "--listen", "127.0.0.1:0",
                             "--threads", "1"], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TOKENGYM_SECRET=SECRET))
    found = re.search(r"listening on (\S+) ", proc.stdout.readline())
    assert found
    yield found.group(1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_strangers_at_the_store_get_no_weights_and_do_not_change_the_run(worker, monkeypatch):
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy

    monkeypatch.setenv("TOKENGYM_SECRET", SECRET)
    port = free_port()

    def run(callback=None):
        agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                          GRPOConfig(steps=3, lr=1e-3, mu=1, minibatches=1, seed=3, async_mode="one-step",
                                     remote_workers=worker, sync_port=port))
        env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4)
        history = agent.learn(env, callback=callback)
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))}
                for r in history], agent.policy.model.state_dict()

    got = {}

    def strangers(record):
        if record["step"] == 1:  # the store serves the run now: knock, answer wrong, hang on, speak the store's tongue
            got["wrong"] = knock(port, os.urandom(32))
            got["silent"] = socket.create_connection(("127.0.0.1", port), timeout=60)
            with pytest.raises((RuntimeError, dist.DistStoreError)):
                dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=3))

    h_clean, w_clean = run()
    h_knocked, w_knocked = run(strangers)
    got["silent"].close()
    assert len(got["wrong"]) == 32  # a nonce, and nothing of the store
    assert h_knocked == h_clean and len(h_clean) == 3
    assert all(torch.equal(w_knocked[k], w_clean[k]) for k in w_clean)

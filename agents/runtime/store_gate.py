"""A token in front of the learner's weight store, for remote workers: torch's TCPStore has no authentication.

The learner's real store listens on loopback only; :class:`StoreGate` listens on ``--sync-host:--sync-port`` and
sends each connection a fresh 32-byte nonce: one that answers ``HMAC-SHA256(token, nonce)`` within
:data:`HANDSHAKE_SECONDS` is piped to the store, any other is closed having received nothing else. The token is
fresh for each learner and travels only inside the authenticated join message (encrypted with TLS). On the worker,
:class:`StoreTunnel` listens on loopback and sends the proof for its store client. Then :func:`handshake` is the
weight group's first exchange: each side shows an HMAC of the token and the session before any weights flow, so a
stranger that reaches gloo's own ports while a group forms (they are not behind the gate) neither receives weights
nor sends any. What this does not cover is in docs/scaling.md (on-path observers, denial of service).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StoreGate", "StoreTunnel", "handshake", "HandshakeError", "HANDSHAKE_SECONDS"]

HANDSHAKE_SECONDS = 30.0
"""How long a connection to the gate may take to prove the token."""

_NONCE = 32


def _proof(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, b"tokengym-store\0" + nonce, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` and ``b`` (a thread each way) until either side closes."""

    def copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # (one side gone: the other's store client sees the connection end)
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=copy, args=(src, dst), name="store-pipe", daemon=True).start()


class _Listener:
    """A listening socket whose connections a thread hands to ``self._serve`` (one thread each)."""

    def __init__(self, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=128)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"{type(self).__name__}-{self.port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Pipe ``conn`` to the peer :meth:`_open` gives; a connection it refuses is closed and forgotten."""
        try:
            peer = self._open(conn)
        except OSError:
            self._refused()
            with contextlib.suppress(ValueError):
                self.conns.remove(conn)  # (a gate that strangers knock at for days holds none of theirs)
            with contextlib.suppress(OSError):
                conn.close()
            return
        self.conns.append(peer)
        _pipe(conn, peer)

    def _open(self, conn: socket.socket) -> socket.socket:
        """The socket ``conn`` goes to; ``OSError`` refuses it."""
        raise NotImplementedError

    def _refused(self) -> None:
        """Called for each connection :meth:`_open` refused."""

    def stop_listening(self) -> None:
        """Take no more connections (those made stay)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def close(self) -> None:
        """Take no more connections and end those made."""
        self.stop_listening()
        for c in list(self.conns):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


class StoreGate(_Listener):
    """The learner's weight store for ``workers`` remote workers behind a token (see the module docstring):
    :attr:`store` is the TCPStore (on loopback), :attr:`port` the gate's port on ``host``, :attr:`token` what a
    worker proves."""

    def __init__(self, workers: int, timeout: float, host: str, port: int = 0):
        self.token = os.urandom(32)
        self.refused = 0  # connections that did not prove the token
        inner = socket.create_server(("127.0.0.1", 0), backlog=128)  # the store's own socket: loopback only
        self.inner_port = inner.getsockname()[1]
        delta = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore("127.0.0.1", self.inner_port, workers + 1, True, timeout=delta,
                                   wait_for_workers=False, master_listen_fd=inner.detach())
        try:
            super().__init__(host, port)
        except OSError as e:
            raise ValueError(f"the weight store cannot listen on {host}:{port} (--sync-host/--sync-port): "
                             f"{e.strerror or e}") from None

    def _open(self, conn: socket.socket) -> socket.socket:
        nonce = os.urandom(_NONCE)
        conn.settimeout(HANDSHAKE_SECONDS)
        conn.sendall(nonce)
        if not hmac.compare_digest(_recv_exactly(conn, 32), _proof(self.token, nonce)):
            raise ConnectionRefusedError("no proof of the token")
        conn.settimeout(None)
        return socket.create_connection(("127.0.0.1", self.inner_port))

    def _refused(self) -> None:
        self.refused += 1


class StoreTunnel(_Listener):
    """The worker's way into a learner's :class:`StoreGate` at ``host:port``: connections to :attr:`port` on
    loopback (the worker's store client) go there with the proof of ``token``. Call :meth:`stop_listening` once
    the weight group is formed, and :meth:`close` when the session ends."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float = HANDSHAKE_SECONDS):
        self.target, self.token, self.timeout = (host, port), token, timeout
        super().__init__("127.0.0.1", 0)

    def _open(self, conn: socket.socket) -> socket.socket:
        gate = socket.create_connection(self.target, timeout=self.timeout)
        try:
            gate.sendall(_proof(self.token, _recv_exactly(gate, _NONCE)))
            gate.settimeout(None)
        except OSError:
            gate.close()
            raise
        return gate


class HandshakeError(PermissionError):
    """The weight group's peer did not prove the token: not the worker (or learner) the token went to."""


def handshake(sync: Any, token: bytes, session: str) -> None:
    """The weight group's first exchange (a 2-rank :class:`~tokengym.agents.runtime.weight_sync.WeightSync`): the
    learner (rank 0) shows ``HMAC(token, "learner" + session)``, then the worker (rank 1) its own; each side checks
    the other's and raises :class:`HandshakeError` on a mismatch, before any weights are sent or taken."""
    for root, role in ((0, b"learner"), (1, b"worker")):
        expect = hmac.new(token, role + b"\0" + session.encode(), hashlib.sha256).digest()
        box = torch.zeros(32, dtype=torch.uint8)
        if sync.rank == root:
            box = torch.tensor(list(expect), dtype=torch.uint8)
        box = box.to(sync.comm_device)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        sync.group.broadcast([box], opts).wait()
        if sync.rank != root and not hmac.compare_digest(bytes(box.cpu().tolist()), expect):
            who = "learner" if root == 0 else "worker"
            raise HandshakeError(f"the weight group's {who} did not prove the store token (a connection that is not "
                                 f"the {who} this session's token went to); no weights were exchanged")

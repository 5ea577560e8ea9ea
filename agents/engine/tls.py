"""TLS for the rollout worker's control channel: the worker's HTTPS server and the learner's client side.

``tokengym worker --tls-cert CERT --tls-key KEY`` serves HTTPS (TLS 1.2 or newer). A learner given ``worker_ca`` (a CA,
or the worker's self-signed certificate itself: verified, host name or IP included) and/or ``worker_fingerprint`` (the
certificate's SHA-256, pinned) talks HTTPS to every worker and checks the certificate before a request, and so the
secret, leaves. Each connection's first byte says which protocol the client speaks; a worker answers the other one
with a plain-HTTP refusal (426 to plain HTTP on a TLS worker, 400 to a TLS hello on a plain one), so the learner can
say in one line which side to change. The handshake runs in the connection's own thread: a client that never
finishes one holds up no one else.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import os
import re
import socket
import ssl
import stat
from typing import Any

from tokengym.envs.json_http import ThreadedServer, error_reply

__all__ = ["WorkerHTTPServer", "ClientTLS", "CertificateMismatch", "server_context", "certificate_fingerprint",
           "parse_fingerprint", "TLS_REFUSAL", "PLAIN_REFUSAL"]

TLS_REFUSAL = 426  # a plain-HTTP request at a TLS worker
PLAIN_REFUSAL = "this worker speaks plain HTTP, not TLS"
HANDSHAKE_SECONDS = 30.0  # how long a TLS handshake may take (and the first byte, where no read timeout is shorter)
_HANDSHAKE = 0x16  # a TLS record's first byte (a ClientHello)


class CertificateMismatch(ssl.SSLError):
    """The worker's certificate is not the one pinned (``worker_fingerprint``); the message says so in one line."""

    def __str__(self) -> str:  # (ssl.SSLError prints its args tuple when it has no errno/strerror)
        return str(self.args[0]) if self.args else ""


def _read_pem(flag: str, path: str, block: str) -> bytes:
    """The PEM file ``path`` of the setting ``flag``; ``ValueError`` (one line) when it is missing, unreadable, or
    holds no ``-----BEGIN ...{block}-----`` block."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        raise ValueError(f"{flag} {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{flag} {path} is a folder, not a PEM file") from None
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be read ({e.strerror or e})") from None
    if not re.search(rb"-----BEGIN [A-Z0-9 ]*" + block.encode() + rb"-----", data):
        raise ValueError(f"{flag} {path} is not a PEM file holding a {block.lower()} (no '-----BEGIN {block}-----')")
    return data


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """The worker's TLS context (TLS 1.2+) from a PEM certificate (chain) and its unencrypted PEM private key;
    ``ValueError`` (one line) for a file that is missing, unreadable or not PEM, a key every user may read, an
    encrypted key, or a key that does not belong to the certificate."""
    _read_pem("--tls-cert", cert, "CERTIFICATE")
    _read_pem("--tls-key", key, "PRIVATE KEY")
    mode = os.stat(key).st_mode
    if mode & stat.S_IROTH:  # refused as ssh refuses such a private key, and as the secret file is
        raise ValueError(f"--tls-key {key!r} is readable by every user (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2

    def no_passphrase() -> bytes:  # (never prompt on the terminal: a worker runs unattended)
        raise ValueError(f"--tls-key {key} is encrypted with a passphrase; give the worker an unencrypted key "
                         "(chmod 600 it)")

    try:
        ctx.load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e) or "key values mismatch" in str(e):
            raise ValueError(f"--tls-key {key} does not match --tls-cert {cert} (the key of another "
                             "certificate)") from None
        raise ValueError(f"--tls-cert {cert} with --tls-key {key} cannot be loaded ({e.reason or e})") from None
    return ctx


def certificate_fingerprint(cert: str) -> str:
    """The SHA-256 of the first certificate in the PEM file ``cert``, as ``AB:CD:...`` (what ``openssl x509
    -fingerprint -sha256`` prints, and what ``--worker-fingerprint`` takes)."""
    pem = _read_pem("--tls-cert", cert, "CERTIFICATE").decode("ascii", "replace")
    first = re.search(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", pem, re.S)
    if first is None:
        raise ValueError(f"--tls-cert {cert} holds no complete certificate")
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(first.group(0))).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, 64, 2))


def parse_fingerprint(text: str) -> bytes:
    """``worker_fingerprint`` (64 hex digits, colons allowed) as 32 bytes; ``ValueError`` (one line) otherwise."""
    digits = text.strip().replace(":", "")
    if len(digits) != 64 or not re.fullmatch(r"[0-9a-fA-F]+", digits):
        raise ValueError(f"worker_fingerprint {text!r} is not a SHA-256 fingerprint (64 hex digits, colons allowed): "
                         "`openssl x509 -in CERT -noout -fingerprint -sha256` prints it, and so does `tokengym worker`")
    return bytes.fromhex(digits)


# ---------------------------------------------------------------------------------------------- the worker's side
def _refuse_and_close(sock: socket.socket, code: int, text: str) -> None:
    """Answer a client of the other protocol in plain HTTP, then read what it sent until it closes (closing with its
    bytes unread would reset the connection before it reads the answer)."""
    try:
        sock.sendall(error_reply(code, text))
        sock.shutdown(socket.SHUT_WR)
        for _ in range(256):  # at most 16 MiB, each read bounded by the socket's timeout
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass


class WorkerHTTPServer(ThreadedServer):
    """The worker's threaded HTTP server, HTTPS with ``context`` (see the module docstring)."""

    def __init__(self, address: tuple[str, int], handler: Any, context: ssl.SSLContext | None = None):
        self.context = context
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        read_timeout = getattr(self.RequestHandlerClass, "read_timeout", None)  # (a silent client waits no longer)
        try:
            request.settimeout(HANDSHAKE_SECONDS if read_timeout is None else min(HANDSHAKE_SECONDS, read_timeout))
            first = request.recv(1, socket.MSG_PEEK)
        except OSError:
            return
        if not first:
            return
        tls = first[0] == _HANDSHAKE
        if tls != (self.context is not None):
            if tls:
                _refuse_and_close(request, 400, PLAIN_REFUSAL)
            else:
                _refuse_and_close(request, TLS_REFUSAL, "this worker speaks TLS: the learner needs --worker-ca or "
                                  "--worker-fingerprint")
            return
        if self.context is None:
            request.settimeout(None)
            return super().finish_request(request, client_address)
        try:
            request.settimeout(HANDSHAKE_SECONDS)
            conn = self.context.wrap_socket(request, server_side=True)  # (the handshake; closes itself on failure)
        except (OSError, ValueError):
            return
        try:
            conn.settimeout(None)
            super().finish_request(conn, client_address)
        finally:
            conn.close()


# ---------------------------------------------------------------------------------------------- the learner's side
class ClientTLS:
    """The learner's TLS to its workers: verify each certificate against ``ca`` (a CA or a self-signed certificate;
    the worker's host name or IP must be in it) and/or pin its SHA-256 ``fingerprint``. ``ValueError`` (one line) for
    a CA file that is missing, unreadable or not PEM, or a fingerprint that is not 64 hex digits."""

    def __init__(self, ca: str = "", fingerprint: str = ""):
        self.ca, self.fingerprint = ca, fingerprint
        self.pin = parse_fingerprint(fingerprint) if fingerprint else None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if ca:
            _read_pem("--worker-ca", ca, "CERTIFICATE")
            try:
                ctx.load_verify_locations(cafile=ca)
            except ssl.SSLError as e:
                raise ValueError(f"--worker-ca {ca} cannot be loaded ({e.reason or e})") from None
        else:  # the pin is the check
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        self.context = ctx

    @property
    def given(self) -> str:
        """The settings that say what the certificate must be, as flags."""
        return " and ".join(f"--worker-{k} {v}" for k, v in (("ca", self.ca), ("fingerprint", self.fingerprint)) if v)

    def connection(self, host: str, port: int, timeout: float) -> http.client.HTTPSConnection:
        """An HTTPS connection to a worker that checks its certificate on connecting, before any request."""
        tls = self

        class Checked(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                if tls.pin is not None:
                    der = self.sock.getpeercert(binary_form=True) or b""
                    if not hmac.compare_digest(hashlib.sha256(der).digest(), tls.pin):
                        self.sock.close()
                        raise CertificateMismatch(f"certificate of {host}:{port} does not match {tls.given} (its "
                                                  f"SHA-256 is {hashlib.sha256(der).hexdigest().upper()})")

        return Checked(host, port, timeout=timeout, context=self.context)

    def explain(self, address: str, e: BaseException) -> str | None:
        """One line for a failed TLS call to ``address``: the certificate does not match, or the worker speaks plain
        HTTP; None for any other failure (a network one)."""
        if isinstance(e, CertificateMismatch):
            return str(e)
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"certificate of {address} does not match {self.given} ({e.verify_message or e.reason})"
        if isinstance(e, ssl.SSLError):
            return (f"{address} speaks plain HTTP, not TLS: leave out --worker-ca and --worker-fingerprint, or start "
                    f"that worker with --tls-cert and --tls-key ({e.reason or e})")
        return None

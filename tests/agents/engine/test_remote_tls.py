"""TLS on the rollout worker's control channel (agents/engine/tls.py): a ``tokengym worker --tls-cert --tls-key`` on
loopback serves a learner that checks its certificate (a CA file or a pinned SHA-256), and every mismatch of the two
sides, or of the certificate, is one line before a run is made. Certificates are made here, at test time."""

import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import gymnasium as gym
import pytest

from tokengym.agents import GRPOAgent, GRPOConfig, Policy
from tokengym.agents.cli import main
from tokengym.agents.engine.remote import PROTOCOL, WorkerServer, call, check_workers_reachable
from tokengym.agents.engine.tls import ClientTLS, certificate_fingerprint

SECRET = "tls-test-secret"


def make_cert(folder, name: str, encrypt: bool = False) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key, as PEM files ``name.pem``/``name.key``
    (the key under the passphrase "pw" with ``encrypt``): with the cryptography package, else the openssl tool."""
    cert, key = os.path.join(folder, f"{name}.pem"), os.path.join(folder, f"{name}.key")
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("making a test certificate needs the cryptography package or the openssl tool")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "30", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
        if encrypt:
            subprocess.run(["openssl", "pkey", "-in", key, "-out", key, "-aes256", "-passout", "pass:pw"], check=True,
                           capture_output=True)
        os.chmod(key, 0o600)  # a private key only its owner reads, as the worker requires
        return cert, key
    k = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
         .not_valid_after(now + datetime.timedelta(days=30))
         .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .sign(k, hashes.SHA256()))
    crypt = serialization.BestAvailableEncryption(b"pw") if encrypt else serialization.NoEncryption()
    with open(cert, "wb") as f:
        f.write(c.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as f:
        f.write(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt))
    os.chmod(key, 0o600)  # a private key only its owner reads, as the worker requires
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    (worker, key), (other, other_key) = make_cert(str(root), "worker"), make_cert(str(root), "other")
    _, locked = make_cert(str(root), "locked", encrypt=True)
    with open(root / "not_pem.txt", "w") as f:
        f.write("just text\n")
    shutil.copy(key, root / "open.key")
    os.chmod(root / "open.key", 0o644)
    return {"cert": worker, "key": key, "other": other, "other_key": other_key, "locked": locked,
            "not_pem": str(root / "not_pem.txt"), "open_key": str(root / "open.key"), "root": str(root)}


@pytest.fixture(scope="module")
def tls_worker(certs):
    """A ``tokengym worker`` speaking TLS; ``(address, the fingerprint it printed)``."""
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", "worker", "--listen", "127.0.0.1:0",
                             "--threads", "1", "--tls-cert", certs["cert"], "--tls-key", certs["key"]],
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TOKENGYM_SECRET=SECRET))
    line = proc.stdout.readline()
    found = re.search(r"listening on (\S+) \(protocol \d+, TLS, certificate SHA-256 ([0-9A-F:]+)\)", line)
    assert found, f"the worker did not start: {line!r}"
    yield found.group(1), found.group(2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture
def plain_worker():
    """A plain-HTTP worker in this process (it answers hellos; nothing here joins it)."""
    server = WorkerServer(secret=SECRET.encode(), quiet=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.address
    server.close()


def test_the_printed_fingerprint_is_the_certificates_sha256(certs, tls_worker):
    digest = subprocess.run(["openssl", "x509", "-in", certs["cert"], "-noout", "-fingerprint", "-sha256"],
                            capture_output=True, text=True) if shutil.which("openssl") else None
    if digest is not None and digest.returncode == 0:  # an implementation of its own says the same
        assert digest.stdout.strip().split("=", 1)[1] == tls_worker[1]
    assert certificate_fingerprint(certs["cert"]) == tls_worker[1] != certificate_fingerprint(certs["other"])
    assert len(tls_worker[1].replace(":", "")) == 64


def test_a_learner_that_checks_the_certificate_gets_a_hello_and_trains_on_a_tls_worker(certs, tls_worker, monkeypatch):
    address, fingerprint = tls_worker
    for tls in (ClientTLS(ca=certs["cert"]), ClientTLS(fingerprint=fingerprint.replace(":", "").lower()),
                ClientTLS(ca=certs["cert"], fingerprint=fingerprint)):
        status, reply = call(address, "/v1/hello", {}, SECRET.encode(), 10, tls)
        assert status == 200 and json.loads(reply)["protocol"] == PROTOCOL
    status, _ = call(address, "/v1/hello", {}, b"wrong", 10, ClientTLS(ca=certs["cert"]))
    assert status == 401  # TLS does not stand in for the secret
    monkeypatch.setenv("TOKENGYM_SECRET", SECRET)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                      GRPOConfig(steps=2, lr=1e-3, mu=1, minibatches=1, seed=3, async_mode="one-step",
                                 remote_workers=address, worker_fingerprint=fingerprint))
    start = {k: v.clone() for k, v in agent.policy.model.state_dict().items()}
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4)
    history = agent.learn(env)
    assert [r["async/workers"] for r in history] == [1.0, 1.0]
    after = agent.policy.model.state_dict()
    assert max(float((after[k] - start[k]).abs().max()) for k in after) > 1e-5  # rollouts came, updates happened


def test_each_mismatch_of_the_two_sides_or_the_certificate_is_one_line(certs, tls_worker, plain_worker):
    address, fingerprint = tls_worker
    port = address.rsplit(":", 1)[1]
    other = certificate_fingerprint(certs["other"])
    cases = [
        ([address], None, f"{address} speaks TLS: pass --worker-ca or --worker-fingerprint"),
        ([plain_worker], ClientTLS(ca=certs["cert"]), f"{plain_worker} speaks plain HTTP, not TLS: leave out "
                                                      "--worker-ca and --worker-fingerprint, or start that worker with "
                                                      "--tls-cert and --tls-key"),
        ([address], ClientTLS(fingerprint=other), f"certificate of 127.0.0.1:{port} does not match "
                                                  f"--worker-fingerprint {other} (its SHA-256 is "
                                                  f"{fingerprint.replace(':', '')})"),
        ([address], ClientTLS(ca=certs["other"]), f"certificate of {address} does not match --worker-ca "
                                                  f"{certs['other']} ("),
        (["localhost:" + port], ClientTLS(ca=certs["cert"], fingerprint=other), "certificate of localhost:"
                                                                                f"{port} does not match --worker-ca"),
    ]
    for addresses, tls, text in cases:
        with pytest.raises(ValueError) as caught:
            check_workers_reachable(addresses, SECRET.encode(), None, tls=tls)
        message = str(caught.value)
        assert "\n" not in message and message.startswith(text), message
    check_workers_reachable([address], SECRET.encode(), None, tls=ClientTLS(ca=certs["cert"]))  # the right one passes
    check_workers_reachable([plain_worker], SECRET.encode())


WORKER = ["worker", "--listen", "127.0.0.1:0", "--threads", "1"]
TRAIN = ["train", "grpo", "--steps", "2", "--eval-prompts", "0", "--progress", "false", "--threads", "1",
         "--async-mode", "one-step"]
BAD = {  # id -> (argv, a piece of the one-line message); {name} is a file of the certs fixture
    "cert missing": ([*WORKER, "--tls-cert", "{root}/nope.pem", "--tls-key", "{key}"], "nope.pem does not exist"),
    "cert is a folder": ([*WORKER, "--tls-cert", "{root}", "--tls-key", "{key}"], "is a folder, not a PEM file"),
    "cert not pem": ([*WORKER, "--tls-cert", "{not_pem}", "--tls-key", "{key}"],
                     "not_pem.txt is not a PEM file holding a certificate"),
    "key not pem": ([*WORKER, "--tls-cert", "{cert}", "--tls-key", "{not_pem}"], "not a PEM file holding a private key"),
    "key of another cert": ([*WORKER, "--tls-cert", "{cert}", "--tls-key", "{other_key}"],
                            "other.key does not match --tls-cert"),
    "encrypted key": ([*WORKER, "--tls-cert", "{cert}", "--tls-key", "{locked}"], "is encrypted with a passphrase"),
    "key every user may read": ([*WORKER, "--tls-cert", "{cert}", "--tls-key", "{open_key}"],
                                "--tls-key '{open_key}' is readable by every user (mode 644); chmod 600 it"),
    "cert without key": ([*WORKER, "--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
    "fingerprint not hex": ([*TRAIN, "--rollout-workers", "127.0.0.1:9", "--worker-fingerprint", "zz" * 32],
                            "is not a SHA-256 fingerprint (64 hex digits, colons allowed)"),
    "fingerprint too short": ([*TRAIN, "--rollout-workers", "127.0.0.1:9", "--worker-fingerprint", "AB:CD"],
                              "'AB:CD' is not a SHA-256 fingerprint"),
    "ca missing": ([*TRAIN, "--rollout-workers", "127.0.0.1:9", "--worker-ca", "{root}/nope.pem"],
                   "--worker-ca " "{root}/nope.pem does not exist"),
    "ca not pem": ([*TRAIN, "--rollout-workers", "127.0.0.1:9", "--worker-ca", "{not_pem}"], "is not a PEM file"),
    "plain learner, tls worker": ([*TRAIN, "--rollout-workers", "{tls}"], "{tls} speaks TLS: pass --worker-ca"),
    "pinned another cert": ([*TRAIN, "--rollout-workers", "{tls}", "--worker-ca", "{other}"],
                            "certificate of {tls} does not match --worker-ca"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tls_input_is_one_line_exit_2_and_makes_nothing(certs, tls_worker, tmp_path, capsys, monkeypatch, case):
    monkeypatch.setenv("TOKENGYM_SECRET", SECRET)
    argv, text = BAD[case]
    names = {**certs, "tls": tls_worker[0]}
    fill = lambda s: re.sub(r"\{(\w+)\}", lambda m: names[m.group(1)], s)  # noqa: E731
    argv = [fill(a) for a in argv] + (["--runs-dir", str(tmp_path / "runs"), "--name", "x"] if argv[0] == "train" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fill(text) in err, err
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")

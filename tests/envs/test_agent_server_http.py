"""The agent env's HTTP side (``envs/adapters/agent_server.py``): a ``Content-Length`` that does not frame the body
is a 400, never guessed at (RFC 9112)."""

import http.client
import json

import pytest

from tokengym.envs.adapters.agent_server import AgentServer


@pytest.fixture(scope="module")
def server():
    s = AgentServer(["m"], secret="s3cret")
    host, port = s.serve().removeprefix("http://").rsplit(":", 1)
    yield host, int(port)
    s.httpd.shutdown()


def _post(server, lengths):
    conn = http.client.HTTPConnection(*server, timeout=30)
    conn.putrequest("POST", "/e/x/v1/chat/completions")
    conn.putheader("Authorization", "Bearer s3cret")
    for n in lengths:
        conn.putheader("Content-Length", n)
    conn.endheaders(b"{}")
    reply = conn.getresponse()
    out = reply.status, json.loads(reply.read())["error"]["message"]
    conn.close()
    return out


@pytest.mark.parametrize("lengths, says", [
    (["+2"], "Content-Length '+2' is not a number of bytes"),  # int() took it
    (["2", "3"], "conflicting Content-Length headers (2, 3)"),  # the first one won
    (["x"], "Content-Length 'x' is not a number of bytes"),  # int() raised in the handler: no reply at all
])
def test_a_content_length_that_does_not_frame_the_body_is_a_400(server, lengths, says):
    assert _post(server, lengths) == (400, says)


def test_a_plain_length_still_reaches_the_router(server):
    assert _post(server, ["2"]) == (410, "episode x is over (or never was): its calls are no longer answered")

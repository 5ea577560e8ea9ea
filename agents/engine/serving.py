"""``tokengym serve``: a policy behind the OpenAI HTTP API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``), for the ``openai`` client and the agent frameworks built on it.

Requests are checked and answered in the wire format of :mod:`tokengym.envs.openai_api` (errors as one line, with
OpenAI's status codes); every request must carry the server's secret (``Authorization: Bearer ...``, as a rollout
worker's). A chat is rendered by the tokenizer's chat template (``tools=`` passed to it; a template that ignores them
gets them declared in the system message instead, and earlier tool calls written as text, in the Hermes format) and the
reply's ``<tool_call>`` text is parsed into ``tool_calls``. A model without a chat template serves text completions.

Generation is the generation seam's in-process backend (:class:`~tokengym.agents.engine.generation.PolicyGenerator`,
the fast decoder where the model has one), one request at a time (a lock: the policy holds one KV cache; others wait
their turn). ``stop`` strings end a generation early where the model writes them as the tokenizer spells them alone;
the text is cut at the first one in any case, and ``usage`` counts the tokens up to it (an end-of-turn token too).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import uuid
from typing import Any
from urllib.parse import unquote

from tokengym.envs.json_http import BadRequest, JsonHandler, ThreadedServer, log_line
from tokengym.envs import openai_api as api
from tokengym.envs.chat import check_chat_template, end_of_turn_ids
from tokengym.agents.engine.generation import GenerationRequest, PolicyGenerator, SamplingSettings

__all__ = ["PolicyServer", "render_chat"]

MAX_BODY = 16 << 20
_PROBE = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}]


def _template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                fmt: api.ToolFormat = api.HermesTools()) -> str:
    """The prompt text of OpenAI chat ``messages`` by the tokenizer's chat template. A template that renders ``tools``
    (its text changes with them) gets them and the messages' ``tool_calls`` as it expects them (arguments as objects);
    one that ignores them gets ``fmt``'s declaration of the tools prepended to the system message and each earlier
    tool call written as text, so that the model sees the calls it made."""
    probe = [{"role": "user", "content": "hi"}]
    native = _template(tokenizer, probe, _PROBE) != _template(tokenizer, probe, None)
    out = []
    for m in messages:
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": api.text_of(m.get("content"))}
        if m.get("tool_calls") and native:
            msg["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": args}}
                                 for name, args in api.message_calls(m)]
        elif m.get("tool_calls"):
            msg["content"] = "\n".join(t for t in (msg["content"], fmt.write(m)) if t)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    if tools and not native:
        if out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0] = {**out[0], "content": "\n\n".join(t for t in (fmt.system_text(tools), out[0]["content"]) if t)}
    return _template(tokenizer, out, tools if native else None)


class PolicyServer:
    """The OpenAI API on ``policy``, served as ``name`` on ``host:port`` (port 0: a free one, :attr:`address`).

    Args:
        policy: a :class:`~tokengym.agents.engine.policy.Policy` (its tokenizer renders and decodes).
        name: the model name clients ask for (``/v1/models`` lists it; any other is a 404).
        secret: the bearer secret every request must carry.
        quiet: no request log on stderr.
    """

    def __init__(self, policy: Any, name: str, host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 quiet: bool = False):
        self.policy, self.name, self.secret, self.quiet = policy, name, secret, quiet
        self.tokenizer = policy.tokenizer
        self.generator = PolicyGenerator(policy)
        self.lock = threading.Lock()  # one request at a time (see _Handler._answer)
        self.stop_ids = tuple(sorted({int(self.tokenizer.eos_token_id), *end_of_turn_ids(self.tokenizer)}))
        self.positions = int(getattr(policy.model.config, "max_position_embeddings", 0) or 1 << 30)
        policy.eval()
        server = self

        class Handler(_Handler):
            owner = server

        self.httpd = ThreadedServer((host, port), Handler)
        self.address = f"{host}:{self.httpd.server_address[1]}"

    def log(self, text: str) -> None:
        if not self.quiet:
            log_line(f"tokengym serve: {text}")

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.5)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ the API
    def models(self) -> dict[str, Any]:
        return api.model_list([self.name])

    def model(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        return self.models()["data"][0]

    def _check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") != self.name:
            raise api.APIError(404, f"model {body.get('model')!r} is not served here; this server serves {self.name!r}",
                               code="model_not_found")

    def complete(self, body: Any) -> dict[str, Any]:
        """``/v1/completions``: the prompt (a string, encoded with the tokenizer's special tokens, or token ids)
        continued."""
        body = api.check_completion_request(body)
        self._check_model(body)
        settings = api.generation_settings(body, chat=False)
        prompt = body["prompt"]
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if isinstance(prompt, str) else prompt
        text, n, finish = self.generate(ids, settings)
        return api.text_completion(id=f"cmpl-{uuid.uuid4().hex}", model=self.name, text=text, finish_reason=finish,
                                   prompt_tokens=len(ids), completion_tokens=n)

    def chat(self, body: Any) -> dict[str, Any]:
        """``/v1/chat/completions``: the assistant's reply to the messages, its tool calls parsed."""
        body = api.check_chat_request(body)
        self._check_model(body)
        settings = api.generation_settings(body, chat=True)
        try:
            check_chat_template(self.tokenizer)
        except ValueError:
            raise api.APIError(400, f"model {self.name!r} has no chat template: it serves /v1/completions only"
                               ) from None
        tools = [] if body.get("tool_choice") == "none" else api.check_tools(body.get("tools"))
        prompt = render_chat(self.tokenizer, body["messages"], tools)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        text, n, finish = self.generate(ids, settings)
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        content, calls = api.HermesTools().parse(text, call_id) if tools else (text, [])
        finish = "tool_calls" if calls and finish == "stop" else finish
        return api.chat_completion(id=f"chatcmpl-{uuid.uuid4().hex}", model=self.name, content=content,
                                   tool_calls=calls, finish_reason=finish, prompt_tokens=len(ids), completion_tokens=n)

    def generate(self, ids: list[int], settings: dict[str, Any]) -> tuple[str, int, str]:
        """``(text, tokens, finish_reason)`` of a generation from the prompt ``ids``: greedy at temperature 0, else
        sampled (the request's ``seed`` its stream), cut at the first ``stop`` string."""
        room = self.positions - len(ids)
        if not ids or not all(0 <= t < len(self.tokenizer) for t in ids):
            raise api.APIError(400, "the prompt must hold at least one token, each in the vocabulary")
        asked = settings["max_tokens"]
        if room < (asked or 1):
            short = f"fewer than max_tokens={asked}" if asked else "none for the reply"
            raise api.APIError(400, f"the prompt's {len(ids)} tokens leave {max(room, 0)} of the model's "
                                    f"{self.positions} positions, {short}", code="context_length_exceeded")
        wanted = asked or room
        stop = settings["stop"]
        greedy = settings["temperature"] == 0  # (the seam's settings want a temperature > 0: greedy ignores it)
        request = GenerationRequest(
            prompt_ids=list(ids), max_tokens=wanted, stop_token_ids=self.stop_ids, greedy=greedy, seed=settings["seed"],
            sampling=SamplingSettings(temperature=settings["temperature"] or 1.0, top_p=settings["top_p"]),
            stop_sequences=tuple(tuple(self.tokenizer(s, add_special_tokens=False)["input_ids"]) for s in stop),
            stop_strings=tuple(stop))
        out = self.generator.generate([request])[0]
        tokens = list(out.token_ids)

        def decode(k: int) -> str:
            return self.tokenizer.decode(tokens[:k], skip_special_tokens=True)

        text = decode(len(tokens))
        if not any(s in text for s in stop):
            return text, len(tokens), out.finish_reason
        n = next(k for k in range(1, len(tokens) + 1) if any(s in decode(k) for s in stop))  # completes a stop string
        text = decode(n)
        return text[: min(text.find(s) for s in stop if s in text)], n, "stop"


class _Handler(JsonHandler):
    owner: PolicyServer

    def _answer(self, route: Any, body: Any) -> None:
        t0 = time.perf_counter()
        path = self.path.split("?")[0]
        try:
            if not hmac.compare_digest(self.headers.get("Authorization", "").encode(), b"Bearer " + self.owner.secret):
                raise api.APIError(401, "wrong or missing secret: send Authorization: Bearer <the server's secret>",
                                   code="invalid_api_key")
            if route is None:
                raise api.APIError(404, f"unknown path {self.command} {path} (this server answers GET /v1/models, POST "
                                        "/v1/chat/completions and POST /v1/completions)")
            if isinstance(body, api.APIError):
                raise body
            with self.owner.lock:  # one request at a time: the policy holds one KV cache (and the tokenizer one state)
                out, code = route(body), 200
        except api.APIError as e:
            out, code = api.error_body(e), e.status
        except Exception as e:  # noqa: BLE001 (the client reads it as one line)
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            out, code = api.error_body(api.APIError(500, line, type="server_error")), 500
        usage = out.get("usage")
        what = (f"{usage['prompt_tokens']}+{usage['completion_tokens']} tokens" if usage else
                out["error"]["message"] if "error" in out else "ok")
        self.owner.log(f"{self.command} {path} {code} ({what}, {time.perf_counter() - t0:.2f} s)")
        self.send_json(code, out)

    def do_GET(self) -> None:
        path = unquote(self.path.split("?")[0])
        if path == "/v1/models":
            return self._answer(lambda _: self.owner.models(), None)
        if path.startswith("/v1/models/"):  # one model: this one, else a 404 naming it
            return self._answer(self.owner.model, {"model": path.removeprefix("/v1/models/")})
        self._answer(None, None)

    def do_POST(self) -> None:
        routes = {"/v1/chat/completions": self.owner.chat, "/v1/completions": self.owner.complete}
        try:  # one plain Content-Length (RFC 9112: conflicting ones, "+5" or "1_0" are refused, not guessed at)
            n = self.body_length()
            if n > MAX_BODY:
                raise BadRequest(413, f"the body needs a Content-Length of at most {MAX_BODY}")
        except BadRequest as e:  # the body stays unread: this connection ends with the reply
            self.close_connection = True
            return self._answer(routes.get(self.path.split("?")[0]), api.APIError(e.code, str(e)))
        try:
            body: Any = json.loads(self.rfile.read(n) or b"null")
        except ValueError as e:
            body = api.APIError(400, f"the body is not JSON: {e}")
        self._answer(routes.get(self.path.split("?")[0]), body)

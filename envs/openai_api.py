"""The OpenAI chat-completions wire format, shared by agent envs (:mod:`tokengym.envs.adapters.agent`) and ``tokengym serve``.

Requests are checked here (one :class:`APIError` line naming the problem, as the OpenAI API answers it), tool calls are
written and parsed in a model's tool format (:class:`HermesTools`: ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``, the form SmolLM2 and Qwen use), and responses are built as the plain JSON the ``openai`` client reads.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Mapping, Sequence

__all__ = ["APIError", "HermesTools", "ToolFormat", "check_chat_request", "check_completion_request", "check_tools",
           "chat_completion", "text_completion", "model_list", "error_body", "same_message", "message_calls",
           "generation_settings", "text_of"]


class APIError(Exception):
    """A request refused: ``status`` (400, 401, 404, ...), OpenAI's error ``type`` and ``code``, and one line."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code = status, type, code


def error_body(e: APIError) -> dict[str, Any]:
    return {"error": {"message": str(e), "type": e.type, "code": e.code, "param": None}}


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` as OpenAI function tools (``[{"type": "function", "function": {"name", "parameters"}}]``), or an
    :class:`APIError` naming the first bad one. A parameters schema must be a JSON-schema object."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, f"tools must be a list, got {type(tools).__name__}")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) and t.get("type") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                f"...}}}}, got {t!r:.120}")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fn["name"]):
            raise APIError(400, f"tools[{i}]: function name {fn['name']!r} must be 1-64 letters, digits, _ or -")
        if fn["name"] in names:
            raise APIError(400, f"tools[{i}]: function name {fn['name']!r} is declared twice")
        names.add(fn["name"])
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}] ({fn['name']}): parameters must be a JSON schema of type 'object', got "
                                f"{params!r:.120}")
        props = params.get("properties", {})
        if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
            raise APIError(400, f"tools[{i}] ({fn['name']}): parameters.properties must map names to schemas")
    return [dict(t) for t in tools]


_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat_request(body: Any) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body, checked: messages of known roles, tools, no streaming, ``n`` of 1."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            raise APIError(400, f"messages[{i}] must have a role among {', '.join(_ROLES)}, got {m!r:.120}")
    if body.get("stream"):
        raise APIError(400, "streaming is not supported here: call without stream=True")
    if body.get("n", 1) not in (1, None):
        raise APIError(400, f"n={body['n']!r} is not supported: ask for one choice per call (n=1)")
    check_tools(body.get("tools"))
    return dict(body)


def check_completion_request(body: Any) -> dict[str, Any]:
    """A ``/v1/completions`` body, checked: one prompt (a string, or token ids), no streaming, ``n`` of 1."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not isinstance(prompt, str) and not (ids and prompt):
        raise APIError(400, f"prompt must be one string or one non-empty list of token ids, got {prompt!r:.120}")
    if body.get("stream"):
        raise APIError(400, "streaming is not supported here: call without stream=True")
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
        raise APIError(400, "n and best_of other than 1 are not supported: ask for one completion per call")
    return {**body, "prompt": prompt}


_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "user", "metadata", "store",
           "service_tier"}
_CHAT = _COMMON | {"messages", "tools", "tool_choice", "max_completion_tokens", "parallel_tool_calls"}
_TEXT = _COMMON | {"prompt", "best_of"}
_OFF = {"frequency_penalty": (0, None), "presence_penalty": (0, None), "logit_bias": ({}, None),
        "logprobs": (False, None), "top_logprobs": (0, None), "echo": (False, None), "suffix": ("", None),
        "stream_options": (None,), "response_format": ({"type": "text"}, None)}
"""Parameters this server has no support for, accepted only at these values (which ask for nothing)."""


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
        raise APIError(400, f"{key}={v!r} must be a number in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(v)


def generation_settings(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """What a chat or text completion asks of generation: ``max_tokens`` (``None``: as many as fit), ``temperature``
    (0: greedy), ``top_p``, ``stop`` (a list of strings) and ``seed``; an :class:`APIError` for a parameter that
    would be silently ignored here (an unknown one, or one asking for what this server does not do)."""
    known = _CHAT if chat else _TEXT
    for key, v in body.items():
        if key in _OFF and v not in _OFF[key]:
            raise APIError(400, f"{key}={v!r:.80} is not supported here (leave it out)")
        if key not in known and key not in _OFF:
            raise APIError(400, f"unknown parameter {key!r} (this server takes: {', '.join(sorted(known))})")
    if chat and body.get("tool_choice") not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice={body['tool_choice']!r:.80} is not supported here: only 'auto' and 'none'")
    limits = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    for key, v in limits.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise APIError(400, f"{key}={v!r} must be a whole number of at least 1")
    if len(set(limits.values())) > 1:
        raise APIError(400, "max_tokens and max_completion_tokens differ: give one of them")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop must be a string or a list of at most 4 non-empty strings, got {body['stop']!r:.80}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, f"seed={seed!r} must be a whole number")
    return {"max_tokens": next(iter(limits.values()), 16 if not chat else None),
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), "stop": stop, "seed": seed}


def text_of(content: Any) -> str:
    """A message's content as text (a string, or the text parts of a content list)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    raise APIError(400, f"message content must be a string or a list of text parts, got {type(content).__name__}")


def message_calls(m: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """A message's tool calls as ``(name, arguments)``, the arguments parsed from their JSON text where they are."""
    out = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, Mapping) else {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((fn.get("name"), args))
    return out


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two chat messages say the same: role, text and tool calls (arguments compared as parsed JSON, so an
    agent that re-serialises them, or sends ``content: None`` for ``""``, still matches)."""
    return (a.get("role") == b.get("role") and text_of(a.get("content")).strip() == text_of(b.get("content")).strip()
            and message_calls(a) == message_calls(b) and a.get("tool_call_id") == b.get("tool_call_id"))


class ToolFormat:
    """How a model writes tool calls: the text of a call, and the calls parsed back out of a turn's text."""

    name = "none"

    def parse(self, text: str, call_id: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a turn's text; ``call_id`` prefixes the calls' ids (``{call_id}_{i}``)."""
        return text, []

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The system text that declares ``tools`` to a model whose chat template ignores ``tools=``."""
        return ""

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str | None:
        """A Lark grammar (llguidance's) of a turn: text without ``<``, or calls of ``tools`` that parse against
        their schemas (``None``: this format cannot constrain its calls)."""
        return None

    def write(self, message: Mapping[str, Any]) -> str:
        """The text in which the model writes ``message``'s tool calls (what a template that ignores ``tool_calls``
        is given as the assistant turn's content)."""
        return ""


class HermesTools(ToolFormat):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, once per call (Hermes; SmolLM2, Qwen)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str, call_id: str) -> tuple[str, list[dict[str, Any]]]:
        calls, spans = [], []
        for m in self._CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue  # not a call: it stays in the content, as the model wrote it
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                continue
            args = obj.get("arguments", {})
            calls.append({"id": f"{call_id}_{len(calls)}", "type": "function",
                          "function": {"name": obj["name"], "arguments": json.dumps(args)}})
            spans.append(m.span())
        if not calls:
            return text, []
        content, at = [], 0
        for a, b in spans:
            content.append(text[at:a])
            at = b
        content.append(text[at:])
        return "".join(content).strip(), calls

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str | None:
        calls = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": t["function"].get("parameters", {"type": "object", "properties": {}})},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return ('start: free | calls\nfree: /[^<]*/\ncalls: call+\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: %json {json.dumps({'oneOf': calls})}")

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t["function"]) for t in tools)
        return ("You may call one or more functions to assist with the user query. The functions are listed within "
                f"<tools></tools>:\n<tools>\n{listed}\n</tools>\nFor each function call, write a JSON object with the "
                'function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n{"name": '
                '<function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def write(self, message: Mapping[str, Any]) -> str:
        return "\n".join(f"{self.OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{self.CLOSE}"
                         for name, args in message_calls(message))


def chat_completion(*, id: str, model: str, content: str, tool_calls: list[dict[str, Any]], finish_reason: str,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def text_completion(*, id: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    """A ``text_completion`` object with one choice (``/v1/completions``)."""
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def model_list(names: Sequence[str]) -> dict[str, Any]:
    """The ``/v1/models`` list."""
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "tokengym"} for n in names]}

"""How an agent's chat messages become the tokens of its episode, and the model's turns become tool calls.

A chat format turns the first call's messages (and tools) into the prompt's token ids, and the messages a later call
adds into the ids appended after the model's own turn (its end-of-turn token is already in the episode: the format
writes what the chat template puts after it, up to the next assistant turn's opening). Message contents are tokenized
on their own with special-token text kept as text (a tool that echoes ``<|im_end|>`` appends those characters), the
template's markup with its special tokens.

- :class:`TemplateFormat`: the tokenizer's chat template (``tools=`` rendered by it, or declared in a system message in
  the tool format's words when the template ignores them); tool calls in the Hermes form by default.
- :class:`PlainFormat`: for a model without a chat template (the tiny ones): each message's content on its own line,
  with a prefix per role; tool calls in a :class:`TagTools` form such as ``<calc>38+87</calc>``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from tokengym.envs.chat import END_OF_TURN
from tokengym.envs.openai_api import APIError, HermesTools, ToolFormat, text_of

__all__ = ["ChatFormat", "TemplateFormat", "PlainFormat", "TagTools"]

_MARK = "\x00tg{}\x00"
_MARKS = re.compile("\x00tg(\\d+)\x00")


class TagTools(ToolFormat):
    """One tool whose one string argument sits between two tags: ``<calc>38+87</calc>`` is
    ``calculate(expression="38+87")`` with ``TagTools("<calc>", "</calc>", "calculate", "expression")``."""

    name = "tag"

    def __init__(self, open: str, close: str, function: str, argument: str):
        self.open, self.close, self.function, self.argument = open, close, function, argument
        self._call = re.compile(re.escape(open) + "(.*?)" + re.escape(close), re.S)

    def parse(self, text: str, call_id: str) -> tuple[str, list[dict[str, Any]]]:
        import json

        calls = [{"id": f"{call_id}_{i}", "type": "function",
                  "function": {"name": self.function, "arguments": json.dumps({self.argument: m.group(1)})}}
                 for i, m in enumerate(self._call.finditer(text))]
        return (self._call.sub("", text).strip() if calls else text), calls


class ChatFormat:
    """The prompt's ids, a call's added messages as ids, the tool format and the texts that end a turn."""

    tools: ToolFormat = ToolFormat()

    @property
    def turn_stop_strings(self) -> tuple[str, ...]:
        """Texts that end a turn besides the end-of-turn token: a tag format's closing tag (the env answers it)."""
        return (self.tools.close,) if isinstance(self.tools, TagTools) else ()

    def bind(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        raise NotImplementedError

    def delta(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        raise NotImplementedError

    def text(self, ids: Sequence[int]) -> str:
        """A prompt's ids as the text rewards and logs see (the template's markup included)."""
        return self.tokenizer.decode(list(ids))

    def _ids(self, text: str, contents: Sequence[str], special: bool = False) -> list[int]:
        """Ids of ``text`` whose ``_MARK`` i stands for ``contents[i]``: markup with its special tokens, each content
        with special-token text split into ordinary tokens."""
        tok, out, at = self.tokenizer, [], 0
        parts = []
        for m in _MARKS.finditer(text):
            parts += [(text[at:m.start()], False), (contents[int(m.group(1))], True)]
            at = m.end()
        parts.append((text[at:], False))
        for i, (part, is_content) in enumerate(parts):
            if part:
                kw = {"split_special_tokens": True} if is_content else {}
                out += tok(part, add_special_tokens=special and i == 0, **kw)["input_ids"]
            elif special and i == 0:
                out += tok("", add_special_tokens=True)["input_ids"]
        return out


def _marked(messages: Sequence[Mapping[str, Any]], start: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with each text content replaced by a mark, and the contents."""
    out, contents = [], []
    for m in messages:
        m = dict(m)
        if m.get("content") is not None or m.get("role") != "assistant":
            contents.append(text_of(m.get("content")))
            m["content"] = _MARK.format(start + len(contents) - 1)
        out.append(m)
    return out, contents


class TemplateFormat(ChatFormat):
    """The tokenizer's chat template; ``tools`` is the tool-call form the model writes (Hermes by default)."""

    def __init__(self, tools: ToolFormat | None = None):
        self.tools = tools or HermesTools()

    def bind(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
            raise ValueError(f"TemplateFormat needs a tokenizer with a chat template, and {name!r} has none; give the "
                             "agent env a PlainFormat")
        super().bind(tokenizer)
        probe = [{"role": "user", "content": "q"}]
        tool = [{"type": "function", "function": {"name": "zqxjv_probe", "parameters": {"type": "object"}}}]
        self.renders_tools = "zqxjv_probe" in self._render(probe, tool, True)

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], gen: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) or None,
                                                      add_generation_prompt=gen, tokenize=False)
        except Exception as e:  # the template's own check (roles that must alternate, a role it does not know)
            raise APIError(400, f"the model's chat template cannot render these messages: {type(e).__name__}: "
                                f"{str(e)[:160]}") from None

    def _declared(self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Tools declared in a system message, for a template that ignores ``tools=``."""
        if not tools or self.renders_tools:
            return messages
        text = self.tools.system_text(tools)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": text_of(messages[0].get("content")) + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        marked, contents = _marked(self._declared([dict(m) for m in messages], tools))
        return self._ids(self._render(marked, tools, True), contents)

    def delta(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        said = "zqxjv-said"
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said}]
        marked, contents = _marked(messages)
        full = self._render(base + marked, tools if self.renders_tools else (), True)
        cut = full.find(said) + len(said)
        eot = next((e for e in END_OF_TURN if full.startswith(e, cut)), None)
        if cut < len(said) or eot is None:
            raise APIError(400, "cannot find where the assistant turn ends in the chat template's rendering")
        return self._ids(full[cut + len(eot):], contents)


class PlainFormat(ChatFormat):
    """Messages as plain text, for a model without a chat template: each content, then a newline, after its role's
    prefix (``prefix={"tool": "="}`` writes a tool result ``125`` as ``=125``); the model's turn is its text."""

    def __init__(self, tools: ToolFormat | None = None, prefix: Mapping[str, str] | None = None):
        self.tools = tools or ToolFormat()
        self.prefix = dict(prefix or {})

    def _text(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[str]]:
        text, contents = "", []
        for m in messages:
            contents.append(text_of(m.get("content")))
            text += self.prefix.get(m["role"], "") + _MARK.format(len(contents) - 1) + "\n"
        return text, contents

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._ids(*self._text(messages), special=True)

    def delta(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._ids(*self._text(messages))

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)  # as a text prompt reads: no BOS

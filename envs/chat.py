"""Chat prompts: TRL's conversational format (a list of ``{"role", "content"}`` messages) in token environments.

A chat prompt is rendered by the tokenizer's chat template once, with the generation prompt (the assistant turn's
opening), straight to token ids: the template writes its own special tokens, nothing is added or re-tokenized
later. A chat model ends its turn with an end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ...), which ends an
episode like EOS. Rewards get the rendered prompt text and the completion decoded without special tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["is_messages", "CHAT_ROLES", "check_roles", "unknown_role", "user_prompt", "prompt_chars", "encode_prompts", "prompt_texts", "end_of_turn_ids",
           "check_chat_template", "template_overhead"]

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
"""Special tokens with which common chat templates end a turn; those in a tokenizer's vocabulary stop episodes."""


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The message roles chat templates render (TRL's conversational format); any other is a typo, refused."""


def unknown_role(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The first role of ``messages`` outside :data:`CHAT_ROLES` (None if all are known)."""
    return next((m["role"] for m in messages if m.get("role") not in CHAT_ROLES), None)


def check_roles(messages: Any, where: str) -> None:
    """ValueError naming ``where`` when chat ``messages`` use a role outside :data:`CHAT_ROLES` (a template would
    render it silently as whatever it does with unknown roles, or drop it)."""
    if is_messages(messages) and (role := unknown_role(messages)) is not None:
        raise ValueError(f"{where}: unknown chat role {role!r} (roles: {', '.join(CHAT_ROLES)})")


def is_messages(value: Any) -> bool:
    """A non-empty list of ``{"role": str, "content": str}`` dicts (TRL's conversational format)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def user_prompt(content: str, system: str | None = None) -> list[dict[str, str]]:
    """``[{"role": "system", ...}, {"role": "user", "content": content}]`` (the system message only if given)."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def prompt_chars(prompt: Any) -> int:
    """Characters of a text prompt, or of every message's content of a chat prompt."""
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def check_chat_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise ValueError(f"chat prompts need a tokenizer with a chat template, and tokenizer {name!r} has none; "
                         "use a chat model's tokenizer or plain-text prompts")


def _render(tokenizer: Any, messages: Any, tokenize: bool) -> Any:
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=tokenize)
    if tokenize and isinstance(out, Mapping):  # some versions return a BatchEncoding
        out = out["input_ids"]
    return list(out) if tokenize else out


def encode_prompts(tokenizer: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids of each prompt: a string with the tokenizer's special tokens, a chat prompt through its template."""
    if all(isinstance(p, str) for p in prompts):
        return tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    check_chat_template(tokenizer)
    return [tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else _render(tokenizer, p, True)
            for p in prompts]


def prompt_texts(tokenizer: Any, prompts: Sequence[Any]) -> list[str]:
    """Each prompt as text: a string as is, a chat prompt rendered by the template (what rewards and logs see)."""
    return [p if isinstance(p, str) else _render(tokenizer, p, False) for p in prompts]


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Ids of the :data:`END_OF_TURN` tokens the tokenizer has as special tokens (none for the char tokenizer)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    special = set(getattr(tokenizer, "all_special_tokens", []) or []) | set(getattr(tokenizer, "added_tokens_encoder", {}) or {})
    vocab = tokenizer.get_vocab()
    return sorted({vocab[t] for t in END_OF_TURN if t in vocab and t in special})


def template_overhead(tokenizer: Any, messages: Any) -> int:
    """Tokens the chat template adds around the messages' contents (role markers, BOS, the generation prompt)."""
    contents = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages)
    return max(len(_render(tokenizer, messages, True)) - contents, 0)

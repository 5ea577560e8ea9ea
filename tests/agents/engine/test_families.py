"""The fast decoder on the families beyond Llama (Qwen3, Gemma 3, SmolLM3, Phi-3, OLMo 2): every path it takes in a
rollout (prefill, shared prefixes, decode, compaction, refill, multi-turn extend) gives the logits of a plain
``transformers`` forward over each row's whole history, greedy decoding gives ``generate``'s tokens, and LoRA adapters
are added. Under bf16 autocast a bf16 KV cache keeps every path within bf16 rounding of an autocast forward, and
``kv_dtype="auto"`` keeps the cache fp32 where bf16 is emulated. The models are tiny, random and seeded, with every
norm weight randomised so that a dropped norm shows."""

import warnings

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          SmolLM3Config, SmolLM3ForCausalLM)

from tokengym.agents.engine.fast_decode import unsupported_reason
from tokengym.agents.engine.policy import Policy, position_ids
from tokengym.envs import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
V = 40  # vocabulary of the tiny models (token ids 4..V-1 in the prompts)
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**BASE, head_dim=16)),
    # one sliding layer (a window of 4 columns, much narrower than the cache) with its own RoPE base, one full layer
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **BASE, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        query_pre_attn_scalar=24, final_logit_softcapping=3.0, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # untied: a random tied Gemma (embeddings scaled by 8) greedily repeats its last token, which tests little
    "gemma3-untied": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **BASE, head_dim=16, layer_types=["full_attention", "sliding_attention"], sliding_window=3,
        tie_word_embeddings=False, attn_implementation="eager")),
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(**BASE, no_rope_layers=[1, 0])),  # layer 1: NoPE
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**BASE, partial_rotary_factor=0.5)),
    "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**BASE)),
}
LLAMA = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**BASE))}  # Llama's own decode loop, for the bf16 cache test


def build(name):
    """A seeded random model of family ``name`` in eval mode, its norm weights randomised (``transformers`` initialises
    them to 1, or Gemma's to 0, where dropping one would change nothing)."""
    torch.manual_seed(0)
    model = {**FAMILIES, **LLAMA}[name]().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 2:
                p.normal_(0, 0.2, generator=g)  # large enough weights that the logits differ by more than rounding
    return model


@pytest.fixture(scope="module")
def models():
    return {name: build(name) for name in FAMILIES}


def reference(model, histories):
    """The next-token logits ``[R, V]`` of each token list through one plain forward (left-padded)."""
    W = max(len(h) for h in histories)
    ids = torch.zeros(len(histories), W, dtype=torch.long)
    mask = torch.zeros(len(histories), W, dtype=torch.bool)
    for i, h in enumerate(histories):
        ids[i, W - len(h):] = torch.tensor(h)
        mask[i, W - len(h):] = True
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)).logits[:, -1].float()


def left_padded(prompts, P):
    tokens = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = True
    return tokens, mask


def check(got, model, histories, what, diffs):
    want = reference(model, histories)
    diff = float((got - want).abs().max())
    diffs[what] = diff
    assert want.std() > 0.05, "logits too flat to tell a wrong model from a right one"
    assert diff < TOL, (what, diffs)


def walk(policy, check):
    """Drive ``policy``'s fast decoder through every path a rollout takes, from seeded random left-padded prompts of
    different lengths: prefill, decode, compaction, refill of a row, a multi-turn extend of two rows and decode after it,
    and a prefill of shared prompts (``copies``); ``check(logits, histories, what)`` after each."""
    g = torch.Generator().manual_seed(2)
    P, M = 7, 12
    hist = [torch.randint(4, V, (n,), generator=g).tolist() for n in (7, 3, 5, 6)]
    tokens, mask = left_padded(hist, P)
    rand = lambda n: torch.randint(4, V, (n,), generator=g)  # noqa: E731
    with torch.inference_mode():
        check(policy.prefill(tokens, mask, max_new_tokens=M), hist, "prefill")
        assert policy.fast_path_active
        for step in range(3):
            t = rand(len(hist))
            hist = [h + [int(x)] for h, x in zip(hist, t)]
            check(policy.decode(t), hist, f"decode{step}")
        keep = [0, 2, 3]  # row 1 leaves the batch
        assert policy.compact(torch.tensor(keep))
        hist = [hist[i] for i in keep]
        for step in range(2):
            t = rand(len(hist))
            hist = [h + [int(x)] for h, x in zip(hist, t)]
            check(policy.decode(t), hist, f"compacted{step}")
        new = rand(4).tolist()  # a new episode in row 1 while the others go on
        hist[1] = new
        check(policy.refill(torch.tensor([1]), *left_padded([new], P)), [new], "refill")
        for step in range(2):
            t = rand(len(hist))
            hist = [h + [int(x)] for h, x in zip(hist, t)]
            check(policy.decode(t), hist, f"refilled{step}")
        reply, lengths = rand(6).view(2, 3), torch.tensor([3, 1])  # env replies to rows 0 and 2
        hist[0] += reply[0].tolist()
        hist[2] += reply[1, :1].tolist()
        check(policy.extend(torch.tensor([0, 2]), reply, lengths), [hist[0], hist[2]], "extend")
        t = rand(len(hist))
        hist = [h + [int(x)] for h, x in zip(hist, t)]
        check(policy.decode(t), hist, "after_extend")
        # a GRPO batch: two groups of two identical prompts, each prompt encoded once
        group = [hist[0][:5], hist[0][:5], hist[1][:2], hist[1][:2]]
        check(policy.prefill(*left_padded(group, P), max_new_tokens=M, copies=2), group, "copies")
    policy.end_rollout()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_fast_path_equals_a_plain_forward(models, name):
    """Prefill (left padding of different widths), decode, compaction, refill of a row, a multi-turn extend of two rows
    and decode after it: each time the fast decoder's logits equal a ``transformers`` forward over the rows' histories."""
    model, tok = models[name], char_tokenizer()
    assert unsupported_reason(model, 64) is None
    diffs = {}
    walk(Policy(model, tok), lambda got, hist, what: check(got, model, hist, what, diffs))


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "gemma3"])
def test_greedy_tokens_equal_generate(models, name):
    model, tok = models[name], char_tokenizer()
    ids = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))
    K = 10
    model.generation_config.eos_token_id = None  # a random model may emit EOS: decode all K tokens
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=K, do_sample=False, pad_token_id=0)
    policy = Policy(model, tok)
    with torch.inference_mode():
        logits = policy.prefill(ids, torch.ones_like(ids, dtype=torch.bool), max_new_tokens=K)
        got = []
        for _ in range(K):
            got.append(logits.argmax(-1))
            logits = policy.decode(got[-1]) if len(got) < K else logits
    assert policy.fast_path_active
    assert torch.equal(torch.stack(got, 1), want[:, 6:])
    assert len(set(want[:, 6:].flatten().tolist())) > 4  # not one token repeated


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_lora_adapters_are_added(models, name):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(build(name), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for pname, p in lora.named_parameters():
            if "lora_B" in pname:  # B = 0 at init would make the adapter a no-op
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    lora.eval()
    hist = [torch.randint(4, V, (n,), generator=g).tolist() for n in (6, 4)]
    policy, diffs = Policy(lora, char_tokenizer()), {}
    with torch.inference_mode():
        check(policy.prefill(*left_padded(hist, 6), max_new_tokens=4), lora, hist, "prefill", diffs)
        assert policy.fast_path_active
        for step in range(3):
            t = torch.randint(4, V, (2,), generator=g)
            hist = [h + [int(x)] for h, x in zip(hist, t)]
            check(policy.decode(t), lora, hist, f"decode{step}", diffs)
    assert float((reference(lora, hist) - reference(models[name], hist)).abs().max()) > 1e-2  # the adapter matters here


def test_other_models_name_why_and_the_generic_path_says_so_once():
    """MoE and unknown classes are named by ``unsupported_reason``; a Policy on such a model warns once, however many
    rollouts it runs, with the class and the reason; ``fast_decode=False`` (the user's choice) does not warn."""
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)).eval()
    assert "Qwen3MoeForCausalLM is not one of" in unsupported_reason(moe)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2)).eval()
    tokens, mask = left_padded([[5, 6, 7], [8, 9]], 3)
    for model, warns in ((moe, 1), (gpt2, 1)):
        policy = Policy(model, char_tokenizer())
        with warnings.catch_warnings(record=True) as seen, torch.inference_mode():
            warnings.simplefilter("always")
            for _ in range(3):
                policy.prefill(tokens, mask, max_new_tokens=2)
                policy.decode(torch.tensor([5, 6]))
        notes = [str(w.message) for w in seen if "generic transformers path" in str(w.message)]
        assert len(notes) == warns and type(model).__name__ in notes[0] and "is not one of" in notes[0], notes
        assert not policy.fast_path_active
    quiet = Policy(gpt2, char_tokenizer(), fast_decode=False)
    with warnings.catch_warnings(record=True) as seen, torch.inference_mode():
        warnings.simplefilter("always")
        quiet.prefill(tokens, mask, max_new_tokens=2)
    assert not [w for w in seen if "generic transformers path" in str(w.message)]


EPS_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits): one rounding moves a value by at most this, relative


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_bf16_cache_paths_match_an_autocast_forward(name):
    """Under bf16 autocast with the KV cache and attention in bf16 (``kv_dtype="autocast"``, what ``"auto"`` picks
    where bf16 is native), every path's logits are a ``transformers`` autocast forward's (the trainer's: bf16 GEMMs,
    fp32 attention on CPU, eager bf16 attention for Gemma 3) within bf16 rounding. Both round the same GEMM inputs and
    outputs to bf16; the cache adds a rounding of each key, value, score and probability, and any rounding that
    flips moves a value by up to 2^-8 of it. Per layer a handful of such roundings reach the residual stream, so the
    bound is ``8 * 2^-8 * (layers + 1)`` of the largest logit. Measured: at most 0.38 of it (0.25 with the cache in
    fp32); a key written without its rotary embedding lands 2-15x above it."""
    model = build(name)
    gaps = {}

    def check_bf16(got, hist, what):
        assert got.dtype == torch.float32
        want = reference(model, hist)  # under the same autocast
        gaps[what] = float((got - want).abs().max() / want.abs().max())

    policy = Policy(model, char_tokenizer(), kv_dtype="autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        walk(policy, check_bf16)
    bound = 8 * EPS_BF16 * (model.config.num_hidden_layers + 1)
    assert max(gaps.values()) < bound, (bound, gaps)


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_auto_keeps_the_cache_fp32_where_bf16_is_emulated(monkeypatch, native):
    """``kv_dtype="auto"`` under bf16 autocast: where the CPU has no native bf16 the cache stays fp32 and every logit is
    bit-identical to ``"model"`` (the fp32 cache); where it has, the cache is bf16 and the logits are ``"autocast"``'s."""
    from tokengym.agents.runtime import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    model = build("qwen3")
    runs = {}
    for kv_dtype in ("auto", "model", "autocast"):
        logits, dtypes = [], []

        def keep(got, hist, what):
            logits.append(got)

        policy = Policy(model, char_tokenizer(), kv_dtype=kv_dtype)
        end = policy.end_rollout
        policy.end_rollout = lambda: (dtypes.append(policy._fast._cache[0][0].dtype), end())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            walk(policy, keep)
        runs[kv_dtype] = (logits, dtypes)
    same = "autocast" if native else "model"
    assert runs["auto"][1] == [torch.bfloat16 if native else torch.float32]
    assert runs["model"][1] == [torch.float32] and runs["autocast"][1] == [torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(runs["auto"][0], runs[same][0]))
    assert not all(torch.equal(a, b) for a, b in zip(runs["model"][0], runs["autocast"][0]))  # the dtype matters


def test_kv_dtype_is_checked_and_half_is_fast_only_where_native(monkeypatch):
    from tokengym.agents.runtime import hardware

    with pytest.raises(ValueError, match="kv_dtype must be one of auto, model, autocast; got 'bf16'"):
        Policy(build("qwen3"), char_tokenizer(), kv_dtype="bf16")
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert hardware.half_is_fast("cpu", torch.bfloat16)
    assert not hardware.half_is_fast("cpu", torch.float16) and not hardware.half_is_fast("cpu", torch.float32)
    assert not hardware.half_is_fast("meta", torch.bfloat16)
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert not hardware.half_is_fast("cpu", torch.bfloat16)

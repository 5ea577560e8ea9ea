"""Policy: the static-cache fast decode path against the generic HF path and one full forward pass."""

import copy

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

from tokengym.agents.engine.fast_decode import StaticDecoder, unsupported_reason
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect
from tokengym.envs import TokenVectorEnv, char_tokenizer

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**overrides):
    model, tok = build_preset("tiny", **overrides)
    return model.eval(), tok


def small_config(cls_cfg, tok, **kw):
    base = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return cls_cfg(**{**base, **kw})


def with_random_biases(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def family_models():
    tok = char_tokenizer()
    torch.manual_seed(0)
    return {
        "llama-mha": tiny()[0],
        "llama-gqa": tiny(num_key_value_heads=2)[0],
        "llama-mqa-bias-headdim": with_random_biases(LlamaForCausalLM(small_config(
            LlamaConfig, tok, num_key_value_heads=1, attention_bias=True, mlp_bias=True, head_dim=24))),
        "llama3-rope-tied": LlamaForCausalLM(small_config(LlamaConfig, tok, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})).eval(),
        "qwen2": with_random_biases(Qwen2ForCausalLM(small_config(Qwen2Config, tok, tie_word_embeddings=True))),
        "mistral": MistralForCausalLM(small_config(MistralConfig, tok, sliding_window=None)).eval(),
    }


@pytest.fixture(scope="module")
def models():
    return family_models()


def prompts(n=6, seed=1, max_new_tokens=8):
    env = TokenVectorEnv(n, "arithmetic", max_new_tokens=max_new_tokens)
    obs, _ = env.reset(seed=seed)
    P = env.max_prompt_len
    tokens, mask = obs["tokens"][:, :P], obs["mask"][:, :P]
    assert len(set(mask.sum(1).tolist())) > 1  # left padding of different widths
    return tokens, mask


@pytest.fixture(params=[False, True], ids=["mm", "packed"])
def packed(request, monkeypatch):
    """Run the fast decoder's GEMMs on torch.mm, or on oneDNN-packed weights for every matrix (when available)."""
    from tokengym.agents.engine import fast_decode

    if request.param and not fast_decode._packed_ok(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN linear not available in this torch build")
    monkeypatch.setattr(fast_decode, "_PACK_MIN_NUMEL", 0 if request.param else 1 << 62)
    return request.param


@pytest.mark.parametrize("name", ["llama-mha", "llama-gqa", "llama-mqa-bias-headdim", "llama3-rope-tied", "qwen2", "mistral"])
def test_fast_logits_equal_generic_logits(models, name, packed):
    model = models[name]
    tok = char_tokenizer()
    tokens, mask = prompts()
    fast, generic = Policy(model, tok), Policy(model, tok, fast_decode=False)
    g = torch.Generator().manual_seed(2)
    steps = 8
    with torch.inference_mode():
        a = fast.prefill(tokens, mask, max_new_tokens=steps)
        b = generic.prefill(tokens, mask, max_new_tokens=steps)
        assert fast.fast_path_active and not generic.fast_path_active
        layer = fast._fast._layers[0]
        assert all(layer[i].is_mkldnn == packed for i in (2, 4, 8, 11))  # w_qkv, w_o, w_gate_up, w_down
        diffs = [(a - b).abs().max().item()]
        for _ in range(steps):
            nxt = torch.randint(3, len(tok), (tokens.shape[0],), generator=g)
            a, b = fast.decode(nxt), generic.decode(nxt)
            assert a.dtype == torch.float32 and a.shape == (tokens.shape[0], len(tok))
            diffs.append((a - b).abs().max().item())
    assert max(diffs) < TOL, diffs


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 2}], ids=["mha", "gqa"])
def test_fast_rollout_logprobs_equal_full_forward(overrides):
    model, tok = tiny(**overrides)
    policy = Policy(model, tok, seed=0)
    env = TokenVectorEnv(16, "arithmetic", max_new_tokens=48)  # a random model's EOS (~1%/token) ends some rows early
    ro = collect(env, policy, seed=0)
    assert policy.fast_path_active
    P = ro.prompt_len
    assert len(set(ro.attention_mask[:, :P].sum(1).tolist())) > 1  # prompts of different lengths
    assert ro.terminated.any() and ro.truncated.any() and len(set(ro.lengths.tolist())) > 2  # ends at different times
    with torch.inference_mode():
        full = policy(ro.tokens, ro.attention_mask, P)
    diff = ((full - ro.logprobs) * ro.action_mask).abs().max().item()
    assert diff < TOL, diff


@pytest.mark.parametrize("kv_dtype", ["model", "autocast"])
def test_fast_rollout_under_bf16_autocast_multiplies_bf16_weights_and_matches_an_autocast_forward(packed, kv_dtype):
    """The rollout's log-probs under bf16 autocast are within the documented bf16 gap of the trainer's autocast forward
    (which attends in fp32 on CPU, ``models.ATTENTION``), with the KV cache and attention in fp32 (``"model"``) or in
    bf16 (``"autocast"``, what ``"auto"`` picks where bf16 is native)."""
    model, tok = tiny(num_key_value_heads=2)
    policy = Policy(model, tok, seed=0, kv_dtype=kv_dtype)
    env = TokenVectorEnv(16, "arithmetic", max_new_tokens=24)
    seen = {}
    end = policy.end_rollout  # the decoder frees its fused weights and cache when the rollout ends: look before

    def look_then_end():
        seen.update(qkv=policy._fast._layers[0][2].dtype, cache=policy._fast._cache[0][0].dtype)
        end()

    policy.end_rollout = look_then_end
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ro = collect(env, policy, seed=0)
        assert policy.fast_path_active and seen["qkv"] == torch.bfloat16  # fused qkv weight
        assert seen["cache"] == (torch.float32 if kv_dtype == "model" else torch.bfloat16)  # residual, norms: fp32
        assert policy._fast._layers == [] and policy._fast._cache == []  # released after the rollout
        with torch.inference_mode():
            full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    diff = ((full - ro.logprobs) * ro.action_mask).abs()
    assert diff.max().item() < 0.05 and 0 < diff.sum().item() / ro.action_mask.sum().item() < 5e-3, diff.max().item()
    with torch.inference_mode():  # outside autocast the next prefill is fp32 again
        policy.prefill(ro.tokens[:, :ro.prompt_len], ro.attention_mask[:, :ro.prompt_len], max_new_tokens=2)
    assert policy._fast._layers[0][2].dtype == torch.float32 and policy._fast._cache[0][0].dtype == torch.float32


def test_fast_and_generic_rollouts_sample_the_same_tokens():
    model, tok = tiny(num_key_value_heads=2)
    env = TokenVectorEnv(8, "arithmetic", max_new_tokens=16)
    a = collect(env, Policy(model, tok, seed=3), seed=5)
    b = collect(env, Policy(model, tok, seed=3, fast_decode=False), seed=5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.action_mask, b.action_mask)
    assert (a.logprobs - b.logprobs).abs().max().item() < TOL


def test_a_rollout_frees_its_cache_and_the_next_batch_starts_clean():
    """After ``collect`` the fast decoder holds neither its fused weights nor its KV cache (they would add to the
    update's peak memory); the next batch rebuilds them and matches a fresh policy's run exactly."""
    model, tok = tiny()
    env = TokenVectorEnv(8, "arithmetic", max_new_tokens=20)
    policy = Policy(model, tok, seed=0)
    first = collect(env, policy, seed=1)
    assert policy.fast_path_active and policy._fast._cache == [] and policy._fast._layers == []
    policy.seed(7)
    second = collect(env, policy, seed=2)
    fresh_policy = Policy(model, tok, seed=7)
    fresh = collect(TokenVectorEnv(8, "arithmetic", max_new_tokens=20), fresh_policy, seed=2)
    assert not torch.equal(first.tokens, second.tokens)
    assert torch.equal(second.tokens, fresh.tokens)
    assert torch.equal(second.logprobs, fresh.logprobs)
    assert torch.isfinite(second.logprobs).all()


def test_weights_changed_in_place_are_picked_up():
    model, tok = tiny()
    tokens, mask = prompts()
    fast, generic = Policy(model, tok), Policy(model, tok, fast_decode=False)
    with torch.inference_mode():
        fast.prefill(tokens, mask, max_new_tokens=2)
    with torch.no_grad():  # an optimiser step
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with torch.inference_mode():
        a = fast.prefill(tokens, mask, max_new_tokens=2)
        b = generic.prefill(tokens, mask)
        nxt = torch.full((tokens.shape[0],), 5)
        assert (a - b).abs().max().item() < TOL
        assert (fast.decode(nxt) - generic.decode(nxt)).abs().max().item() < TOL


def test_decode_past_the_budget_raises():
    model, tok = tiny()
    tokens, mask = prompts()
    policy = Policy(model, tok)
    with torch.inference_mode():
        policy.prefill(tokens, mask, max_new_tokens=1)
        policy.decode(torch.full((tokens.shape[0],), 5))
        with pytest.raises(RuntimeError, match="max_new_tokens"):
            policy.decode(torch.full((tokens.shape[0],), 5))


def test_unsupported_models_fall_back_to_the_generic_path():
    tok = char_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id)).eval()
    windowed = MistralForCausalLM(small_config(MistralConfig, tok, sliding_window=8)).eval()
    assert "GPT2LMHeadModel" in unsupported_reason(gpt2)
    assert unsupported_reason(windowed) is None and "sliding_window" in unsupported_reason(windowed, 64)
    with pytest.raises(ValueError, match="cannot run"):
        StaticDecoder(gpt2)
    for model in (gpt2, windowed):
        policy = Policy(model, tok, seed=0)
        env = TokenVectorEnv(4, "arithmetic", max_new_tokens=6)
        ro = collect(env, policy, seed=0)
        assert not policy.fast_path_active
        with torch.inference_mode():
            full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
        assert ((full - ro.logprobs) * ro.action_mask).abs().max().item() < TOL
    assert Policy(tiny()[0], tok, fast_decode=False).fast_path_reason() == "fast_decode=False"


def test_save_pretrained_and_reload_from_folder(tmp_path):
    model, tok = tiny(num_key_value_heads=2)
    Policy(model, tok).save_pretrained(str(tmp_path))
    policy = Policy.from_pretrained(str(tmp_path), seed=0)
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    env = TokenVectorEnv(6, "arithmetic", max_new_tokens=10)
    ro = collect(env, policy, seed=3)
    assert policy.fast_path_active
    with torch.inference_mode():
        full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
        assert ((full - ro.logprobs) * ro.action_mask).abs().max().item() < TOL
        tokens, mask = ro.tokens[:, : ro.prompt_len], ro.attention_mask[:, : ro.prompt_len]
        a = policy.prefill(tokens, mask, max_new_tokens=1)
        b = Policy(model, tok, fast_decode=False).prefill(tokens, mask)
    assert (a - b).abs().max().item() < TOL


def test_act_in_a_next_step_autoreset_loop():
    """act() (generic path) gives valid actions; logprobs of completed episodes equal the full-forward recompute."""
    model, tok = tiny()
    policy = Policy(model, tok, seed=0)
    env = TokenVectorEnv(4, "arithmetic", max_new_tokens=6, autoreset_mode="next_step")
    P = env.max_prompt_len
    obs, _ = env.reset(seed=0)
    record = [[] for _ in range(4)]
    checked = 0
    for _ in range(40):
        fresh = obs["mask"][:, P:].sum(1) == 0
        actions, logp = policy.act(obs, prompt_len=P)
        assert actions.shape == (4,) and actions.dtype == torch.long
        assert bool(((actions >= 0) & (actions < env.vocab_size)).all()) and bool((logp <= 0).all())
        for i in range(4):
            if fresh[i]:
                record[i] = []
            record[i].append(logp[i].item())
        obs, _, terminated, truncated, _ = env.step(actions)
        for i in (terminated | truncated).nonzero().flatten().tolist():
            with torch.inference_mode():
                full = policy(obs["tokens"][i : i + 1], obs["mask"][i : i + 1], P)[0]
            n = int(obs["mask"][i, P:].sum())
            assert n == len(record[i])
            assert (full[:n] - torch.tensor(record[i])).abs().max().item() < TOL
            checked += 1
    assert checked >= 8


def test_fast_path_sees_weights_changed_without_a_version_bump():
    """A fused optimizer (or any write through .data) does not bump version counters: the next rollout
    must still decode with the new weights."""
    from tokengym.agents import Policy, collect
    from tokengym.envs import TokenVectorEnv

    policy = Policy.from_pretrained("tiny")
    env = TokenVectorEnv(4, "arithmetic", max_new_tokens=6)
    collect(env, policy, seed=0)
    with torch.no_grad():
        policy.model.lm_head.weight.data.mul_(3.0)  # .data writes bypass the version counter
    ro = collect(env, policy, seed=1)
    with torch.no_grad():
        full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert ((full - ro.logprobs) * ro.action_mask).abs().max() < 1e-4


def test_shipped_checkpoint_loads_by_name_and_unknown_names_fail_clearly():
    import os

    import pytest

    from tokengym.agents.engine.models import CHECKPOINTS_DIR, load_model

    model, tok = load_model("tiny-arithmetic")
    by_path, _ = load_model(os.path.join(CHECKPOINTS_DIR, "tiny-arithmetic"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), by_path.state_dict().values()))
    assert tok.eos_token_id is not None
    with pytest.raises(FileNotFoundError, match="neither a preset .* nor a local folder"):
        load_model("no-such-model")


def _padded_batch(tok, n=6, length=20, pad=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, len(tok), (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.bool)
    mask[: n // 2, :pad] = False  # left padding in half the rows
    return tokens, mask


def test_tokengym_attention_equals_sdpa_in_fp32_and_runs_bf16_autocast_attention_in_fp32(monkeypatch):
    """Policy switches an sdpa model to models.ATTENTION: the same log-probs and gradients as sdpa in fp32,
    and under bf16 autocast on CPU the attention kernel gets fp32 inputs (its bf16 backward is slow)."""
    from tokengym.agents.engine.models import ATTENTION

    model, tok = build_preset("tiny", seed=3)
    plain = copy.deepcopy(model)
    assert plain.config._attn_implementation == "sdpa"
    policy = Policy(model, tok)
    assert model.config._attn_implementation == ATTENTION and plain.config._attn_implementation == "sdpa"
    tokens, mask = _padded_batch(tok)
    P = 8
    lp_new = policy(tokens, mask, P)
    lp_new.sum().backward()
    out = plain(input_ids=tokens, attention_mask=mask.long(), position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0),
                logits_to_keep=tokens.shape[1] - P + 1)
    lp_old = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, tokens[:, P:, None]).squeeze(-1)
    lp_old.sum().backward()
    assert torch.allclose(lp_new, lp_old, atol=1e-5)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, *a, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or sdpa(q, k, v, *a, **kw))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_bf16 = policy(tokens, mask, P)
    assert seen and all(d == (torch.float32,) * 3 for d in seen), seen
    assert (lp_bf16 - lp_old).abs().max() < 0.1  # bf16 matmuls, fp32 attention


def test_models_with_other_attention_are_left_alone():
    model, tok = build_preset("tiny", seed=3)
    model.set_attn_implementation("eager")
    Policy(model, tok)
    assert model.config._attn_implementation == "eager"


def test_fast_decoder_runs_lora_models_with_their_adapters_added():
    """A peft LoRA policy rolls out through the static-cache decoder (its adapters added to the fused weights at
    each prefill), and its log-probs equal a full forward through peft's layers; with the adapter disabled the
    decoder uses the base weights."""
    peft = pytest.importorskip("peft")
    from tokengym.agents import collect
    from tokengym.envs import TokenVectorEnv

    base = Policy.from_pretrained("tiny-arithmetic")
    lora = peft.get_peft_model(base.model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                               "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # B = 0 at init would make the adapter a no-op
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    policy = Policy(lora, base.tokenizer, seed=0)
    env = TokenVectorEnv(8, "arithmetic", tokenizer=base.tokenizer)
    ro = collect(env, policy, seed=0)
    assert policy._fast_active
    with torch.no_grad():
        full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
        with lora.disable_adapter():
            plain = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    am = ro.action_mask.bool()
    assert float((ro.logprobs[am] - full[am]).abs().max()) < 1e-5
    assert float((ro.logprobs[am] - plain[am]).abs().max()) > 1e-2  # the adapter matters here

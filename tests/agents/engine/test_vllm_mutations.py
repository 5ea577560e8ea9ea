"""The vLLM backend where a mutation pass found it untested (issue 52): the version it starts with, each request's
seed following its step, the prefix cache after a weight load, and the policy's top-p. One in-process engine on the
shipped tiny-calculator, shared by this module. Skipped where vLLM is not installed (``pip install 'tokengym[vllm]'``).
"""

import importlib.util

import pytest
import torch

from tokengym.agents import Policy, collect
from tokengym.agents.engine.generation import GenerationRequest
from tokengym.agents.engine.seam import SamplingSettings
from tokengym.envs import TokenVectorEnv

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed: pip install 'tokengym[vllm]'"),
              pytest.mark.usefixtures("one_thread")]

# As in test_vllm_engine.py: the same fp32 logits by other kernels differ by ~2e-5 in a log-softmax of these models.
LP_TOL = 1e-4
TOP_P = 1e-3  # the engine's policy samples from a nucleus this small: its most likely token alone
START = 3  # the version the engine starts with


@pytest.fixture(scope="module")
def calc():
    """The engine, and what it reported before any test loaded weights: ``(version, the worker's version, the
    version of a first generation)``."""
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    policy = Policy.from_pretrained("tiny-calculator", seed=4, top_p=TOP_P)
    engine = VLLMGenerator(policy, max_model_len=512, max_rows=8, row_len=128, version=START)
    try:
        first = engine.generate([GenerationRequest(prompt_ids=policy.tokenizer("1+2\n")["input_ids"], max_tokens=2)])
        started = (engine.version, engine.llm.collective_rpc("tokengym_version")[0], first[0].version)
        yield policy, engine, started
    finally:
        engine.close()


def test_the_engine_starts_with_the_version_it_was_given(calc):
    _, _, started = calc
    assert started == (START, START, START)


def test_a_requests_seed_follows_its_step_in_the_episodes_stream(calc):
    """Same episode stream, same step: the same draws; a later step (a later turn of the episode) goes on with other
    draws instead of replaying the first turn's."""
    policy, engine, _ = calc
    prompt = policy.tokenizer("7*8+5\n")["input_ids"]

    def request(step):
        return GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=SamplingSettings(temperature=1.5), seed=11,
                                 step=step)

    a, b, later = engine.generate([request(0), request(0), request(5)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != later.token_ids


def test_a_weight_load_resets_the_prefix_cache(calc):
    """A prompt of more than two KV blocks (128 tokens on the CPU) is served, then other weights are loaded: the same
    prompt is now computed with the new weights throughout, exactly as with a cache emptied by hand, not continued
    from the old weights' cached blocks."""
    policy, engine, _ = calc
    ids = policy.tokenizer("12+34=46\n" * 40)["input_ids"][:300]
    assert len(ids) == 300

    def greedy():
        out = engine.generate([GenerationRequest(prompt_ids=ids, max_tokens=8, greedy=True)])[0]
        return out.token_ids, torch.tensor(out.logprobs)

    from tokengym.agents.engine.fast_decode import plain_weights

    g = torch.Generator().manual_seed(0)
    other = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
             for k, v in plain_weights(policy.model).items()}
    try:
        old_tokens, old = greedy()  # its blocks are now in the prefix cache
        engine.load_weights(other, version=START + 1)
        tokens, after = greedy()
        engine.llm.reset_prefix_cache()
        fresh_tokens, fresh = greedy()
    finally:
        engine.load_weights(None, version=START + 2)  # the policy's own weights again
    assert float((old - fresh).abs().max()) > 100 * LP_TOL  # the new weights change what is computed
    assert tokens == fresh_tokens and float((after - fresh).abs().max()) < LP_TOL


def test_the_engine_samples_from_the_policys_top_p_nucleus(calc):
    """The policy's top-p (here a nucleus of one token) reaches every request: each generated token is the most
    likely one, with log-prob 0 in the distribution it was drawn from, as greedy decoding picks them."""
    policy, engine, _ = calc
    env = TokenVectorEnv(8, "calculator")
    ro = collect(env, engine, seed=5)
    act = ro.action_mask.bool()
    assert int(act.sum()) > 0 and float(ro.logprobs[act].abs().max()) < 1e-6
    greedy = collect(TokenVectorEnv(8, "calculator"), engine, seed=5, greedy=True)
    assert torch.equal(ro.tokens, greedy.tokens)

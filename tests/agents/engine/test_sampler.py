"""The sampler protocol: ``Policy`` (fast and generic paths) and a second, minimal implementation give the same
rollouts through ``collect``, and the rollout calls only the optional methods a sampler declares."""

import gymnasium as gym
import pytest
import torch

from tokengym.agents import Sampler
from tokengym.agents.engine.policy import Policy, position_ids, right_aligned, row_uniforms, sample_logits
from tokengym.agents.engine.rollout import collect, collect_episodes, heldout_samples
from tokengym.agents.engine.backend_check import check_sampler
from tokengym.agents.engine.sampler import SamplerCapabilities, capabilities_of
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ReverseTask

pytestmark = pytest.mark.usefixtures("one_thread")

# Both samplers run the same fp32 weights through different kernels (the fast decoder's fused matmuls and cached
# attention vs a full transformers forward over the whole history), so a logit differs by the rounding of sums taken
# in another order: a few ulps of logits of size ~16 (ulp ~2e-6); test_logits_agree_to_float_rounding measures <1e-5
# on tiny-arithmetic and pins LOGIT_TOL, 5x above that. A log-softmax moves a log-prob by at most twice the largest
# logit change, hence LP_TOL. Tokens can only differ where a row's uniform falls within ~1e-5 of a CDF step (about
# one token in 1e5; none at these seeds).
LOGIT_TOL = 5e-5
LP_TOL = 2 * LOGIT_TOL


class PlainSampler:
    """The smallest Sampler: every step one ``transformers`` forward over each row's whole history (no KV cache).

    It has per-row streams (the ``Policy`` key and uniforms, so that tokens can be compared) and ``extend`` (the
    history just grows), and none of the speed-ups: no shared prefixes, no compaction, no refill.
    ``streams=False`` drops the streams too: it then samples from its own generator and is checked greedily.
    """

    def __init__(self, model, temperature=1.0, seed=0, streams=True):
        self.model, self.temperature, self.streams = model, temperature, streams
        self.generator = torch.Generator().manual_seed(seed)
        self.loaded = 0
        self._key = self._ids = self._mask = None

    def capabilities(self, width=None):
        return SamplerCapabilities(row_streams=self.streams, extend=True, why_not="a plain forward, no KV cache")

    def begin_rollout(self):
        self._key = int(torch.randint(0, 2**62, (1,), generator=self.generator))

    def end_rollout(self):
        self._key = self._ids = self._mask = None

    def load_weights(self, state_dict=None):
        self.loaded += 1
        if state_dict is not None:
            self.model.load_state_dict(state_dict)

    def prefill(self, tokens, mask, max_new_tokens=None, copies=1):
        assert copies == 1, "copies > 1 without the shared_prefix capability"
        self._ids, self._mask = tokens.clone(), mask.bool().clone()
        return self._logits()

    def decode(self, tokens, hold=None):
        new = torch.ones_like(tokens, dtype=torch.bool) if hold is None else ~hold
        self._ids = torch.cat([self._ids, tokens[:, None]], 1)
        self._mask = torch.cat([self._mask, new[:, None]], 1)
        return self._logits()

    def extend(self, rows, tokens, lengths):
        add = torch.zeros((len(self._ids), tokens.shape[1]), dtype=self._ids.dtype)
        keep = torch.zeros(add.shape, dtype=torch.bool)
        add[rows] = tokens
        keep[rows] = torch.arange(tokens.shape[1])[None] < lengths[:, None]
        self._ids, self._mask = torch.cat([self._ids, add], 1), torch.cat([self._mask, keep], 1)
        return self._logits()[rows]

    def _logits(self):
        ids, mask = right_aligned(self._ids, self._mask)  # each row's newest real token in the last column
        out = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask))
        return out.logits[:, -1].float()

    def sample(self, logits, greedy=False, ids=None, steps=None):
        uniform = row_uniforms(self._key, ids, steps) if ids is not None and not greedy else None
        return sample_logits(logits, self.temperature, greedy=greedy, generator=self.generator, uniform=uniform)


@pytest.fixture(scope="module")
def reverse_policy():
    """A trained checkpoint: on Reverse its answers end with EOS at many different lengths (compaction happens)."""
    return Policy.from_pretrained("tiny-arithmetic", seed=0)


@pytest.fixture(scope="module")
def calc_policy():
    return Policy.from_pretrained("tiny-calculator", seed=0)


def _reverse(n, tok, **kw):
    return TokenVectorEnv(n, ReverseTask(length=(1, 12)), tokenizer=tok, max_new_tokens=24, **kw)


def _seeded(*samplers, seed=7):
    for s in samplers:
        s.generator.manual_seed(seed)


def test_policy_and_the_plain_sampler_are_samplers(reverse_policy):
    plain = PlainSampler(reverse_policy.model)
    assert isinstance(reverse_policy, Sampler) and isinstance(plain, Sampler)
    caps = reverse_policy.capabilities(40)
    assert caps == SamplerCapabilities(row_streams=True, shared_prefix=True, extend=True, compact=True, refill=True)
    generic = Policy(reverse_policy.model, reverse_policy.tokenizer, fast_decode=False).capabilities(40)
    assert generic == SamplerCapabilities(row_streams=True, extend=True,
                                          why_not="the fast decode path is off: fast_decode=False")


def test_logits_agree_to_float_rounding(reverse_policy):
    """What LOGIT_TOL rests on: the fast decoder's prefill and decode logits against full forwards."""
    env = _reverse(8, reverse_policy.tokenizer)
    obs, _ = env.reset(seed=0)
    P = env.max_prompt_len
    plain = PlainSampler(reverse_policy.model)
    with torch.inference_mode():
        fast = reverse_policy.prefill(obs["tokens"][:, :P], obs["mask"][:, :P], max_new_tokens=8)
        slow = plain.prefill(obs["tokens"][:, :P], obs["mask"][:, :P])
        gaps = [(fast - slow).abs().max().item()]
        for _ in range(6):
            tok = slow.argmax(-1)
            fast, slow = reverse_policy.decode(tok), plain.decode(tok)
            gaps.append((fast - slow).abs().max().item())
        reverse_policy.end_rollout()
    assert reverse_policy.fast_path_reason(P + 8) is None
    assert 0 < max(gaps) < LOGIT_TOL, gaps  # not bit-equal (different kernels), yet far inside the tolerance


@pytest.mark.parametrize("greedy", [False, True])
def test_conformance_on_a_long_tailed_batch(reverse_policy, greedy):
    tok = reverse_policy.tokenizer
    env = _reverse(16, tok)
    plain = PlainSampler(reverse_policy.model)
    _seeded(reverse_policy, plain)
    calls = check_sampler(reverse_policy, plain, env, atol=LP_TOL, seed=3, greedy=greedy)
    assert calls["compact"] > 0  # the fast path dropped finished rows and still matched the plain sampler
    _seeded(reverse_policy, plain)
    calls = check_sampler(plain, reverse_policy, env, atol=LP_TOL, seed=3, greedy=greedy)
    assert calls["compact"] == 0 and calls["decode"] > 10 and calls["begin_rollout"] == (0 if greedy else 1)


def test_conformance_with_continuous_batching(reverse_policy):
    """collect_episodes (a next_step env) runs through check_sampler too: refill is declared and used."""
    tok = reverse_policy.tokenizer
    twin = Policy(reverse_policy.model, tok)
    samples = heldout_samples(_reverse(1, tok).task, 8)
    _seeded(reverse_policy, twin)
    calls = check_sampler(reverse_policy, twin, _reverse(3, tok, autoreset_mode="next_step"), atol=0.0, seed=1,
                          samples=samples)
    assert calls["refill"] > 0


def test_conformance_of_the_generic_transformers_path(reverse_policy):
    generic = Policy(reverse_policy.model, reverse_policy.tokenizer, fast_decode=False)
    plain = PlainSampler(reverse_policy.model)
    _seeded(generic, plain)
    calls = check_sampler(generic, plain, _reverse(8, reverse_policy.tokenizer), atol=LP_TOL, seed=5)
    assert calls["compact"] == 0  # the generic path declares no compaction, so it is never asked


def test_conformance_with_shared_group_prefixes(reverse_policy):
    env = TokenVectorEnv(16, "arithmetic", tokenizer=reverse_policy.tokenizer, group_size=4)
    plain = PlainSampler(reverse_policy.model)
    seen = []
    prefill = reverse_policy.prefill
    reverse_policy.prefill = lambda *a, **kw: seen.append(kw.get("copies", 1)) or prefill(*a, **kw)
    try:
        _seeded(reverse_policy, plain)
        check_sampler(reverse_policy, plain, env, atol=LP_TOL, seed=2)
    finally:
        del reverse_policy.prefill
    assert seen == [4]  # the policy encoded each group's prompt once
    _seeded(reverse_policy, plain)
    check_sampler(plain, reverse_policy, env, atol=LP_TOL, seed=2)  # copies > 1 would fail the check


def test_conformance_in_a_multi_turn_env(calc_policy):
    env = TokenVectorEnv(12, "calculator", tokenizer=calc_policy.tokenizer)
    plain = PlainSampler(calc_policy.model)
    _seeded(calc_policy, plain)
    calls = check_sampler(plain, calc_policy, env, atol=LP_TOL, seed=1)
    assert calls["extend"] > 0  # the env's replies went through extend
    _seeded(calc_policy, plain)
    assert check_sampler(calc_policy, plain, env, atol=LP_TOL, seed=1)["extend"] > 0


def test_a_sampler_without_streams_samples_on_its_own_and_matches_greedily(reverse_policy):
    plain = PlainSampler(reverse_policy.model, streams=False)
    env = _reverse(8, reverse_policy.tokenizer)
    check_sampler(plain, reverse_policy, env, atol=LP_TOL, seed=4, greedy=True)
    # sampled: from its own generator (a twin seeded alike draws the same), never given ids/steps or a begin_rollout
    twin = PlainSampler(reverse_policy.model, streams=False)
    _seeded(plain, twin)
    state = plain.generator.get_state()
    calls = check_sampler(plain, twin, env, atol=0.0, seed=4)
    assert calls["begin_rollout"] == 0 and calls["sample"] > 10 and not torch.equal(plain.generator.get_state(), state)


def test_the_check_catches_a_sampler_that_breaks_the_protocol(reverse_policy):
    """check_sampler fails on a wrong log-prob and on an undeclared capability (a conformance check that could not
    fail would prove nothing)."""
    env = _reverse(8, reverse_policy.tokenizer)

    class Biased(PlainSampler):
        def sample(self, logits, greedy=False, ids=None, steps=None):
            tok, lp = super().sample(logits, greedy, ids, steps)
            return tok, lp - 1e-3

    with pytest.raises(AssertionError, match="log-probs differ"):
        check_sampler(Biased(reverse_policy.model), PlainSampler(reverse_policy.model), env, atol=LP_TOL)

    class Overclaims(PlainSampler):  # says it can compact: the rollout calls compact, which it lacks
        def capabilities(self, width=None):
            return SamplerCapabilities(row_streams=True, extend=True, compact=True)

    with pytest.raises(AttributeError, match="compact"):
        check_sampler(Overclaims(reverse_policy.model), PlainSampler(reverse_policy.model), env, atol=LP_TOL)


def test_missing_capabilities_are_refused_with_one_clear_line(reverse_policy, calc_policy):
    plain = PlainSampler(reverse_policy.model)
    with pytest.raises(ValueError, match="continuous batching needs a sampler with the 'refill' capability "
                                         r"\(a plain forward, no KV cache\)"):
        collect_episodes(_reverse(4, reverse_policy.tokenizer, autoreset_mode="next_step"), plain, n=4)

    class NoExtend(PlainSampler):
        def capabilities(self, width=None):
            return SamplerCapabilities(row_streams=True)

    with pytest.raises(ValueError, match="NoExtend has no 'extend' capability"):
        collect(TokenVectorEnv(4, "calculator", tokenizer=calc_policy.tokenizer), NoExtend(calc_policy.model))
    with pytest.raises(TypeError, match="needs a Sampler .*; dict lacks capabilities, begin_rollout"):
        capabilities_of({})
    with pytest.raises(ValueError, match="compact=True needs row_streams=True"):
        SamplerCapabilities(compact=True)


def test_after_an_optimiser_step_the_next_rollout_samples_the_new_weights():
    """Production's weight path for the fast decoder: the trainer updates the policy's module in place and the next
    rollout samples from it (``load_weights(None)`` copies nothing: the decoder rebuilds its fused weights at every
    prefill). After a real GRPO step the fast decoder still matches the plain sampler over the updated module, and
    the update moved the log-probs far beyond LP_TOL (so stale fused weights would fail the check)."""
    from tokengym.agents import GRPOAgent, GRPOConfig

    policy = Policy.from_pretrained("tiny", seed=0)
    env = _reverse(8, policy.tokenizer)
    plain = PlainSampler(policy.model)
    _seeded(policy, plain)
    before = collect(env, policy, seed=3)  # fused weights built from the weights before the step
    agent = GRPOAgent(policy, GRPOConfig(steps=1, lr=3e-3, seed=0))
    stats = agent.step(gym.make_vec("tokengym/Target-v0", num_envs=16, vectorization_mode="vector_entry_point",
                                    group_size=8, partial_credit=True))
    assert stats["train/grad_norm"] > 0
    policy.load_weights(None)  # what the token-level seam's contract asks after an update: a no-op here
    _seeded(policy, plain)
    check_sampler(policy, plain, env, atol=LP_TOL, seed=3)
    _seeded(policy)
    after = collect(env, policy, seed=3)
    n = min(before.logprobs.shape[1], after.logprobs.shape[1])
    both = (before.action_mask[:, :n] * after.action_mask[:, :n]).bool()
    assert (before.logprobs[:, :n] - after.logprobs[:, :n])[both].abs().max() > 100 * LP_TOL


def test_a_generator_takes_a_state_dict_by_name_and_records_its_version(reverse_policy):
    """The generation seam's ``load_weights(state_dict, version)`` on the in-process generator: the weights land in
    the policy's module (its greedy generations become the source policy's) and the version is recorded."""
    from tokengym.agents.engine.generation import GenerationRequest, PolicyGenerator

    gen = PolicyGenerator(Policy.from_pretrained("tiny", seed=0))
    env = _reverse(1, reverse_policy.tokenizer)
    obs, _ = env.reset(seed=5)
    prompt = obs["tokens"][0][obs["mask"][0].bool()].tolist()
    req = [GenerationRequest(prompt, max_tokens=12, greedy=True)]
    want = PolicyGenerator(reverse_policy).generate(req)[0].token_ids
    assert gen.generate(req)[0].token_ids != want
    gen.load_weights(reverse_policy.model.state_dict(), version=7)
    assert gen.version == 7 and gen.generate(req)[0].token_ids == want
    assert all(torch.equal(v, gen.policy.model.state_dict()[k]) for k, v in reverse_policy.model.state_dict().items())

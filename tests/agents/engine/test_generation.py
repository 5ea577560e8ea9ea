"""The generation seam: the fast decoder serving whole generations (``PolicyGenerator``) gives the token-level
rollouts of every bundled env, and the replay keeps the env's word on where a turn ends (it drops what an engine
generated past it, and asks again where an engine stopped first)."""

import gymnasium as gym
import pytest
import torch

from tokengym.agents import Policy, collect
from tokengym.agents.engine.backend_check import check_generator
from tokengym.agents.engine.generation import (Generation, GenerationRequest, PolicyGenerator, SamplingSettings,
                                               is_generation_backend, request_seed, stream_seed)
from tokengym.agents.engine.policy import row_uniforms
from tokengym.agents.engine.replay import collect_generated
from tokengym.envs import ENV_IDS, TokenVectorEnv

pytestmark = pytest.mark.usefixtures("one_thread")

# Both paths run the fast decoder on the same weights; the generation seam re-encodes a multi-turn history where the
# token-level loop extends its cache, and it compacts rows at other steps, so a log-prob moves by the rounding of sums
# taken in another order (test_sampler.py measures and pins it: LP_TOL there).
LP_TOL = 1e-4


@pytest.fixture(scope="module")
def calc_pair():
    """Two copies of tiny-calculator seeded alike: one serves generations, the other the token-level reference."""
    return Policy.from_pretrained("tiny-calculator", seed=4), Policy.from_pretrained("tiny-calculator", seed=4)


@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_generations_replay_to_the_token_level_rollout_in_every_bundled_env(env_id, calc_pair, bundled_env_kwargs):
    """Same tokens, masks, rewards and completions; the engine stops exactly where the env does (nothing dropped, one
    request per agent turn), greedy and sampled."""
    gen_policy, ref = calc_pair
    kw = bundled_env_kwargs(env_id)
    env = gym.make_vec(env_id, num_envs=8, vectorization_mode="vector_entry_point", group_size=2, **kw)
    for greedy in (False, True):
        gen_policy.seed(9)
        ref.seed(9)
        counts = check_generator(PolicyGenerator(gen_policy), ref, env, atol=LP_TOL, seed=2, greedy=greedy)
        assert counts["requests"] >= 8 and counts["dropped"] == 0


def test_calculator_turns_each_take_one_request(calc_pair):
    policy, _ = calc_pair
    ro = collect(TokenVectorEnv(16, "calculator"), PolicyGenerator(policy), seed=1)
    assert ro.turn_stats["replies"] > 0  # the tool answered some rows, which asked again from the whole history
    assert int(ro.generation_counts["requests"].sum()) == 16 + ro.turn_stats["replies"]


class Scripted:
    """A generator that answers every request with fixed tokens (one log-prob each), recording the requests."""

    def __init__(self, tokens, reason="length", version=3):
        self.tokens, self.reason, self.version, self.row_offset = tokens, reason, version, 0
        self.sampling = SamplingSettings()
        self.requests = []

    def rollout_key(self):
        return 123

    def load_weights(self, state_dict=None, version=None):
        self.version = version

    def generate(self, requests):
        self.requests.append(list(requests))
        out = []
        for r in requests:
            toks = self.tokens(r) if callable(self.tokens) else self.tokens
            toks = toks[: r.max_tokens]
            out.append(Generation(list(toks), [-0.5] * len(toks), self.reason, self.version))
        return out


def _ids(env, text):
    return env.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokens_past_the_env_stop_are_dropped():
    env = TokenVectorEnv(2, "arithmetic")
    eos = env.tokenizer.eos_token_id
    gen = Scripted(lambda r: _ids(env, "12") + [eos] + _ids(env, "345"))  # an engine that did not stop at EOS
    assert is_generation_backend(gen) and not is_generation_backend(Policy.from_pretrained("tiny"))
    ro = collect(env, gen, seed=0)
    assert ro.lengths.tolist() == [3, 3] and ro.terminated.all()
    assert ro.generation_counts["dropped"].tolist() == [3, 3] and ro.generation_counts["requests"].tolist() == [1, 1]
    assert ro.logprobs[:, :3].eq(-0.5).all() and ro.logprobs[:, 3:].eq(0).all() and ro.policy_version == 3


def test_an_engine_that_stops_first_is_asked_again():
    """An engine may stop on a stop string's text where the env matches other ids: the env goes on, so the row asks
    again from its history, at the stream position where it left off."""
    env = TokenVectorEnv(1, "arithmetic", max_new_tokens=6)
    calls = iter([_ids(env, "12"), _ids(env, "34"), _ids(env, "56")])
    gen = Scripted(lambda r: next(calls), reason="stop")
    ro = collect(env, gen, samples=[{"prompt": "1+1", "answer": 2}], seed=0)
    assert ro.completions == ["123456"] and ro.truncated.all()
    assert ro.generation_counts["requests"].tolist() == [3] and ro.generation_counts["dropped"].tolist() == [0]
    steps = [reqs[0].step for reqs in gen.requests]
    budgets = [reqs[0].max_tokens for reqs in gen.requests]
    assert steps == [0, 2, 4] and budgets == [6, 4, 2]
    assert list(gen.requests[1][0].prompt_ids[-2:]) == _ids(env, "12")  # the whole history, tokens as generated
    assert len({reqs[0].seed for reqs in gen.requests}) == 1  # one stream per episode


@pytest.mark.parametrize("bad, match", [
    (lambda r: [], "generated 0 tokens"),
    (lambda r: [10**6], "outside the vocabulary"),
])
def test_answers_the_replay_cannot_use_fail_in_one_line(bad, match):
    env = TokenVectorEnv(2, "arithmetic")
    with pytest.raises((RuntimeError, ValueError), match=match):
        collect(env, Scripted(bad), seed=0)


def test_a_wrong_finish_reason_or_log_prob_fails_in_one_line():
    env = TokenVectorEnv(2, "arithmetic")
    with pytest.raises(RuntimeError, match="finish reason 'abort'"):
        collect(env, Scripted([5], reason="abort"), seed=0)
    gen = Scripted([5])
    gen.generate = lambda reqs: [Generation([5], [0.7], "length", 3) for _ in reqs]
    with pytest.raises(RuntimeError, match="above 0"):
        collect(env, gen, seed=0)


def test_request_streams_are_the_token_level_streams():
    """Request ``(seed = key ^ episode, step)`` draws the uniform the token-level sampler draws for that episode and
    step; per-request seeds of engines are deterministic and differ by step."""
    key, ids, steps = 2**61 + 12345, torch.tensor([0, 3, 7]), torch.tensor([0, 5, 9])
    seeds = torch.tensor([stream_seed(key, i) - (1 << 64) if stream_seed(key, i) >= 1 << 63 else stream_seed(key, i)
                          for i in ids.tolist()])
    assert torch.equal(row_uniforms(key, ids, steps), row_uniforms(seeds, torch.zeros_like(ids), steps))
    assert request_seed(5, 1) == request_seed(5, 1) != request_seed(5, 2)
    assert 0 <= request_seed(2**64 - 1, 3) < 2**63


def test_policy_generate_honours_each_request_stop_rule_and_budget():
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    env = TokenVectorEnv(1, "arithmetic")
    prompt = env.tokenizer("12+30\n")["input_ids"]
    nl = _ids(env, "\n")[0]
    plain = GenerationRequest(prompt_ids=prompt, max_tokens=20, greedy=True)
    at_newline = GenerationRequest(prompt_ids=prompt, max_tokens=20, greedy=True, stop_token_ids=(nl,))
    short = GenerationRequest(prompt_ids=prompt, max_tokens=2, greedy=True)
    seq = GenerationRequest(prompt_ids=prompt, max_tokens=20, greedy=True, stop_sequences=(tuple(_ids(env, "=4")),))
    a, b, c, d = PolicyGenerator(policy).generate([plain, at_newline, short, seq])
    text = env.tokenizer.decode(a.token_ids)
    assert a.finish_reason == "length" and "\n" in text
    assert b.finish_reason == "stop" and b.token_ids == a.token_ids[: a.token_ids.index(nl) + 1]
    assert c.finish_reason == "length" and c.token_ids == a.token_ids[:2]
    cut = env.tokenizer.decode(d.token_ids)
    assert d.finish_reason == "stop" and cut.endswith("=4") and text.startswith(cut)
    assert all(x <= 0 for g in (a, b, c, d) for x in g.logprobs)
    with pytest.raises(ValueError, match="max_tokens=0"):
        PolicyGenerator(policy).generate([GenerationRequest(prompt_ids=prompt, max_tokens=0)])

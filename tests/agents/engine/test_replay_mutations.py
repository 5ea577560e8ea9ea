"""The generation seam's replay (issue 52's missed mutations): a data-parallel rank's rows draw the streams of their
global rows (the generator's ``row_offset``), one rollout never mixes weight versions, and an engine's log-prob
that is not finite is refused before it reaches a rollout."""

import pytest
import torch

from tokengym.agents import Policy, collect
from tokengym.agents.engine.generation import Generation, PolicyGenerator, SamplingSettings
from tokengym.envs import TokenVectorEnv

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_ranks_rows_draw_their_global_rows_streams_through_the_seam():
    """Rank 1 of 2 (``row_offset`` 8, rows 8-15 of the batch) generates, through the seam, exactly the tokens the
    one-process batch generates for those rows; without the offset its rows would replay rows 0-7's streams."""
    policy = Policy.from_pretrained("tiny", seed=0)
    gen = PolicyGenerator(policy)
    policy.seed(5)
    full = collect(TokenVectorEnv(16, "arithmetic", max_new_tokens=6), gen, seed=1)
    policy.seed(5)
    policy.row_offset = 8
    try:
        rank1 = collect(TokenVectorEnv(8, "arithmetic", max_new_tokens=6), gen, samples=full.samples[8:])
    finally:
        policy.row_offset = 0
    assert torch.equal(rank1.tokens, full.tokens[8:]) and rank1.completions == full.completions[8:]
    policy.seed(5)  # (the check can tell: the same rows drawn from rows 0-7's streams are other tokens)
    unshifted = collect(TokenVectorEnv(8, "arithmetic", max_new_tokens=6), gen, samples=full.samples[8:])
    assert not torch.equal(unshifted.tokens, full.tokens[8:])


class Versioned:
    """A generator that answers one digit token per request (so a row asks many times) with the versions
    ``versions(call, row)``, recording nothing else."""

    def __init__(self, digit, versions, logprob=-0.5):
        self.digit, self.versions, self.logprob = digit, versions, logprob
        self.sampling, self.version, self.row_offset, self.calls = SamplingSettings(), 0, 0, 0

    def rollout_key(self):
        return 7

    def load_weights(self, state_dict=None, version=None):
        self.version = version

    def generate(self, requests):
        self.calls += 1
        return [Generation([self.digit], [self.logprob], "stop", self.versions(self.calls, i))
                for i in range(len(requests))]


def _digit(env):
    return env.tokenizer.convert_tokens_to_ids("7")


@pytest.mark.parametrize("versions", [lambda call, row: 3 + (call >= 2),  # the weights changed between rounds
                                      lambda call, row: 3 + row],  # rows of one round from two versions
                         ids=["between-rounds", "within-a-round"])
def test_a_rollout_from_two_weight_versions_is_refused(versions):
    env = TokenVectorEnv(2, "arithmetic", max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"^Versioned answered with weights of versions 3 and 4 in one rollout$"):
        collect(env, Versioned(_digit(env), versions), seed=0)
    ro = collect(env, Versioned(_digit(env), lambda call, row: 5), seed=0)  # one version: taken, and recorded
    assert ro.policy_version == 5 and ro.generation_counts["requests"].tolist() == [4, 4]


@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), float("inf")])
def test_a_log_prob_that_is_not_finite_is_refused(bad):
    env = TokenVectorEnv(2, "arithmetic", max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"^Versioned reported a log-prob that is not finite or is above 0 for row 0$"):
        collect(env, Versioned(_digit(env), lambda call, row: 1, logprob=bad), seed=0)

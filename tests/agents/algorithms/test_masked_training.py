"""Training on the masked distribution a rollout was sampled from: the masked log-softmax (hand case, hypothesis
properties), the agent's log-probs in the update against the masked pure function (wiring), the mutation that trains on
the unmasked distribution (caught), and packed = padded under masks. The README's ToolCall run is the learning test
(masked GRPO from a short SFT warm start, checked there)."""

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokengym.agents import GRPOAgent, GRPOConfig, Policy, collect
from tokengym.agents import functional as Fn
from tokengym.agents.engine.policy import position_ids
from tokengym.agents.engine.rollout import used_slice
from tokengym.envs import TokenMasks, TokenVectorEnv

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                 reason="grammar masks need llguidance: pip install 'tokengym[grammar]'"),
              pytest.mark.usefixtures("one_thread")]

# The trainer's forward and the fast decoder compute the same fp32 logits of a tiny model (width 128, logits below ~20)
# in other orders: a logit moves by ~sqrt(128) * 2^-24 * 20 per layer, a log-softmax by at most twice the largest move.
LP_TOL = 1e-4


def test_the_masked_log_softmax_is_the_hand_computed_one():
    logits = torch.tensor([[[2.0, 0.0, 1.0]]], requires_grad=True)
    allowed = torch.tensor([[[True, False, True]]])
    lp = Fn.token_logprobs(logits, torch.tensor([[2]]), allowed=allowed)
    z = math.log(math.exp(2) + math.exp(1))  # the normaliser over the allowed tokens 0 and 2 only
    assert float(lp) == pytest.approx(1 - z, abs=1e-6)  # -1.3133
    lp.sum().backward()
    p0 = math.exp(2 - z)
    assert logits.grad[0, 0].tolist() == pytest.approx([-p0, 0.0, 1 - (1 - p0)], abs=1e-6)  # 0 on the masked token
    H = Fn.entropy(logits.detach(), allowed=allowed)
    assert float(H) == pytest.approx(-(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0)), abs=1e-6)
    with pytest.raises(ValueError, match=r"^label 1 at position \(0, 0\) is outside its allowed set$"):
        Fn.token_logprobs(logits.detach(), torch.tensor([[1]]), allowed=allowed)
    with pytest.raises(ValueError, match="an allowed set is empty"):
        Fn.token_logprobs(logits.detach(), torch.tensor([[1]]), allowed=torch.zeros(1, 1, 3, dtype=torch.bool))


@st.composite
def masked_logits(draw):
    B, T, V = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(2, 9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.1, 1.0, 8.0]))
    allowed = torch.rand(B, T, V, generator=g) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    keep = torch.randint(0, V, (B, T, 1), generator=g)
    allowed.scatter_(2, keep, True)  # never empty
    labels = keep[..., 0]
    return logits, allowed, labels


@settings(max_examples=60)
@given(masked_logits())
def test_masked_probabilities_sum_to_one_over_the_allowed_set_and_no_mask_is_a_full_mask(case):
    logits, allowed, labels = case
    B, T, V = logits.shape
    total = torch.zeros(B, T, dtype=torch.float64)
    for v in range(V):
        lab = torch.full((B, T), v)
        ok = allowed[..., v]
        safe = torch.where(ok[..., None], allowed, allowed | (torch.arange(V) == v))  # v allowed where it is not
        p = Fn.token_logprobs(logits, lab, allowed=safe).exp()
        total += torch.where(ok, p, torch.zeros_like(p))
    assert torch.allclose(total, torch.ones_like(total), atol=1e-12)
    full = torch.ones_like(allowed)
    assert torch.equal(Fn.token_logprobs(logits, labels, allowed=full), Fn.token_logprobs(logits, labels))
    assert torch.equal(Fn.entropy(logits, allowed=full), Fn.entropy(logits))
    # renormalising over a subset never lowers a token's probability
    assert bool((Fn.token_logprobs(logits, labels, allowed=allowed) >= Fn.token_logprobs(logits, labels) - 1e-12).all())


@settings(max_examples=60)
@given(masked_logits())
def test_the_ratio_is_one_at_pi_old_under_any_mask_and_the_compact_form_is_the_dense_one(case):
    logits, allowed, labels = case
    tm = TokenMasks.from_dense(allowed)
    dense = Fn.token_logprobs(logits, labels, allowed=allowed)
    compact = Fn.token_logprobs(logits, labels, allowed=tm.pair())
    assert torch.equal(dense, compact)
    theta = logits.clone().requires_grad_()
    logp = Fn.token_logprobs(theta, labels, allowed=tm.pair())
    mask = torch.ones_like(labels, dtype=torch.float64)
    loss, stats = Fn.policy_loss(logp, compact, torch.randn(labels.shape, dtype=torch.float64), mask)
    assert float(stats["ratio_max"]) == 1.0 and float(stats["ratio_mean"]) == 1.0 and float(stats["clipfrac"]) == 0.0
    loss.backward()
    assert bool((theta.grad[~allowed] == 0).all())  # no gradient reaches a token the mask forbade


def _warm(steps: int = 30):
    """tiny-arithmetic after a short SFT on the calls: it closes some calls right (greedy ~15% held out)."""
    from tokengym.agents import SFTConfig, train_sft
    from tokengym.envs.tasks.tool_call import ToolCallTask

    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    cfg = SFTConfig(lr=1e-3, steps=steps, warmup_steps=5, batch_size=32, eval_every=0, eval_prompts=0, log_every=0)
    train_sft(policy, ToolCallTask(), cfg)
    return policy


@pytest.fixture(scope="module")
def warm():
    return _warm()


def _reference_logp(policy, tokens, mask, p, allowed):
    """The masked pure function on an independent padded forward: log_softmax of the logits / T with -inf outside each
    token's set (``allowed`` bool [B, m, V] or None), at the sampled tokens."""
    with torch.no_grad():
        out = policy.model(input_ids=tokens, attention_mask=mask.long(), position_ids=position_ids(mask)).logits
    logits = out[:, p - 1 : -1].double() / policy.temperature
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.log_softmax(logits, -1).gather(2, tokens[:, p:, None])[..., 0]


def _update_gap(policy, mode: str) -> tuple[float, float, object]:
    """One GRPO step on ToolCall (two minibatches): the largest gap, over the agent's tokens, between the update's
    log-probs and the masked pure function of an independent forward at the same weights (taken as each minibatch's
    loss is computed), and between pi_old and that function at pi_old's weights."""
    env = TokenVectorEnv(16, "tool_call", group_size=4)
    agent = GRPOAgent(policy, GRPOConfig(steps=1, lr=1e-4, mask_training=mode, seed=0, recompute_old_logprobs=True,
                                         minibatches=2))
    rollouts, gaps, old_gaps = [], [], []
    collect_, loss = agent.collect, agent.loss
    agent.collect = lambda e: rollouts.append(collect_(e)) or rollouts[-1]

    def spy(mb, batch):
        ro = rollouts[0]
        tokens, mask, p, m = used_slice(ro, mb.rows)
        act = mb.action_mask.bool()
        want = _reference_logp(policy, tokens, mask, p, ro.token_masks.dense()[mb.rows, :m])
        gaps.append(float((mb.logp.detach().double() - want)[act].abs().max()))
        if not old_gaps:  # no optimiser step yet: these weights are pi_old's
            old_gaps.append(float((batch["old_logp"][mb.rows, :m].double() - want)[act].abs().max()))
        return loss(mb, batch)

    agent.loss = spy
    agent.learn(env)
    assert len(gaps) == 2
    return max(gaps), old_gaps[0], rollouts[0]


def test_the_update_scores_every_token_under_the_mask_it_was_sampled_under(warm):
    """Wiring: the update's log-probs (first minibatch: pi_old's weights) and pi_old are the masked pure function of an
    independent forward; the rollout's behaviour log-probs are too (they are the masked distribution's)."""
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    policy.model.load_state_dict(warm.model.state_dict())
    gap, old_gap, ro = _update_gap(policy, "masked")
    assert gap < LP_TOL and old_gap < LP_TOL
    behaviour = _reference_logp(policy, ro.tokens, ro.attention_mask, ro.prompt_len, None)  # (now past 2 steps)
    assert float(ro.token_masks.masked[ro.action_mask.bool()].float().mean()) > 0.9  # nearly every token was masked
    assert bool((ro.logprobs[ro.action_mask.bool()] > -1e-3).float().mean() > 0.5)  # most of them forced: log-prob 0
    assert float((behaviour - ro.logprobs)[ro.action_mask.bool()].abs().max()) > 1.0  # which the unmasked model is not


def test_training_on_the_unmasked_distribution_fails_the_wiring_check(warm, monkeypatch):
    """The mutation: a trainer that drops the masks (scores pi_old and pi_theta over the whole vocabulary, as a trainer
    that only hands the grammar to its sampler does) is off by whole nats on the forced tokens."""
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    policy.model.load_state_dict(warm.model.state_dict())
    forward = Policy.forward
    monkeypatch.setattr(Policy, "forward", lambda self, *a, allowed=None, **kw: forward(self, *a, **kw))
    gap, old_gap, _ = _update_gap(policy, "masked")
    assert old_gap > 1.0 and gap > 1.0
    monkeypatch.undo()
    policy.model.load_state_dict(warm.model.state_dict())
    gap_u, old_gap_u, _ = _update_gap(policy, "unmasked")  # the setting does the same, on purpose
    assert old_gap_u > 1.0


def test_packed_and_padded_forwards_agree_under_masks(warm):
    ro = collect(TokenVectorEnv(16, "tool_call", group_size=4), warm, seed=1)
    act = ro.action_mask.bool()
    outs = {}
    for packing in ("off", "bins"):
        p = Policy(warm.model, warm.tokenizer, packing=packing)
        with torch.no_grad():
            outs[packing] = p(ro.tokens, ro.attention_mask, ro.prompt_len, return_entropy=True, allowed=ro.token_masks)
    for a, b in zip(outs["off"], outs["bins"]):
        assert float((a - b)[act].abs().max()) < LP_TOL
    assert float((outs["off"][0] - ro.logprobs)[act].abs().max()) < LP_TOL  # the behaviour log-probs are these

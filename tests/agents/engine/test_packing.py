"""Packing (``rewards/packing.py``; the policy's packed forward is ``engine/policy.py``'s ``lm_logprobs``): the real tokens of a padded batch laid into bins, positions restarting per
segment and a 4D mask confining attention to each segment, give the padded forward's log-probs, entropies, values and
gradients up to float32 rounding; ``packing="off"`` is the pre-packing code path exactly; the agents' ``packing``
settings reach their forwards.

Every run is seeded and uses one torch thread. Tolerances come from float32 rounding (``_numerics.rounding_tolerance``)
or, under bf16 autocast, from bf16's unit roundoff; outputs are compared only where the padded path means something
(real completion tokens for log-probs and entropies, ``mask[:, P-1:]`` for values).

The tiny presets are Llama models: rotary position embeddings make attention depend only on *relative* positions, so
a packed forward whose positions do not restart per segment still gives their log-probs up to rounding. The position
checks therefore also run a tiny GPT-2 (learned absolute position embeddings), on which such a bug is plain.
"""

import dataclasses
import importlib.util
import pathlib

import gymnasium as gym
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import tokengym.envs  # noqa: F401
from tokengym.agents import functional as Fn
from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.algorithms.ppo import PPOAgent, PPOConfig
from tokengym.agents.algorithms.sft import SFTConfig, SFTLearner
from tokengym.agents.data.pairs import PairData, arithmetic_pairs
from tokengym.agents.engine import critic as critic_module
from tokengym.rewards import packing
from tokengym.rewards import packing as packing_core
from tokengym.agents.engine import policy as policy_module
from tokengym.agents.engine.critic import Critic
from tokengym.agents.engine.models import build_preset, load_model
from tokengym.rewards.packing import AUTO_FILL, Bins, pack, plan
from tokengym.agents.engine.policy import Policy, position_ids
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards.common import TokengymWarning

_spec = importlib.util.spec_from_file_location("_numerics", pathlib.Path(__file__).parents[1] / "_numerics.py")
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)
WIDEST = 352  # the tiny preset's widest layer (intermediate_size): the longest sum over features in a backward
EPS_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits): one rounding moves a value by at most this, relative

pytestmark = pytest.mark.usefixtures("one_thread")  # the same float rounding in every run of a comparison

# A ragged batch: P = 5 prompt columns (left padded), M = 6 completion columns (right padded); (prompt, completion)
# real tokens per row. Row 0 fills all 11 columns, row 1 has a 1-token completion, row 2 none at all.
P, M = 5, 6
L = P + M
ROWS = [(5, 6), (3, 1), (4, 0), (2, 4), (5, 3), (1, 6), (2, 2)]


def ragged(rows, prompt_len=P, new_tokens=M, seed=0, vocab=101):
    """``(tokens, mask)`` of a batch whose row i has ``rows[i] = (a, b)`` real prompt and completion tokens: random
    ids in ``[3, vocab)`` there, pad id 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(rows), prompt_len + new_tokens, dtype=torch.bool)
    for i, (a, b) in enumerate(rows):
        mask[i, prompt_len - a:prompt_len + b] = True
    return torch.randint(3, vocab, mask.shape, generator=g) * mask, mask


def tiny_gpt2() -> Policy:
    """A random 2-layer GPT-2 (learned absolute position embeddings) on the tiny preset's character tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = load_model("tiny")
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64, n_layer=2, n_head=2, n_inner=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     attn_implementation="sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
    return Policy(model, tok, fast_decode=False)


def make_policy(name: str) -> Policy:
    return tiny_gpt2() if name == "gpt2" else Policy.from_pretrained(name)


MODELS = ["tiny", "tiny-arithmetic", "gpt2"]


def both_paths(policy, tokens, mask, prompt_len=P):
    """``{mode: (logp, entropy)}`` of the padded (``off``) and the packed (``bins``) forward."""
    out = {}
    for mode in ("off", "bins"):
        policy.packing = mode
        out[mode] = policy(tokens, mask, prompt_len, return_entropy=True)
    return out


def excess(ref, got, real, tol):
    """``max |got - ref| / (tol * max |ref|)`` over the positions ``real``: at most 1 within the tolerance."""
    ref, got = ref.detach(), got.detach()
    scale = float(ref[real].abs().max())
    assert scale > 0
    return float((got - ref)[real].abs().max()) / (tol * scale)


def fp32_tolerance():
    # a forward value is built from float32 sums over at most a row's L keys and WIDEST features per layer
    return numerics.rounding_tolerance(L * WIDEST)


def logp_excess(policy, tokens, mask, tol):
    """The larger ``excess`` of the packed log-probs and entropies over the padded ones at real completion tokens."""
    out = both_paths(policy, tokens, mask)
    real = mask[:, P:]
    return max(excess(out["off"][k], out["bins"][k], real, tol) for k in (0, 1))


# ---------------------------------------------------------------------------------------------- 1. the layout
def test_pack_lays_a_hand_case_out_first_fit_decreasing():
    """Rows go longest first into the first bin with room, never split; positions restart at 0 per segment; every
    source token lands at ``bins.index``; a 1-token row and a row filling all P+M columns included."""
    A = 10  # token ids A, A+1, ... in reading order of the real tokens; P = 3 prompt and M = 3 completion columns
    mask = torch.tensor([[1, 1, 1, 1, 1, 1],   # full width: 6
                         [0, 0, 1, 1, 0, 0],   # 2
                         [0, 1, 1, 1, 1, 1],   # 5
                         [0, 0, 1, 0, 0, 0],   # 1 token
                         [0, 1, 1, 1, 0, 0]])  # 3
    tokens = torch.zeros(mask.shape, dtype=torch.long)
    tokens[mask.bool()] = torch.arange(A, A + int(mask.sum()))
    row = [tokens[i][mask[i].bool()].tolist() for i in range(5)]
    bins = pack(tokens, mask)
    # width 6; row 0 fills bin 0; row 2 (5) opens bin 1; row 4 (3) opens bin 2; row 1 (2) fits bin 2; row 3 (1) bin 1
    assert bins.tokens.tolist() == [row[0], row[2] + row[3], row[4] + row[1] + [0]]
    assert bins.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]]
    assert bins.segment.tolist() == [[0] * 6, [2] * 5 + [3], [4, 4, 4, 1, 1, -1]]
    assert bins.num_tokens == 18
    want_index = torch.full(mask.shape, -1)
    for i, start in enumerate([0, 15, 6, 11, 12]):
        want_index[i][mask[i].bool()] = start + torch.arange(int(mask[i].sum()))
    assert torch.equal(bins.index, want_index)
    assert torch.equal(bins.tokens.reshape(-1)[bins.index[mask.bool()]], tokens[mask.bool()])
    # the mask: a query sees its own segment's keys at or before it; padding sees itself only
    ok = bins.attention_bias(torch.float32)[:, 0] == 0
    seg, q, k = bins.segment, torch.arange(6)[:, None], torch.arange(6)[None, :]
    want = (seg[:, :, None] == seg[:, None, :]) & (k <= q) & ((seg[:, None, :] >= 0) | (q == k))
    assert torch.equal(ok, want)
    assert ok[1, 5].tolist() == [False] * 5 + [True]  # the 1-token row after a 5-token row sees itself only
    blocked = bins.attention_bias(torch.float32)[:, 0][~ok]
    assert bool((blocked == torch.finfo(torch.float32).min).all())


@st.composite
def ragged_masks(draw):
    """A padded batch: N rows over P + M columns, each with 1..L real tokens (a left-padded prompt part and a
    right-padded completion part), and random token ids."""
    prompt_len, new_tokens = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    width = prompt_len + new_tokens
    if width == 0:
        new_tokens = width = 1
    n = draw(st.integers(1, 8))
    mask = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        a = draw(st.integers(0 if new_tokens else 1, prompt_len))
        b = draw(st.integers(0 if a else 1, new_tokens))
        mask[i, prompt_len - a:prompt_len + b] = 1
    tokens = torch.tensor(draw(st.lists(st.integers(1, 1000), min_size=n * width, max_size=n * width))).view(n, width)
    return tokens, mask


@given(ragged_masks())
def test_pack_places_every_real_token_once_with_its_padded_position(batch):
    """For random ragged masks: every real token appears exactly once in the bins, at ``bins.index``, with the
    position id ``cumsum(mask) - 1`` the padded forward gives it and its row as segment; each row is one contiguous
    run in one bin; the bins are never more than the rows and exactly as wide as the longest row."""
    tokens, mask = batch
    real = mask.bool()
    n, lengths = tokens.shape[0], real.sum(1)
    bins = pack(tokens, mask)
    R, W = bins.tokens.shape
    assert W == int(lengths.max()) and 1 <= R <= n
    assert bins.position_ids.shape == bins.segment.shape == (R, W) and bins.index.shape == tokens.shape
    at = bins.index[real]
    assert bool((bins.index[~real] == -1).all()) and bool((at >= 0).all()) and bool((at < R * W).all())
    assert len(set(at.tolist())) == len(at) == int((bins.segment >= 0).sum())  # once each, nothing else in the bins
    assert torch.equal(bins.tokens.reshape(-1)[at], tokens[real])
    assert torch.equal(bins.position_ids.reshape(-1)[at], (mask.cumsum(1) - 1)[real])
    rows = torch.arange(n)[:, None].expand_as(mask)
    assert torch.equal(bins.segment.reshape(-1)[at], rows[real])
    for i in range(n):
        idx = bins.index[i][real[i]]
        assert torch.equal(idx, idx[0] + torch.arange(len(idx)))  # contiguous, in order
        assert int(idx[0]) // W == int(idx[-1]) // W  # never split across bins
    pad = bins.segment < 0
    assert bool((bins.tokens[pad] == 0).all()) and bool((bins.position_ids[pad] == 0).all())


# ---------------------------------------------------------------------------------------------- 2-4. forwards
@pytest.mark.parametrize("name, temperature", [(name, 1.0) for name in MODELS] + [("tiny-arithmetic", 0.7)])
def test_packed_logprobs_and_entropies_equal_the_padded_forward(name, temperature):
    """On a ragged batch (a full-width row, a 1-token and a 0-token completion), the packed forward's log-probs and
    entropies (at the policy's sampling temperature) equal the padded forward's at every real completion token within
    float32 rounding, and are exactly 0 at every padding position."""
    policy = make_policy(name)
    policy.temperature = temperature
    tokens, mask = ragged(ROWS)
    out = both_paths(policy, tokens, mask)
    real = mask[:, P:]
    for k, what in enumerate(("log-probs", "entropies")):
        assert excess(out["off"][k], out["bins"][k], real, fp32_tolerance()) <= 1, what
        assert bool((out["bins"][k][~real] == 0).all()), f"packed {what} at padding"
    assert bool(out["off"][1][real].min() > 0)  # entropies of real tokens (nothing compared is trivially 0)


@pytest.mark.parametrize("name", MODELS)
def test_packed_logprobs_equal_the_padded_forward_under_bf16_autocast(name):
    """Under bf16 autocast the packed and padded forwards run the same bf16 roundings of float32 sums taken in another
    order: a rounding that flips moves a value by about bf16's unit roundoff, so they agree within
    ``SAFETY * 2**-8`` of the largest value (and are 0 at padding in the packed path)."""
    policy = make_policy(name)
    tokens, mask = ragged(ROWS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = both_paths(policy, tokens, mask)
    real = mask[:, P:]
    for k in (0, 1):
        assert excess(out["off"][k], out["bins"][k], real, numerics.SAFETY * EPS_BF16) <= 1
        assert bool((out["bins"][k][~real] == 0).all())


@pytest.mark.parametrize("name", MODELS)
def test_packed_gradients_equal_the_padded_forwards(name):
    """The gradient of ``sum(logp * w)`` (random weights ``w`` on the real completion tokens) with respect to every
    parameter is the padded forward's within ``rounding_tolerance`` of each tensor's largest entry."""
    policy = make_policy(name)
    tokens, mask = ragged(ROWS)
    w = torch.randn(mask.shape[0], M, generator=torch.Generator().manual_seed(1)) * mask[:, P:]
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = {}
    for mode in ("off", "bins"):
        policy.packing = mode
        grads[mode] = torch.autograd.grad((policy(tokens, mask, P) * w).sum(), params)
    tol = numerics.rounding_tolerance(mask.shape[0] * L * WIDEST)  # a gradient entry sums over tokens x features
    for i, (a, b) in enumerate(zip(grads["off"], grads["bins"])):
        assert float((a - b).abs().max()) <= tol * float(a.abs().max()), f"parameter {i}"
    assert all(bool(g.abs().max() > 0) for g in grads["off"])


def test_packed_critic_values_and_gradients_equal_the_padded_forwards():
    """Critic values at ``mask[:, P-1:]`` (the state before each real action, and after the last) packed vs padded
    within float32 rounding, exactly 0 elsewhere in the packed path; so are the gradients of ``sum(v * w)``."""
    critic = Critic.from_policy(Policy.from_pretrained("tiny-arithmetic"))
    tokens, mask = ragged(ROWS)
    real = mask[:, P - 1:]
    w = torch.randn(real.shape, generator=torch.Generator().manual_seed(2)) * real
    params = list(critic.parameters())
    values, grads = {}, {}
    for mode in ("off", "bins"):
        critic.packing = mode
        values[mode] = critic(tokens, mask, P)
        grads[mode] = torch.autograd.grad((values[mode] * w).sum(), params)
    assert excess(values["off"].detach(), values["bins"].detach(), real, fp32_tolerance()) <= 1
    assert bool((values["bins"][~real] == 0).all())
    tol = numerics.rounding_tolerance(mask.shape[0] * L * WIDEST)
    for i, (a, b) in enumerate(zip(grads["off"], grads["bins"])):
        assert float((a - b).abs().max()) <= tol * float(a.abs().max()), f"parameter {i}"
    assert all(bool(g.abs().max() > 0) for g in grads["off"])


# ---------------------------------------------------------------------------------------------- 5. isolation
def test_a_segment_is_blind_to_the_other_segments_of_its_bin():
    """In a bin holding rows B (first) and A, changing every token of one leaves the other's log-probs and entropies
    bit-identical: the keys of another segment are masked to an exact 0 weight, in both directions."""
    policy = make_policy("tiny-arithmetic")
    policy.packing = "bins"
    rows = [(5, 6), (2, 4), (3, 2)]  # a full row alone; B (6 tokens) then A (5 tokens) share bin 1
    tokens, mask = ragged(rows)
    assert pack(tokens, mask).segment.tolist()[1] == [1] * 6 + [2] * 5
    base = policy(tokens, mask, P, return_entropy=True)
    for changed, kept in ((1, 2), (2, 1)):
        other = tokens.clone()
        other[changed][mask[changed]] = (tokens[changed][mask[changed]] + 4) % 98 + 3  # every real token differs
        out = policy(other, mask, P, return_entropy=True)
        assert not torch.equal(out[0][changed], base[0][changed])  # the changed row did change
        for k in (0, 1):
            assert torch.equal(out[k][kept], base[k][kept]), f"row {kept} moved when row {changed} changed"
            assert torch.equal(out[k][0], base[k][0])


def test_a_row_gets_the_same_logprobs_whichever_neighbour_shares_its_bin():
    """Row A after a 6-token neighbour (offset 6 in its bin) and before a 4-token one (offset 0) gets the same
    log-probs within float32 rounding, and those of the padded forward."""
    policy = make_policy("gpt2")
    t1, m1 = ragged([(5, 6), (2, 4), (3, 2)], seed=0)
    t2, m2 = ragged([(5, 6), (1, 3), (3, 2)], seed=1)
    t2[2], m2[2] = t1[2], m1[2]  # the same row A, another neighbour
    assert int(pack(t1, m1).index[2][m1[2]][0]) % L == 6 and int(pack(t2, m2).index[2][m2[2]][0]) % L == 0
    out1, out2 = both_paths(policy, t1, m1), both_paths(policy, t2, m2)
    real = m1[2:, P:]
    assert excess(out1["bins"][0][2:], out2["bins"][0][2:], real, fp32_tolerance()) <= 1
    assert excess(out1["off"][0][2:], out2["bins"][0][2:], real, fp32_tolerance()) <= 1


# ---------------------------------------------------------------------------------------------- 6. mutations
def positions_not_restarted(monkeypatch):
    """``pack`` with position ids counting on across the bin: the bug of packing without restarting positions."""
    real_pack = packing_core.pack

    def pack_(*args, **kwargs):
        bins = real_pack(*args, **kwargs)
        R, W = bins.tokens.shape
        return dataclasses.replace(bins, position_ids=torch.arange(W).expand(R, W))

    monkeypatch.setattr(packing_core, "pack", pack_)  # where plan() looks it up


def plain_causal_mask(monkeypatch):
    """A causal mask over the whole bin: segments attend to the segments before them."""

    def attention_bias(self, dtype):
        R, W = self.segment.shape
        causal = torch.ones(W, W, dtype=torch.bool).tril()
        return torch.zeros(W, W, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min).expand(R, 1, W, W)

    monkeypatch.setattr(Bins, "attention_bias", attention_bias)


@pytest.mark.parametrize("mutation, name", [(positions_not_restarted, "gpt2"), (plain_causal_mask, "tiny-arithmetic"),
                                            (plain_causal_mask, "gpt2")])
def test_the_forward_comparison_catches_a_broken_packing(monkeypatch, mutation, name):
    """The packed-vs-padded comparison fails by far (over 10x its tolerance, itself 4x float32's typical rounding) with positions that do not restart
    per segment or a mask that lets segments attend across, so its passing is evidence of both."""
    policy = make_policy(name)
    tokens, mask = ragged(ROWS)
    assert logp_excess(policy, tokens, mask, fp32_tolerance()) <= 1
    assert packing.honours_mask(policy.model) is None  # checked (and cached) before the mutation
    mutation(monkeypatch)
    assert logp_excess(policy, tokens, mask, fp32_tolerance()) > 10


# ---------------------------------------------------------------------------------------------- 7. agents
@pytest.fixture
def spy(monkeypatch):
    """Counts the packed forwards of Policy (``lm_logprobs``) and Critic (``hidden_at``) and records how many rows
    each packed into how many bins."""
    seen = {"lm_logprobs": [], "hidden_at": []}
    packed_forward = policy_module.lm_logprobs

    def lm_logprobs(model, bins, tokens, mask, *args, **kwargs):
        seen["lm_logprobs"].append((tokens.shape[0], bins.tokens.shape[0], tokens.numel()))
        return packed_forward(model, bins, tokens, mask, *args, **kwargs)

    def hidden_at(trunk, bins, mask, first):
        seen["hidden_at"].append((mask.shape[0], bins.tokens.shape[0], mask.numel()))
        return packing.hidden_at(trunk, bins, mask, first)

    monkeypatch.setattr(policy_module, "lm_logprobs", lm_logprobs)
    monkeypatch.setattr(critic_module, "hidden_at", hidden_at)
    return seen


def packed_rows(calls):
    """Whether some packed forward put several rows into one bin."""
    return any(r < n for n, r, _ in calls)


def arithmetic_env(n=16, g=4):
    """Arithmetic with 1-2 digit operands and subtraction: ragged rows (some bins hold two), and at seed 0 groups whose
    rewards differ, so the updates have gradients."""
    return gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=g,
                        n_operands=(2, 3), digits=(1, 2), operators="+-")


def lockstep_runs(run, spy):
    """``run(mode)`` with ``off`` recording every optimiser step's gradients, then ``bins`` stepping on them; returns
    the replay's diffs and the number of reference steps. The ``off`` run packs nothing, the ``bins`` run packs."""
    ref = numerics.Lockstep()
    with ref:
        run("off")
    assert not spy["lm_logprobs"] and not spy["hidden_at"], "packing='off' ran a packed forward"
    assert ref.steps and all(any(g is not None and bool(g.abs().max() > 0) for g in step) for step in ref.steps)
    replay = numerics.Lockstep(replay=ref.steps)
    with replay:
        run("bins")
    assert packed_rows(spy["lm_logprobs"]), "packing='bins' never packed the policy's forwards"
    return replay.diffs, len(ref.steps)


def test_grpo_packed_gradients_match_the_padded_run(spy):
    """GRPO (with a reference KL) under ``packing='bins'`` steps on the gradients of ``packing='off'`` within float32
    rounding, in lockstep; its reference and update forwards are packed."""
    seen = {}

    def run(mode):
        env = arithmetic_env()
        agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                          GRPOConfig(steps=2, lr=1e-4, beta=0.05, seed=0, skip_zero_advantage=False, packing=mode))
        assert agent.policy.packing == mode and agent.ref.packing == mode
        agent.learn(env)
        seen["width"] = env.max_prompt_len + env.max_new_tokens

    diffs, n = lockstep_runs(run, spy)
    assert n == 2
    numerics.assert_gradients_match(diffs, n, 16 * seen["width"] * WIDEST, "GRPO bins vs off")


def test_ppo_packed_gradients_match_the_padded_run(spy):
    """PPO under ``packing='bins'`` packs both the policy's and the critic's forwards, and steps on the padded run's
    policy and critic gradients within float32 rounding, in lockstep."""

    def run(mode):
        env = arithmetic_env()
        agent = PPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                         PPOConfig(steps=2, mu=1, minibatches=1, lr=1e-4, seed=0, packing=mode))
        assert agent.policy.packing == agent.critic.packing == agent.ref.packing == mode
        agent.learn(env)

    diffs, n = lockstep_runs(run, spy)
    assert packed_rows(spy["hidden_at"]), "packing='bins' never packed the critic's forwards"
    assert n == 4  # 2 updates x (policy, critic)
    widest_batch = max(numel for calls in spy.values() for _, _, numel in calls)  # the critic's batch is the wider
    numerics.assert_gradients_match(diffs, n, widest_batch * WIDEST, "PPO bins vs off")


def test_dpo_packed_gradients_match_the_padded_run(spy):
    """DPO on plain (not prefix-shared) stacks under ``packing='bins'``: the policy's and the reference's forwards pack,
    and every step's gradient is the padded run's within float32 rounding, in lockstep."""
    pairs = arithmetic_pairs(ArithmeticTask(n_operands=(2, 3), digits=2, operators="+"), 12, seed=0)

    def run(mode):
        learner = DPOLearner(Policy(*build_preset("tiny", seed=1)),
                             DPOConfig(batch_size=6, steps=2, lr=1e-3, share_prefix=False, packing=mode))
        assert learner.ref.packing == mode
        learner.fit(pairs)
        assert not learner.share_prefix

    diffs, n = lockstep_runs(run, spy)
    assert n == 2
    data = PairData.from_pairs(pairs, Policy.from_pretrained("tiny").tokenizer)
    numerics.assert_gradients_match(diffs, n, 2 * 6 * (data.prompts.shape[1] + data.completions.shape[2]) * WIDEST,
                                    "DPO bins vs off")


def test_sft_packed_gradients_match_the_padded_run(spy):
    """SFT under ``packing='bins'``: every step's gradient is the padded run's within float32 rounding, in lockstep."""
    task = ArithmeticTask(n_operands=(2, 4), digits=(1, 2), operators="+")  # ragged rows: some bins hold two

    def run(mode):
        cfg = SFTConfig(steps=3, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, eval_prompts=0, log_every=0,
                        seed=0, packing=mode)
        SFTLearner(Policy(*build_preset("tiny", seed=1)), task, cfg).fit()

    diffs, n = lockstep_runs(run, spy)
    assert n == 3
    widest_batch = max(numel for _, _, numel in spy["lm_logprobs"])  # 8 rows x the widest batch's columns
    numerics.assert_gradients_match(diffs, n, widest_batch * WIDEST, "SFT bins vs off")


# ---------------------------------------------------------------------------------------------- 8. off is the old path
def padded_forward(self, tokens, mask, prompt_len, return_entropy=False):
    """``Policy.forward`` before packing existed, verbatim."""
    m = tokens.shape[1] - prompt_len
    out = self.model(input_ids=tokens, attention_mask=mask.long(), position_ids=position_ids(mask), logits_to_keep=m + 1)
    logits = out.logits[:, :-1]
    if self.temperature != 1.0:
        logits = logits / self.temperature
    logp = Fn.token_logprobs(logits, tokens[:, prompt_len:])
    if return_entropy:
        return logp, Fn.entropy(logits, mask[:, prompt_len:])
    return logp


def test_packing_off_is_the_pre_packing_forward_bit_for_bit(spy, monkeypatch):
    """Two GRPO steps (with a reference KL) under ``packing='off'`` leave weights bit-identical to a run whose
    ``Policy.forward`` is the pre-packing padded forward: ``off`` is the old code path, not merely close to it."""

    def run():
        policy = Policy.from_pretrained("tiny-arithmetic")
        before = {k: v.clone() for k, v in policy.model.state_dict().items()}
        GRPOAgent(policy, GRPOConfig(steps=2, lr=1e-4, beta=0.05, seed=0, skip_zero_advantage=False,
                                     packing="off")).learn(arithmetic_env())
        after = policy.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)  # the steps moved the weights
        return after

    now = run()
    assert not spy["lm_logprobs"]
    monkeypatch.setattr(Policy, "forward", padded_forward)
    old = run()
    assert now.keys() == old.keys() and all(torch.equal(now[k], old[k]) for k in now)


# ---------------------------------------------------------------------------------------------- 9. auto, bad values
def test_auto_packs_only_when_the_bins_save_a_fifth_of_the_tokens():
    """``plan('auto')`` packs when the bins' ``R * W`` is at most ``AUTO_FILL`` (0.8) of the padded ``N * L``: rows of
    10, 10, 10, 5, 5 tokens of 10 columns fill 4 bins (40 of 50: packed), 10, 10, 10, 6, 5 fill 5 (padded); a long
    tail packs; ``bins`` packs regardless and ``off`` never."""
    model = Policy.from_pretrained("tiny").model
    assert AUTO_FILL == 0.8

    def batch(lengths, width=10):
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        return torch.randint(3, 101, mask.shape) * mask, mask

    at_limit, above = batch([10, 10, 10, 5, 5]), batch([10, 10, 10, 6, 5])
    bins = plan("auto", model, *at_limit)
    assert isinstance(bins, Bins) and bins.num_tokens == 40
    assert plan("auto", model, *above) is None
    assert plan("auto", model, *batch([10] * 4)) is None  # nothing to gain
    tail = plan("auto", model, *batch([10] + [1, 2, 3] * 5))
    assert isinstance(tail, Bins) and tail.num_tokens <= AUTO_FILL * 16 * 10
    assert isinstance(plan("bins", model, *above), Bins)
    assert plan("off", model, *at_limit) is None


def test_bad_packing_values_are_refused_naming_the_choices():
    """A packing value other than off/bins/auto raises ValueError naming them, in every config, Policy and Critic."""
    model, tok = build_preset("tiny", seed=0)
    makers = [lambda: GRPOConfig(packing="yes"), lambda: PPOConfig(packing="yes"), lambda: DPOConfig(packing="yes"),
              lambda: SFTConfig(packing="yes"), lambda: Policy(model, tok, packing="yes"),
              lambda: Critic(model.model, 128, packing="yes"), lambda: packing.check_packing("yes")]
    for make in makers:
        with pytest.raises(ValueError, match=r"packing.*'yes'") as err:
            make()
        assert all(f"'{c}'" in str(err.value) for c in ("off", "bins", "auto"))


def test_set_packing_sets_the_models_that_pack_and_leaves_the_others():
    model, tok = build_preset("tiny", seed=0)
    policy, own = Policy(model, tok), torch.nn.Linear(2, 1)  # a user's own value model has no packing setting
    assert packing.set_packing("bins", policy, own, None) == "bins"
    assert policy.packing == "bins" and not hasattr(own, "packing")
    with pytest.raises(ValueError, match=r"packing.*'yes'"):
        packing.set_packing("yes", policy)
    assert policy.packing == "bins"


class IgnoresMask(nn.Module):
    """A model that drops the attention mask it is given and passes a 2D all-ones mask (every key visible)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


def test_a_model_that_ignores_the_4d_mask_is_refused_under_bins_and_runs_padded_under_auto():
    """The first packed forward checks the model: one that ignores the 4D mask makes ``plan('bins')`` raise a
    one-line ValueError naming the problem, and ``plan('auto')`` fall back to the padded batch with a warning."""
    tokens, mask = ragged(ROWS)
    wrapper = IgnoresMask(Policy.from_pretrained("tiny").model)
    with pytest.raises(ValueError) as err:
        plan("bins", wrapper, tokens, mask)
    msg = str(err.value)
    assert "\n" not in msg and "IgnoresMask" in msg and "ignores the 4D attention mask" in msg and "packing='off'" in msg
    with pytest.warns(TokengymWarning, match="packing='auto' runs padded: IgnoresMask"):
        assert plan("auto", wrapper, tokens, mask) is None
    with pytest.warns(TokengymWarning):  # a fresh model is checked afresh
        assert plan("auto", IgnoresMask(Policy.from_pretrained("tiny").model), *ragged([(5, 6)] + [(1, 1)] * 6)) is None


def test_a_float64_model_keeps_float64_logprobs_packed():
    """A float64 model's packed log-probs and entropies stay float64 and equal the padded ones to float64 rounding
    (a packed path that rounds to float32 would silently drop a double-precision check to float32)."""
    torch.manual_seed(0)
    pol = Policy.from_pretrained("tiny")
    pol.model.double()
    mask = torch.zeros(2, 11, dtype=torch.long)
    mask[0] = 1
    mask[1, 3:8] = 1
    tokens = torch.randint(3, 30, mask.shape) * mask
    with torch.no_grad():
        want, want_h = pol(tokens, mask, 5, return_entropy=True)
        pol.packing = "bins"
        got, got_h = pol(tokens, mask, 5, return_entropy=True)
    real = mask[:, 5:].bool()
    assert got.dtype == got_h.dtype == torch.float64
    assert torch.allclose(got[real], want[real], rtol=0, atol=1e-12) and torch.allclose(got_h[real], want_h[real], rtol=0, atol=1e-12)

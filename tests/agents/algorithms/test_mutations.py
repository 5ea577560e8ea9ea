"""Pins left open by the test suite and found by a mutation pass: each test fails with one realistic bug (named in
its docstring) applied to the agents and passes on the real code.

Every run is seeded and uses one torch thread; comparisons are exact where both sides run the same kernels on the
same weights, and carry a tolerance derived from float32 rounding where they do not (a decode step against a full
forward pass)."""

import copy

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents import functional as F
from tokengym.agents import variants as V
from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.algorithms.grpo import GRPOAgent, GRPOConfig
from tokengym.agents.algorithms.onpolicy import Minibatch
from tokengym.agents.algorithms.rloo import RLOOAgent, RLOOConfig
from tokengym.agents.data.pairs import PairData, arithmetic_pairs
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import COMPACT_BELOW, COMPACT_EVERY, collect, trimmed_logprobs
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask


pytestmark = pytest.mark.usefixtures("one_thread")  # the same float rounding in every run of a comparison


def mixed_arithmetic(n=16, g=4):
    """Arithmetic with subtraction, which the warm start rarely solves: at seed 0 the first rollout still has a group
    whose rewards differ, so a GRPO step moves the weights (checked where a test relies on it)."""
    return gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=g,
                        n_operands=(2, 3), digits=2, operators="+-")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------------------- 1. GRPO's KL gradient
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_grpo_kl_term_carries_the_gradient_of_beta_times_the_aggregated_kl(estimator):
    """The KL term GRPO's ``loss`` returns has the autograd gradient of ``beta * masked_aggregate(kl_penalty(logp,
    ref))`` with respect to the policy log-probs. Catches the term built from ``mb.logp.detach()`` (no KL gradient)."""
    cfg = GRPOConfig(beta=0.3, kl_estimator=estimator, aggregation="seq-mean-token-mean")
    agent = GRPOAgent(Policy.from_pretrained("tiny"), cfg)
    g = torch.Generator().manual_seed(0)
    B, m = 4, 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    logp = (-torch.rand(B, m, generator=g) * 3).requires_grad_(True)
    ref = -torch.rand(B, m, generator=g) * 3
    old = logp.detach() - 0.05 * torch.rand(B, m, generator=g)
    adv = torch.randn(B, generator=g)[:, None].expand(B, m) * mask
    rows = torch.arange(B)
    batch = {"adv": adv, "mask": mask, "old_logp": old, "ref_logp": ref}
    mb = Minibatch(rows, m, mask, logp, torch.zeros(B, m))

    terms, _ = agent.loss(mb, batch)
    assert len(terms) == 2, "beta > 0: a policy term and a KL term"
    kl_term, kind = terms[1]
    assert kind == cfg.aggregation
    assert kl_term.requires_grad, "the KL term has no gradient: it was built from detached log-probs"
    (got,) = torch.autograd.grad(kl_term, logp)
    want_value = cfg.beta * F.masked_aggregate(F.kl_penalty(logp, ref, estimator), mask, cfg.aggregation)
    (want,) = torch.autograd.grad(want_value, logp)
    assert want[mask].abs().min() > 0  # every action token gets a gradient (here d != 0 on every token)
    torch.testing.assert_close(kl_term.detach(), want_value.detach(), rtol=0, atol=0)  # the same ops: exact
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- 2. no autograd in passes
def test_reference_and_pi_old_passes_record_no_autograd_graph():
    """The reference and recomputed pi_old log-probs a real ``step`` computes (``_logprobs``) are plain tensors: no
    ``requires_grad``, no ``grad_fn``. Catches ``@torch.no_grad`` dropped from ``OnPolicyAgent._logprobs`` (the values
    are right, but a graph of the whole batch's forward is kept alive)."""
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                      GRPOConfig(steps=1, mu=2, minibatches=2, beta=0.05, recompute_old_logprobs=True, lr=1e-4, seed=0))
    calls = []
    inner = agent._logprobs

    def spy(fn, ro):
        out = inner(fn, ro)
        calls.append((fn, out))
        return out

    agent._logprobs = spy
    agent.learn(mixed_arithmetic())
    assert [fn for fn, _ in calls] == [agent.policy, agent.ref]  # pi_old, then the reference
    for fn, out in calls:
        who = "pi_old" if fn is agent.policy else "reference"
        assert not out.requires_grad and out.grad_fn is None, f"the {who} pass recorded an autograd graph"


# ---------------------------------------------------------------------------------------------- 3. sync recompute
def test_synchronous_recompute_uses_the_trainers_own_log_probs_at_the_pre_update_weights():
    """``recompute_old_logprobs=True`` with mu=2, minibatches=2 (not the from-update path): the batch's ``old_logp``
    equals ``trimmed_logprobs(policy, ro)`` at the pre-update weights exactly (the same kernels), not the sampler's
    ``ro.logprobs``, which differ from it by decode-vs-forward rounding. Catches ``old_logp = ro.logprobs`` always."""
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                      GRPOConfig(steps=2, mu=2, minibatches=2, recompute_old_logprobs=True, lr=1e-3, seed=0))
    seen = []
    prepare = agent.prepare

    def spy(ro, old_logp, ref_logp):
        with torch.no_grad():  # the policy as it is before this step's update (prepare runs before it)
            expected = trimmed_logprobs(agent.policy, ro)
        seen.append((ro, old_logp.clone(), expected))
        return prepare(ro, old_logp, ref_logp)

    agent.prepare = spy
    agent.learn(mixed_arithmetic())
    assert len(seen) == 2
    for ro, old, expected in seen:
        am = ro.action_mask
        assert torch.equal(old * am, expected * am), "old_logp is not the trainer's own pi_old at the pre-update weights"
        # the premise: the sampler's log-probs differ somewhere, so a batch built from them would show
        assert ((ro.logprobs - expected).abs() * am).max() > 0


# ---------------------------------------------------------------------------------------------- 4. RLOO on shaped returns
def test_rloo_advantages_are_leave_one_out_of_the_shaped_returns():
    """RLOO with DAPO's overlong shaping on a tool env with a call cost: each episode's advantage is its shaped
    return (outcome + turn rewards + the overlong penalty, computed here by hand) minus the mean of the other G - 1
    of its group. Catches RLOO on ``ro.returns`` (no shaping) or on ``ro.outcome`` (no turn rewards either)."""
    G, buffer_frac = 4, 0.5
    agent = RLOOAgent(Policy.from_pretrained("tiny-calculator"), RLOOConfig(overlong_buffer=buffer_frac, seed=0))
    env = gym.make_vec("tokengym/Calculator-v0", num_envs=16, vectorization_mode="vector_entry_point", group_size=G,
                       call_cost=0.1)
    ro = collect(env, agent.policy, seed=0)

    budget = env.max_new_tokens
    buffer = max(1, round(buffer_frac * budget))
    start = budget - buffer
    lengths = ro.episode_lengths.double()
    penalty = -((lengths - start) / buffer).clamp(0.0, 1.0)
    shaped = ro.outcome.double() + ro.turn_rewards.double().sum(1) + penalty
    # the premise: the shaping changes some group's leave-one-out advantages both ways it could be lost
    assert (penalty != 0).any() and (ro.returns != ro.outcome).any()

    r = shaped.view(-1, G)
    loo = (r - (r.sum(1, keepdim=True) - r) / (G - 1)).reshape(-1)  # r_i - mean of the others
    adv = agent.advantages(ro)
    am = ro.action_mask
    want = loo[:, None].float().expand_as(adv) * am
    # |shaped| <= 2: float32 rounding of a few adds and one divide is below 1e-6
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    for wrong in (ro.returns, ro.outcome):  # and far from what the unshaped returns give
        bad = V.rloo_advantages(wrong, G)[:, None].expand_as(adv) * am
        assert (adv - bad).abs().max() > 0.1


# ---------------------------------------------------------------------------------------------- 5. DPO's NLL term
def test_dpo_nll_term_reads_the_chosen_completions():
    """RPO's NLL term (``nll_coef``) is the per-token mean negative log-likelihood of the *chosen* completions: the
    logged ``train/nll`` and the loss difference it makes both equal it, computed directly from a plain forward, and
    differ from the rejected completions'. Catches the NLL taken over the rejected rows."""
    task = ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")
    pairs = arithmetic_pairs(task, 8, seed=0)
    policy = Policy.from_pretrained("tiny-arithmetic")
    with_nll = DPOLearner(policy, DPOConfig(nll_coef=1.0, batch_size=8))
    without = DPOLearner(policy, DPOConfig(nll_coef=0.0, batch_size=8))
    data = with_nll.prepare(pairs)
    batch = with_nll._batch(data, torch.arange(len(data)))
    ref = with_nll._ref_batch(batch, None)
    with torch.no_grad():
        loss, stats = with_nll._loss(batch, ref)
        loss0, _ = without._loss(batch, ref)
        plain = PairData.from_pairs(pairs, policy.tokenizer).batch(torch.arange(len(data)))
        logp = policy(plain.tokens, plain.mask, plain.prompt_len).masked_fill(~plain.completion_mask, 0.0)
        per_token = logp.sum(1) / plain.completion_lens
        nll_chosen, nll_rejected = -per_token[:8].mean(), -per_token[8:].mean()
    # the packed pass (shared prefixes) and the plain one sum the same per-token log-probs in another order: float32
    # rounding of sums of at most ~30 terms of size <= 20 is far below tol (measured: 0 and 1.5e-8)
    tol = 1e-4
    assert abs(nll_chosen - nll_rejected) > 1000 * tol  # the premise: the two are told apart (0.07 against 2.65)
    torch.testing.assert_close(stats["nll"], nll_chosen, rtol=0, atol=tol)
    torch.testing.assert_close(loss - loss0, nll_chosen, rtol=0, atol=tol)


# ---------------------------------------------------------------------------------------------- 6. compaction
class EndsOnCue(Policy):
    """The tiny model, but rows of episodes ``enders`` write EOS as their first token and the others never stop before
    the budget (a fixed digit instead of any sampled EOS); records the episode ids each ``sample`` is asked for."""

    enders = (0, 5)

    def sample(self, logits, greedy=False, ids=None, steps=None):
        tok, lp = super().sample(logits, greedy, ids, steps)
        self.asked.append(ids.tolist())
        ending = torch.isin(ids.to(tok.device), torch.tensor(self.enders, device=tok.device))
        digit = self.tokenizer.convert_tokens_to_ids("1")
        return torch.where(ending, self.tokenizer.eos_token_id, torch.full_like(tok, digit)), lp


def test_compaction_drops_every_finished_row_including_row_zero():
    """With rows 0 and 5 ended at the first token, the first compaction check (after COMPACT_EVERY steps) drops both
    from the batch: the sampler is asked only for the live rows from then on. Catches a compaction that always keeps
    row 0 (or any finished row)."""
    policy = EndsOnCue.from_pretrained("tiny-arithmetic")
    policy.asked = []
    env = TokenVectorEnv(8, "arithmetic", max_new_tokens=COMPACT_EVERY + 4)
    assert len(EndsOnCue.enders) <= (1 - COMPACT_BELOW) * env.num_envs  # the premise: this many finished rows compact
    ro = collect(env, policy, seed=0)
    assert ro.lengths.tolist() == [1, 12, 12, 12, 12, 1, 12, 12]
    live = [1, 2, 3, 4, 6, 7]
    assert policy.asked[:COMPACT_EVERY] == [list(range(8))] * COMPACT_EVERY
    assert policy.asked[COMPACT_EVERY:] == [live] * (env.max_new_tokens - COMPACT_EVERY)


# ---------------------------------------------------------------------------------------------- 11. reset_ref on resume
def test_reset_ref_at_an_iteration_boundary_of_a_resumed_run():
    """iterations=2, steps=1, reset_ref: a run restored exactly at the boundary (after iteration 0's only step)
    starts iteration 1 with the reference reset to the current policy, as the uninterrupted run does. Catches the
    reset tested with ``done < it * steps`` (missed at the boundary, so the resumed run keeps the old reference)."""
    cfg = dict(iterations=2, steps=1, beta=0.1, reset_ref=True, lr=1e-3, seed=0)
    first, env = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**cfg)), mixed_arithmetic()
    first.learn(env, callback=lambda record: False)  # stop after step 1: the end of iteration 0
    assert first.global_step == 1
    assert not same_weights(first.policy.model, first.ref.model)  # the premise: the step moved the policy

    resumed, env2 = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**cfg)), mixed_arithmetic()
    for key, module in first.checkpoint_modules().items():  # what a checkpoint restores: policy and reference
        resumed.checkpoint_modules()[key].load_state_dict(module.state_dict())
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    env2.load_state_dict(env.state_dict())
    at_step = []
    step = resumed.step

    def spy(env, iteration=0):
        at_step.append((iteration, same_weights(resumed.ref.model, resumed.policy.model)))
        return step(env, iteration)

    resumed.step = spy
    resumed.learn(env2)
    assert at_step == [(1, True)], "iteration 1 of the resumed run did not start from a reference reset to the policy"


# ---------------------------------------------------------------------------------------------- 7, 12. async versions
DECODE_TOL = 1e-4
"""|sampled - recomputed| log-prob of a token under the same weights: the fast decoder's fused, cached steps against
one full forward pass of the tiny model in float32 (measured: at most 8e-6, so 1e-4 leaves 12x; one lr=1e-3 update
moves some sampled token's log-prob by more than 1)."""


def test_async_one_step_rollouts_carry_the_version_whose_weights_sampled_them():
    """Async one-step GRPO on groups whose rewards differ (the warm start solves some of a prompt's 8 samples), so every update moves the weights: rollout
    j is labelled version max(0, j - 1) and its sampled log-probs are those of the learner's weights after that many
    updates (within DECODE_TOL), and far from every other version's. Catches the weight sync publishing
    ``global_step - 1`` (rollouts sampled by the newest weights while labelled one version old) and a worker that
    labels a version without loading its weights."""
    steps = 3  # rollouts 0, 1, 2 by versions 0, 0, 1: the last is the first that a one-version-off label shows on
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=16, vectorization_mode="vector_entry_point", group_size=8)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                      GRPOConfig(steps=steps, lr=1e-3, seed=0, async_mode="one-step", correction="none"))
    versions = {0: copy.deepcopy(agent.policy.model.state_dict())}
    rollouts = []
    take = agent.collect
    agent.collect = lambda env: rollouts.append(take(env)) or rollouts[-1]
    history = agent.learn(env, callback=lambda record: versions.__setitem__(
        agent.global_step, copy.deepcopy(agent.policy.model.state_dict())))

    assert [ro.policy_version for ro in rollouts] == [max(0, j - 1) for j in range(steps)]
    assert [r["async/policy_version"] for r in history] == [float(max(0, j - 1)) for j in range(steps)]
    # the premise: the updates that made the versions rollouts are labelled with had groups whose rewards differ,
    # so the weights move from version to version
    assert all(float(ro.returns.view(-1, ro.group_size).std(1).max()) > 0 for ro in rollouts[: steps - 1])
    assert all(any(not torch.equal(versions[v][k], versions[v + 1][k]) for k in versions[v]) for v in range(steps))

    scorer = Policy.from_pretrained("tiny-arithmetic")
    scorer.eval()
    for j, ro in enumerate(rollouts):
        am = ro.action_mask
        gaps = {}
        for v in versions:
            scorer.model.load_state_dict(versions[v])
            with torch.no_grad():
                gaps[v] = float(((trimmed_logprobs(scorer, ro) - ro.logprobs).abs() * am).max())
        v = ro.policy_version
        assert gaps[v] <= DECODE_TOL, f"rollout {j} labelled version {v}: its log-probs are off by {gaps[v]:.3g} ({gaps})"
        assert all(gap > 100 * DECODE_TOL for u, gap in gaps.items() if u != v), f"rollout {j}: {gaps}"

"""The rollout's throughput paths change nothing: per-row sampling streams, compaction of finished rows, shared group
prefixes and continuous batching give the tokens of the plain lockstep rollout (log-probs to float rounding: a matrix
product's rounding may depend on how many rows it has)."""

import pytest
import torch

from tokengym.agents.engine import rollout as R
from tokengym.agents.engine.policy import Policy, row_uniforms
from tokengym.agents.engine.rollout import collect, collect_episodes, evaluate, heldout_samples
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ReverseTask

# fp32 logits of a 2-layer model computed with different row counts: ~1e-6 apart; a log-softmax adds no more
LP_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy():
    """A trained checkpoint: it ends its answers with EOS, at lengths from 10 to 24 on these Reverse prompts."""
    return Policy.from_pretrained("tiny-arithmetic", seed=0)


def _reverse(n, tok, **kw):
    """Reverse with words of 1..12 letters: completions from 2 to 13 tokens (the long tail of a small budget)."""
    return TokenVectorEnv(n, ReverseTask(length=(1, 12)), tokenizer=tok, max_new_tokens=24, **kw)


def _same(a, b):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.action_mask, b.action_mask)
    assert torch.equal(a.outcome, b.outcome) and a.completions == b.completions
    assert (a.logprobs - b.logprobs).abs().max().item() < LP_TOL


def _spy_compact(policy, monkeypatch):
    kept = []
    real = policy.compact

    def spy(keep):
        kept.append(int(keep.numel()))
        return real(keep)

    monkeypatch.setattr(policy, "compact", spy)
    return kept


def test_row_uniforms_are_splitmix64_and_independent_of_the_batch():
    mask = (1 << 64) - 1

    def splitmix(z):  # the reference finaliser on Python ints
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    key, ids, steps = 987654321, torch.tensor([0, 5, 2**40]), torch.tensor([3, 0, 17])
    want = [(splitmix(splitmix(key ^ i) ^ s) >> 40) / 2**24 for i, s in zip(ids.tolist(), steps.tolist())]
    assert row_uniforms(key, ids, steps).tolist() == pytest.approx(want, abs=0)
    big = row_uniforms(key, torch.arange(64), torch.full((64,), 9))
    assert torch.equal(row_uniforms(key, torch.tensor([7, 40]), torch.tensor([9, 9])), big[[7, 40]])
    u = row_uniforms(1, torch.arange(20000) % 100, torch.arange(20000) // 100)  # moments of U[0, 1)
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005 and u.min() >= 0 and u.max() < 1


@pytest.mark.parametrize("greedy", [False, True])
def test_compaction_drops_finished_rows_without_changing_the_rollout(policy, monkeypatch, greedy):
    env = _reverse(32, policy.tokenizer)
    policy.seed(1)
    plain = collect(env, policy, seed=3, greedy=greedy, compact=False)
    kept = _spy_compact(policy, monkeypatch)
    policy.seed(1)
    fast = collect(env, policy, seed=3, greedy=greedy)
    assert kept and kept[-1] < 32  # rows were really dropped
    assert len(set(plain.lengths.tolist())) > 3  # the batch ends at many different steps
    _same(plain, fast)


def test_compaction_with_env_replies_in_a_multi_turn_env(monkeypatch):
    policy = Policy.from_pretrained("tiny-calculator", seed=0)
    env = TokenVectorEnv(24, "calculator", tokenizer=policy.tokenizer)
    policy.seed(2)
    plain = collect(env, policy, seed=1, compact=False)
    kept = _spy_compact(policy, monkeypatch)
    policy.seed(2)
    fast = collect(env, policy, seed=1)
    assert kept and plain.turn_stats["replies"] > 0
    _same(plain, fast)
    assert plain.turn_counts["replies"].tolist() == fast.turn_counts["replies"].tolist()


def test_a_row_samples_the_same_tokens_in_any_batch(policy):
    """Per-row streams: an episode's tokens depend on its prompt and its row id, not on the batch around it."""
    big, small = _reverse(16, policy.tokenizer), _reverse(4, policy.tokenizer)
    samples = heldout_samples(big.task, 16)
    policy.seed(5)
    a = collect(big, policy, samples=samples)
    policy.seed(5)
    b = collect(small, policy, samples=samples[:4])
    assert a.completions[:4] == b.completions


def test_shared_prefix_prefill_equals_encoding_every_row(policy):
    env = TokenVectorEnv(16, "arithmetic", tokenizer=policy.tokenizer, group_size=4)
    policy.seed(1)
    plain = collect(env, policy, seed=2, share_prefix=False)
    policy.seed(1)
    shared = collect(env, policy, seed=2, share_prefix=True)
    _same(plain, shared)


def test_prefix_sharing_with_ragged_group_prompts_is_an_error(policy, monkeypatch):
    env = TokenVectorEnv(8, "arithmetic", tokenizer=policy.tokenizer, group_size=4)
    reset = env.reset

    def ragged_reset(**kw):  # a custom env whose group rows start from different prompts
        obs, info = reset(**kw)
        obs["tokens"][1, env.max_prompt_len - 2] = obs["tokens"][0, env.max_prompt_len - 3]
        return obs, info

    monkeypatch.setattr(env, "reset", ragged_reset)
    with pytest.raises(ValueError, match="share_prefix=True, but the 4 rows of group 0 hold different prompts"):
        collect(env, policy, seed=0, share_prefix=True)
    ro = collect(env, policy, seed=0)  # the default shares only where the prompts agree
    assert ro.num_episodes == 8


@pytest.mark.parametrize("greedy", [False, True])
def test_continuous_batching_returns_the_lockstep_episodes_in_start_order(policy, greedy):
    tok = policy.tokenizer
    samples = heldout_samples(_reverse(1, tok).task, 40)
    policy.seed(4)
    lockstep = collect(_reverse(40, tok), policy, samples=samples, greedy=greedy)
    policy.seed(4)
    cont = collect_episodes(_reverse(8, tok, autoreset_mode="next_step"), policy, samples, greedy=greedy)
    assert [s["prompt"] for s in cont.samples] == [s["prompt"] for s in samples]  # start order, all of them
    assert len(set(lockstep.lengths.tolist())) > 3
    _same(lockstep, cont)
    w = torch.ones((), requires_grad=True)
    (cont.logprobs * w).sum().backward()  # usable in autograd (an inference tensor cannot be saved for backward)
    assert w.grad is not None and not cont.tokens.is_inference()


def test_continuous_batching_keeps_long_episodes_it_started():
    """Five slots, ten episodes whose lengths alternate short/long: the long ones are not dropped or reordered,
    so the mean length is the mean over the prompts given, not over the first to finish."""
    from tokengym.envs.tasks import TargetTask

    policy = Policy.from_pretrained("tiny", seed=0)
    env = TokenVectorEnv(5, TargetTask("ok", n_prompts=10), tokenizer=policy.tokenizer, max_new_tokens=20,
                         autoreset_mode="next_step")
    eos = policy.tokenizer.eos_token_id
    samples = [{"prompt": f"p{i}", "stop_at": 2 if i % 2 else 19} for i in range(10)]

    class Scripted(Policy):  # EOS at the episode's own scripted length, whatever slot runs it
        def sample(self, logits, greedy=False, ids=None, steps=None):
            stop = torch.tensor([samples[i]["stop_at"] for i in ids.tolist()])
            tok = torch.where(steps + 1 >= stop, eos, 5)
            return tok, torch.zeros(len(tok))

    scripted = Scripted(policy.model, policy.tokenizer)
    ro = collect_episodes(env, scripted, samples)
    assert [s["prompt"] for s in ro.samples] == [f"p{i}" for i in range(10)]
    assert ro.lengths.tolist() == [19, 2] * 5


def test_evaluate_on_a_next_step_env_matches_lockstep(policy):
    tok = policy.tokenizer
    samples = heldout_samples(_reverse(1, tok).task, 30)
    a = evaluate(policy, _reverse(8, tok), samples)
    b = evaluate(policy, _reverse(8, tok, autoreset_mode="next_step"), samples)
    assert a == b


def test_episode_list_runs_through_next_step_autoresets():
    from tokengym.envs.tasks import TargetTask

    env = TokenVectorEnv(3, TargetTask("ok", n_prompts=10), autoreset_mode="next_step")
    env.reset(seed=0, options={"episodes": [f"q{i}" for i in range(4)]})
    assert env.episode_id.tolist() == [0, 1, 2] and not env.idle.any()
    eos = torch.full((3,), env.tokenizer.eos_token_id)
    env.step(eos)  # all three end
    assert env.ended == [0, 1, 2] and env.idle.tolist() == [False, True, True] and not env.all_done
    env.step(eos)  # slot 0 restarts with the fourth episode
    assert env.restarted == [0] and env.episode_id[0] == 3 and env.samples[0]["prompt"] == "q3"
    env.step(eos)
    assert env.ended == [0] and env.all_done
    with pytest.raises(RuntimeError, match="after every episode ended"):
        env.step(eos)


def test_bad_input_for_the_continuous_paths(policy):
    tok = policy.tokenizer
    with pytest.raises(ValueError, match="autoreset_mode='next_step'"):
        collect_episodes(_reverse(4, tok), policy, n=4)
    with pytest.raises(ValueError, match="needs group_size=1"):
        TokenVectorEnv(4, "arithmetic", group_size=2, autoreset_mode="next_step")
    with pytest.raises(ValueError, match="either samples or n"):
        collect_episodes(_reverse(4, tok, autoreset_mode="next_step"), policy)
    with pytest.raises(ValueError, match="create the env with autoreset_mode='next_step'"):
        _reverse(4, tok).reset(options={"episodes": ["ab"]})
    with pytest.raises(ValueError, match="does not combine"):
        _reverse(4, tok, autoreset_mode="next_step").reset(options={"episodes": ["ab"], "samples": ["ab"] * 4})
    generic = Policy(policy.model, tok, fast_decode=False)
    with pytest.raises(ValueError, match="fast decode path"):
        collect_episodes(_reverse(4, tok, autoreset_mode="next_step"), generic, n=4)


def test_a_policy_subclass_with_the_old_sample_signature_keeps_its_own_sampling(policy, monkeypatch):
    """A user's ``sample(self, logits, greedy=False)`` override predates the per-row streams: collect calls it as
    before (no ids/steps, so nothing to compact by) instead of failing."""

    class Old(Policy):
        def sample(self, logits, greedy=False):
            logits[:, 5] = float("-inf")  # never token 5
            return super().sample(logits, greedy)

    old = Old(policy.model, policy.tokenizer, seed=0)
    kept = _spy_compact(old, monkeypatch)
    ro = collect(_reverse(16, policy.tokenizer), old, seed=1)
    assert not kept and not (ro.tokens[:, ro.prompt_len:][ro.action_mask] == 5).any()
    assert bool((ro.logprobs[ro.action_mask] <= 0).all())


def test_greedy_rollouts_leave_the_sampling_stream_alone(policy):
    """Held-out evaluation between training steps must not change the samples the training steps draw."""
    tok = policy.tokenizer
    state = policy.generator.get_state()
    collect(_reverse(8, tok), policy, seed=0, greedy=True)
    evaluate(policy, _reverse(4, tok, autoreset_mode="next_step"), heldout_samples(_reverse(1, tok).task, 6))
    assert torch.equal(policy.generator.get_state(), state)
    collect(_reverse(8, tok), policy, seed=0)
    assert not torch.equal(policy.generator.get_state(), state)  # a sampled rollout draws its key


def test_a_data_parallel_rank_samples_its_rows_of_the_global_batch(policy):
    """``row_offset`` (set by distributed.prepare): rank 1 of 2, holding rows 8-15, draws their 1-process tokens."""
    tok = policy.tokenizer
    samples = heldout_samples(_reverse(1, tok).task, 16)
    policy.seed(5)
    full = collect(_reverse(16, tok), policy, samples=samples)
    policy.seed(5)
    policy.row_offset = 8
    try:
        rank1 = collect(_reverse(8, tok), policy, samples=samples[8:])
    finally:
        policy.row_offset = 0
    assert rank1.completions == full.completions[8:] and torch.equal(rank1.tokens, full.tokens[8:])

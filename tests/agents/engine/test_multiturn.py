"""Multi-turn rollouts: the engine extends each row's KV cache with that row's reply, the rollout's log-probs agree
with a full forward over the finished episodes, and the agents train on the agent's tokens only."""

import pytest
import torch

from tokengym.agents import GRPOAgent, GRPOConfig, Policy, PPOAgent, PPOConfig
from tokengym.agents.algorithms.grpo import grpo_advantages
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.rollout import collect, trimmed_logprobs
from tokengym.envs import Task, TokenVectorEnv


class Chatter(Task):
    """Turns end on frequent characters, so that a random model takes many turns; replies of 1-5 characters."""

    name = "chatter"
    turn_stop_strings = tuple("abcdefghijklmnopqrstuvwxyz0123456789")
    max_prompt_chars = 12
    default_max_new_tokens = 40
    max_turns = 30
    reply_timeout = None

    def sample(self, rng):
        return {"prompt": "x" * int(rng.integers(1, 10)), "answer": 1}

    def respond(self, sample, history):
        return "=" * (1 + (len(history) * 7 + len(history[-1])) % 5)

    def reward(self):
        return lambda prompts, completions, **_: [len(c) / 40 for c in completions]


def gqa_policy(**kw):
    """A tiny Llama with grouped-query attention (4 query heads, 2 key/value heads) and tied embeddings."""
    torch.manual_seed(0)
    model, tok = build_preset("tiny", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return Policy(model.eval(), tok, **kw)


@pytest.mark.parametrize("make", [lambda **kw: Policy.from_pretrained("tiny", **kw), gqa_policy], ids=["tiny", "gqa-tied"])
def test_rollout_logprobs_agree_with_a_full_forward_and_both_paths_sample_alike(make):
    rollouts = {}
    for fast in (True, False):
        policy = make(fast_decode=fast, seed=1)
        env = TokenVectorEnv(8, Chatter())
        ro = collect(env, policy, seed=0)
        assert ro.turn_stats["replies"] >= 16  # several replies per episode: the ragged extend really ran
        assert bool((ro.action_mask <= ro.attention_mask[:, ro.prompt_len:]).all())
        assert int((ro.attention_mask[:, ro.prompt_len:].sum() - ro.action_mask.sum())) > 0  # env tokens are context
        full = trimmed_logprobs(policy, ro).detach()
        # fp32, ~1e-7 per operation over a few dozen reductions: far below 1e-4, the single-turn bound
        assert float(((full - ro.logprobs) * ro.action_mask).abs().max()) < 1e-4
        assert bool((ro.logprobs[ro.action_mask == 0] == 0).all())
        rollouts[fast] = ro
    assert torch.equal(rollouts[True].tokens, rollouts[False].tokens)  # same samples: same logits to rounding


def test_extend_matches_a_prefill_of_the_whole_history():
    policy = Policy.from_pretrained("tiny", seed=0)
    g = torch.Generator().manual_seed(0)
    N, P, M = 3, 5, 12
    prompt = torch.randint(4, 100, (N, P), generator=g)
    mask = torch.ones(N, P, dtype=torch.bool)
    mask[0, :2] = False
    with torch.inference_mode():
        policy.prefill(prompt, mask, max_new_tokens=M)
        step = torch.randint(4, 100, (N,), generator=g)
        policy.decode(step)
        reply = torch.randint(4, 100, (2, 4), generator=g)
        got = policy.extend(torch.tensor([0, 2]), reply, torch.tensor([4, 2]))
        # the same histories, each as one left-padded sequence through a plain forward
        rows = [torch.cat([prompt[0][mask[0]], step[:1], reply[0]]), torch.cat([prompt[2], step[2:], reply[1, :2]])]
        W = max(len(r) for r in rows)
        ids = torch.stack([torch.cat([torch.zeros(W - len(r), dtype=torch.long), r]) for r in rows])
        m = torch.stack([torch.arange(W) >= W - len(r) for r in rows])
        from tokengym.agents.engine.policy import position_ids

        want = policy.model(input_ids=ids, attention_mask=m.long(), position_ids=position_ids(m)).logits[:, -1]
        assert float((got - want).abs().max()) < 1e-4
        # a row that got no reply decodes on from its own column
        nxt = policy.decode(torch.tensor([5, 6, 7]))
        full1 = torch.cat([prompt[1], step[1:2], torch.tensor([6])])
        want1 = policy.model(input_ids=full1[None]).logits[0, -1]
        assert float((nxt[1] - want1).abs().max()) < 1e-4
    policy.end_rollout()


def test_grpo_and_ppo_train_on_the_agents_tokens_only():
    env = TokenVectorEnv(8, Chatter(), group_size=4)
    policy = Policy.from_pretrained("tiny", seed=0)
    ro = collect(env, policy, seed=0)
    adv = grpo_advantages(ro, "outcome", "group")
    assert bool((adv[ro.action_mask == 0] == 0).all()) and bool(adv.abs().sum() > 0)
    history = GRPOAgent(policy, GRPOConfig(steps=2, seed=0)).learn(env)
    assert history[-1]["env/replies_per_episode"] > 1 and all(torch.isfinite(torch.tensor(h["train/loss"])) for h in history)

    env = TokenVectorEnv(4, Chatter())
    agent = PPOAgent(Policy.from_pretrained("tiny", seed=0), PPOConfig(steps=1, seed=0))
    ro = collect(env, agent.policy, agent.critic, seed=0)
    adv, ret, _ = agent.advantages(ro, None)
    env_tok = (ro.action_mask == 0) & ro.attention_mask[:, ro.prompt_len:]
    assert bool(env_tok.any()) and bool((adv[env_tok] == 0).all()) and bool((ro.values[env_tok] == 0).all())
    assert len(agent.learn(env)) == 1


def test_dpo_pairs_mined_from_multi_turn_episodes_score_the_agents_tokens_only():
    from tokengym.agents import DPOConfig, DPOLearner
    from tokengym.agents.data.pairs import mine_pairs

    policy = Policy.from_pretrained("tiny", seed=0)
    env = TokenVectorEnv(16, Chatter(), group_size=4)
    ro = collect(env, policy, seed=0)
    data = mine_pairs(ro)
    assert len(data) >= 2 and data.completion_agent is not None
    idx = torch.arange(len(data))
    with torch.no_grad():
        plain = DPOLearner.sequence_logps(policy, data.batch(idx)).view(2, -1)
        packed = DPOLearner.sequence_logps(policy, data.shared_batch(idx)).view(2, -1)
    # the rollout's own log-probs, summed over each chosen / rejected episode's agent tokens
    r = ro.returns.view(-1, 4)
    best, worst = r.argmax(1) + torch.arange(0, 16, 4), r.argmin(1) + torch.arange(0, 16, 4)
    keep = torch.tensor([rec["group"] for rec in data.records])
    want = torch.stack([ro.logprobs[best[keep]].sum(1), ro.logprobs[worst[keep]].sum(1)])
    # fp32 sums of at most 40 per-token log-probs, each within ~1e-6 of the rollout's
    assert float((plain - want).abs().max()) < 1e-4 and float((packed - want).abs().max()) < 1e-4
    scored = data.batch(idx).completion_mask.sum(1).view(2, -1)
    assert torch.equal(scored, torch.stack([ro.action_mask[best[keep]].sum(1), ro.action_mask[worst[keep]].sum(1)]).long())
    hist = DPOLearner(policy, DPOConfig(epochs=1, batch_size=4, seed=0)).fit(data)
    assert hist and all(torch.isfinite(torch.tensor(h["train/loss"])) for h in hist)


def test_act_in_a_gymnasium_loop_sees_the_env_replies():
    """The generic single-step API re-encodes after a reply, so its log-probs match the full forward too."""
    policy = Policy.from_pretrained("tiny", seed=3)
    env = TokenVectorEnv(4, Chatter())
    obs, _ = env.reset(seed=0)
    P, lps = env.max_prompt_len, torch.zeros(4, env.max_new_tokens + 1)
    while not env.all_done:
        col = torch.where(env.done, env.max_new_tokens, env.gen_len)
        a, lp = policy.act(obs, prompt_len=P)
        lps.scatter_(1, col[:, None], lp[:, None])
        obs, *_ = env.step(a)
    assert env.turn_stats["replies"] > 4
    am = env.action_mask[:, P:]
    with torch.no_grad():
        full = policy(env.tokens, env.attention_mask, P)
    assert float(((full - lps[:, :-1]) * am).abs().max()) < 1e-4


def test_shipped_calculator_warm_start_scores_what_its_card_says():
    """tiny-calculator: greedy never calls and scores its card's accuracy; sampled episodes call (so RL can learn)."""
    import json
    import os

    from tokengym.agents.engine.rollout import evaluate, heldout_samples
    from tokengym.envs.tasks import CalculatorTask

    folder = os.path.join(os.path.dirname(__file__), "..", "..", "..", "agents", "checkpoints", "tiny-calculator")
    meta = json.load(open(os.path.join(folder, "warmstart.json")))["after"]
    policy = Policy.from_pretrained("tiny-calculator")
    task = CalculatorTask()
    res = evaluate(policy, TokenVectorEnv(128, task), heldout_samples(task, 256))
    assert res["accuracy"] == pytest.approx(meta["calculator_accuracy"], abs=0.02) and res["replies_per_episode"] == 0.0
    ro = collect(TokenVectorEnv(256, task), policy, seed=1)
    assert 0.05 <= sum("<calc>" in c for c in ro.completions) / 256 <= 0.4
    card = open(os.path.join(folder, "..", "README.md")).read()
    assert f"{100 * meta['calculator_accuracy']:.1f}%" in card


class SlowTool(Chatter):
    """Chatter whose replies to one row take 0.5 s: with reply_grace the other rows go on meanwhile."""

    reply_timeout = 5.0
    reply_grace = 0.02
    max_turns = 6

    def sample(self, rng):
        return {"prompt": "x" * int(rng.integers(1, 10)), "answer": 1, "slow": False}

    def respond(self, sample, history):
        if sample.get("slow"):
            import time

            time.sleep(0.5)
        return super().respond(sample, history)


@pytest.mark.parametrize("fast", [True, False], ids=["static-cache", "generic"])
def test_a_slow_tool_holds_up_only_its_own_row_and_log_probs_still_agree(fast):
    policy = Policy.from_pretrained("tiny", fast_decode=fast, seed=1)
    env = TokenVectorEnv(4, SlowTool())
    samples = [{"prompt": "xx", "answer": 1, "slow": i == 0} for i in range(4)]
    seen_waiting = []
    step = env.step

    def spy(actions):
        out = step(actions)
        seen_waiting.append(env.waiting.tolist())
        return out

    env.step = spy
    ro = collect(env, policy, samples=samples)
    waited = [w[0] and not any(w[1:]) for w in seen_waiting]
    assert sum(waited) >= 2  # row 0 waited for its reply over several steps while the others stepped on
    assert ro.turn_stats["replies"] >= 8 and ro.turn_stats["tool_timeouts"] == 0
    assert int((ro.attention_mask[0, ro.prompt_len:].sum() - ro.action_mask[0].sum())) > 0  # row 0's replies landed
    full = trimmed_logprobs(policy, ro).detach()
    assert float(((full - ro.logprobs) * ro.action_mask).abs().max()) < 1e-4


def test_turn_counts_are_per_episode_so_a_sub_batch_keeps_its_own():
    """A rollout's multi-turn counts are [N] tensors like its reward components: select (and the data-parallel
    gather, which concatenates the same way) keeps each episode's own, and the batch totals are their sums."""
    env = TokenVectorEnv(8, Chatter())
    ro = collect(env, Policy.from_pretrained("tiny", seed=1), seed=0)
    replies = ro.turn_counts["replies"]
    assert replies.shape == (8,) and int(replies.sum()) == ro.turn_stats["replies"] == env.turn_stats["replies"]
    sub = ro.select([1, 3])
    assert sub.turn_stats["replies"] == int(replies[1] + replies[3]) and torch.equal(sub.turn_counts["replies"], replies[[1, 3]])

"""The vector env equals N single envs driven with the same prompts and actions, in both autoreset modes,
and hypothesis properties of buffers and per-token rewards."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokengym.envs import TokenEnv, TokenVectorEnv, char_tokenizer
from tokengym.envs.tasks import ArithmeticTask

TOK = char_tokenizer()
EOS = TOK.eos_token_id
ALPHABET = [TOK.convert_tokens_to_ids(c) for c in "0123456789+-=A: \n"] + [EOS]


def plan(rng, sample, m):
    """A per-slot action sequence: the reference solution with random corruption, or random chars."""
    if rng.random() < 0.7:
        seq = TOK(sample["solution"], add_special_tokens=False)["input_ids"] + [EOS]
        seq = [int(rng.choice(ALPHABET)) if rng.random() < 0.08 else a for a in seq]
    else:
        seq = [int(rng.choice(ALPHABET)) for _ in range(m)]
    return seq + [int(rng.choice(ALPHABET)) for _ in range(m)]


def make_task():
    return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+-")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_disabled_mode_equals_single_envs(seed):
    rng = np.random.default_rng(seed)
    n, g = 6, 2
    venv = TokenVectorEnv(n, make_task(), group_size=g, process_reward=True)
    samples = make_task().batch(rng, n // g)
    venv.reset(options={"samples": samples})
    singles = [TokenEnv(make_task(), process_reward=True, max_new_tokens=venv.max_new_tokens) for _ in range(n)]
    for i, e in enumerate(singles):
        e.reset(options={"prompt": samples[i // g]})
    plans = [plan(rng, samples[i // g], venv.max_new_tokens) for i in range(n)]
    done = [False] * n
    for t in range(venv.max_new_tokens):
        obs, r, term, trunc, _ = venv.step(torch.tensor([p[t] for p in plans]))
        for i, e in enumerate(singles):
            if done[i]:
                assert r[i] == 0
                continue
            o, ri, te, tr, _ = e.step(plans[i][t])
            assert np.array_equal(obs["tokens"][i].numpy(), o["tokens"]), (t, i)
            assert np.array_equal(obs["mask"][i].numpy(), o["mask"].astype(bool))
            assert float(r[i]) == pytest.approx(ri, abs=1e-6) and (bool(term[i]), bool(trunc[i])) == (te, tr)
            done[i] = te or tr
        if all(done):
            break
    assert all(done)
    for i, e in enumerate(singles):
        assert torch.equal(venv.rewards[i], e.venv.rewards[0])
        assert torch.equal(venv.step_end[i], e.venv.step_end[0])
        assert venv.step_scores[i] == e.venv.step_scores[0] and venv.completions[i] == e.venv.completions[0]


def test_next_step_mode_equals_single_envs_with_resets():
    rng = np.random.default_rng(5)
    n = 4
    venv = TokenVectorEnv(n, make_task(), autoreset_mode="next_step", process_reward=True)
    venv.reset(seed=5)
    singles = [TokenEnv(make_task(), process_reward=True, max_new_tokens=venv.max_new_tokens) for _ in range(n)]
    for i, e in enumerate(singles):
        e.reset(options={"prompt": venv.samples[i]})
    plans = [plan(rng, venv.samples[i], venv.max_new_tokens) for i in range(n)]
    pos, restart, episodes = [0] * n, [False] * n, 0
    for _ in range(3 * venv.max_new_tokens):
        obs, r, term, trunc, _ = venv.step(torch.tensor([p[k] for p, k in zip(plans, pos)]))
        for i, e in enumerate(singles):
            if restart[i]:  # the vector env reset this slot on this step
                o, _ = e.reset(options={"prompt": venv.samples[i]})
                assert r[i] == 0 and not term[i] and not trunc[i]
                plans[i], pos[i], restart[i] = plan(rng, venv.samples[i], venv.max_new_tokens), 0, False
            else:
                o, ri, te, tr, _ = e.step(plans[i][pos[i]])
                assert float(r[i]) == pytest.approx(ri, abs=1e-6) and (bool(term[i]), bool(trunc[i])) == (te, tr)
                pos[i] += 1
                restart[i] = te or tr
                episodes += restart[i]
            assert np.array_equal(obs["tokens"][i].numpy(), o["tokens"])
    assert episodes >= n  # every slot went through at least one full episode on average


@settings(max_examples=40)
@given(
    seed=st.integers(0, 10_000),
    actions=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=40),
    prm=st.booleans(),
)
def test_buffer_rewards_and_step_ends_follow_the_actions(seed, actions, prm):
    env = TokenVectorEnv(1, make_task(), process_reward=prm, max_new_tokens=24)
    env.reset(seed=seed)
    actions = actions + [EOS]  # every example ends its episode (by EOS or by the budget)
    P, M = env.max_prompt_len, env.max_new_tokens
    prompt_row = env.tokens[0, :P].clone()
    returned = 0.0
    for a in actions:
        _, r, term, trunc, _ = env.step(torch.tensor([a]))
        returned += float(r[0])
        if term[0] or trunc[0]:
            break
    # expected: actions up to and including the first EOS, at most M of them
    stop = actions.index(EOS) + 1 if EOS in actions else len(actions)
    expected = actions[: min(stop, M)]
    k = len(expected)
    assert torch.equal(env.tokens[0, :P], prompt_row)
    assert env.tokens[0, P : P + k].tolist() == expected
    assert (env.tokens[0, P + k :] == TOK.pad_token_id).all() and int(env.attention_mask[0].sum()) == int((prompt_row != TOK.pad_token_id).sum()) + k
    assert bool(env.terminated[0]) == (EOS in expected) and bool(env.truncated[0]) == (EOS not in expected and k == M)
    # per-token rewards sum to the episode return, split into PRM step scores and the outcome
    assert env.rewards[0].sum().item() == pytest.approx(returned, abs=1e-5)
    assert env.done[0]
    if env.done[0]:
        assert returned == pytest.approx(float(env.outcome[0]) + sum(env.step_scores[0]), abs=1e-5)
    # PRM step rewards land on step-end tokens: a newline closing a non-empty line, or the last token
    text = [TOK.convert_ids_to_tokens(a) for a in expected]
    ends, line = [], ""
    for t, ch in enumerate(text):
        if ch == "\n":
            if line.strip():
                ends.append(t)
            line = ""
        elif a_is_text(expected[t]):
            line += ch
    if env.done[0] and line.strip():
        ends.append(k - 1)
    got = env.step_end[0].nonzero().flatten().tolist()
    assert got == (ends if prm else [])
    assert len(env.step_scores[0]) == len(got)
    off_step = ~env.step_end[0]
    assert (env.process_rewards[0][off_step] == 0).all()


def a_is_text(token_id):
    return token_id != EOS

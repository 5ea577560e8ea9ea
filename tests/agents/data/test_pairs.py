"""Preference-pair data: loading (JSONL / datasets / dicts) and its errors, chat templates, the split,
the env token layout of batches, bundled arithmetic corruptions, and mining (best, worst) from groups."""

import json

import numpy as np
import pytest
import torch

from tokengym.agents.data.pairs import (CORRUPTIONS, PairData, arithmetic_pairs, corrupt_solution, load_pairs, mine_pairs,
                                   split_pairs)
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ArithmeticTask
from tokengym.envs.tokenizer import char_tokenizer
from tokengym.rewards import arithmetic_correct

PAIRS = [
    {"prompt": "1+2\n", "chosen": "1+2=3\nA: 3", "rejected": "1+2=4\nA: 4"},
    {"prompt": "12+7+30\n", "chosen": "12+7=19\n19+30=49\nA: 49", "rejected": "A: 5"},
    {"prompt": "5+5\n", "chosen": "5+5=10\nA: 10", "rejected": "5+5=10\nA: 11", "note": "kept"},
]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture
def task():
    return ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")


# ------------------------------------------------------------------ loading
def test_sources_load_the_same_pairs(tmp_path):
    import datasets

    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n\n")
    from_list = load_pairs(PAIRS)
    assert load_pairs(str(path)) == from_list == load_pairs(path)
    ds = load_pairs(datasets.Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in PAIRS]))
    assert [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in from_list] == ds
    assert from_list[2]["note"] == "kept" and len(load_pairs(PAIRS, limit=2)) == 2


def test_missing_column_error_names_the_existing_columns():
    bad = [{"prompt": "1+1\n", "good": "A: 2", "bad": "A: 3"}]
    with pytest.raises(ValueError, match=r"no 'chosen' column.*\['bad', 'good', 'prompt'\]"):
        load_pairs(bad)
    renamed = load_pairs(bad, columns={"chosen": "good", "rejected": "bad"})
    assert renamed == [{"prompt": "1+1\n", "chosen": "A: 2", "rejected": "A: 3"}]


def test_missing_column_in_a_dataset_names_its_columns():
    import datasets

    ds = datasets.Dataset.from_list([{"question": "1+1\n", "chosen": "A: 2", "rejected": "A: 3"}])
    with pytest.raises(ValueError, match=r"no 'prompt' column.*\['chosen', 'question', 'rejected'\]"):
        load_pairs(ds)


def test_empty_data_is_an_error(tmp_path):
    import datasets

    with pytest.raises(ValueError, match="empty"):
        load_pairs([])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_pairs(str(empty))
    with pytest.raises(ValueError, match="empty"):
        load_pairs(datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []}))


def test_loading_errors_are_specific(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_pairs(str(bad))
    with pytest.raises(FileNotFoundError):
        load_pairs(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="'chosen' must be a string"):
        load_pairs([{"prompt": "x", "chosen": 3, "rejected": "y"}])
    with pytest.raises(TypeError):
        load_pairs(42)


def test_split_keeps_prompts_apart_and_is_seeded(task):
    pairs = arithmetic_pairs(task, 40, seed=0)
    pairs += [dict(p, rejected=p["rejected"] + " ") for p in pairs[:10]]  # repeated prompts
    train, val = split_pairs(pairs, 0.2, seed=1)
    assert len(train) + len(val) == len(pairs) and len(val) >= 0.2 * len(pairs)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in val}
    assert split_pairs(pairs, 0.2, seed=1) == (train, val)
    with pytest.raises(ValueError):
        split_pairs(pairs, 1.5)


# ------------------------------------------------------------------ tokenization and layout
def test_batch_is_the_env_layout_chosen_rows_first(tok, task):
    data = PairData.from_pairs(PAIRS, tok)
    b = data.batch([0, 1])
    P, B = b.prompt_len, 2
    assert b.tokens.shape[0] == 2 * B and P == max(len(p["prompt"]) for p in PAIRS[:2]) + 1  # + <bos>
    # prompts exactly as the env encodes them, left-padded into P columns, identical for chosen and rejected rows
    env = TokenVectorEnv(2, task, tokenizer=tok, max_prompt_len=P)
    env.reset(options={"samples": [p["prompt"] for p in PAIRS[:2]]})
    assert torch.equal(b.tokens[:B, :P], env.tokens[:, :P]) and torch.equal(b.tokens[B:, :P], env.tokens[:, :P])
    assert torch.equal(b.mask[:B, :P], env.attention_mask[:, :P])
    for i, p in enumerate(PAIRS[:2]):
        for row, text in ((i, p["chosen"]), (B + i, p["rejected"])):
            n = int(b.completion_mask[row].sum())
            ids = b.tokens[row, P:P + n].tolist()
            assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == text
            assert not b.completion_mask[row, n:].any() and torch.equal(b.mask[row, P:], b.completion_mask[row])
    assert b.num_tokens == int(b.mask.sum())


def test_batches_trim_to_their_own_longest_prompt_and_completion(tok):
    data = PairData.from_pairs(PAIRS, tok)
    b0, ball = data.batch([0]), data.batch([0, 1, 2])
    assert b0.tokens.shape[1] < ball.tokens.shape[1]
    assert b0.prompt_len == len("1+2\n") + 1 and b0.tokens.shape[1] == b0.prompt_len + len("1+2=3\nA: 3") + 1


def test_truncation_and_dropping(tok):
    long = [{"prompt": "9" * 20 + "\n", "chosen": "abcdef", "rejected": "abcxyz"}, {"prompt": "1\n", "chosen": "ab", "rejected": "ac"}]
    with pytest.warns(UserWarning, match="cut to their last tokens"):
        data = PairData.from_pairs(long, tok, max_prompt_len=6)
    assert int(data.prompt_lens.max()) == 6
    with pytest.warns(UserWarning) as caught:  # completions identical once cut to 3 tokens
        data = PairData.from_pairs(long, tok, max_prompt_len=6, max_length=9)
    assert any("dropped 1 of 2" in str(w.message) for w in caught)
    assert len(data) == 1 and data.texts(tok, 0)["rejected"] == "ac<eos>"
    with pytest.raises(ValueError, match="no preference pair is left .* identical after truncation"), pytest.warns(UserWarning):
        PairData.from_pairs(long[:1], tok, max_prompt_len=6, max_length=9)


def test_chat_template(tok):
    chat = char_tokenizer()
    chat.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}")
    data = PairData.from_pairs([PAIRS[0]], chat, chat_template=True)
    t = data.texts(chat, 0)
    assert t == {"prompt": "[user]1+2\n[assistant]", "chosen": "1+2=3\nA: 3", "rejected": "1+2=4\nA: 4"}
    msgs = [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2"}],
             "chosen": [{"role": "assistant", "content": "3"}], "rejected": [{"role": "assistant", "content": "4"}]}]
    assert PairData.from_pairs(msgs, chat, chat_template=True).texts(chat, 0)["prompt"] == "[system]add[user]1+2[assistant]"
    with pytest.raises(ValueError, match="has no chat template"):
        PairData.from_pairs(PAIRS, tok, chat_template=True)
    with pytest.raises(ValueError, match="chat_template=True"):
        PairData.from_pairs(msgs, tok)


def test_concat_and_select(tok):
    a, b = PairData.from_pairs(PAIRS[:1], tok), PairData.from_pairs(PAIRS[1:], tok)
    both = PairData.concat([a, b])
    ref = PairData.from_pairs(PAIRS, tok)
    for i in range(3):
        assert both.texts(tok, i) == ref.texts(tok, i)
    assert both.select([2, 0]).texts(tok, 0) == ref.texts(tok, 2)
    assert len(both.records) == 3


# ------------------------------------------------------------------ bundled arithmetic pairs
def test_arithmetic_pairs_are_seeded_and_verified(task):
    pairs = arithmetic_pairs(task, 60, seed=3)
    assert pairs == arithmetic_pairs(task, 60, seed=3) and pairs != arithmetic_pairs(task, 60, seed=4)
    prompts = [p["prompt"] for p in pairs]
    answers = [p["answer"] for p in pairs]
    assert arithmetic_correct(prompts, [p["chosen"] for p in pairs], answer=answers) == [1.0] * 60
    assert arithmetic_correct(prompts, [p["rejected"] for p in pairs], answer=answers) == [0.0] * 60
    assert {p["kind"] for p in pairs} == set(CORRUPTIONS)
    complete = arithmetic_pairs(task, 60, seed=3, complete=True)
    assert arithmetic_correct(prompts, [p["rejected"] for p in complete], answer=answers) == [0.0] * 60
    assert all("A: " in p["rejected"] for p in complete)
    held = set(prompts[:5])
    assert not held & {p["prompt"] for p in arithmetic_pairs(task, 60, seed=3, exclude_prompts=held)}


@pytest.mark.parametrize("complete", [False, True])
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_kinds_do_what_they_say(kind, complete):
    rng = np.random.default_rng(0)
    for prompt, solution in [("12+7+30\n", ["12+7=19", "19+30=49", "A: 49"]), ("63+51+26\n", ["63+51=114", "114+26=140", "A: 140"]),
                             ("4+7\n", ["4+7=11", "A: 11"])]:
        for _ in range(10):
            lines = corrupt_solution(prompt, kind, rng, complete=complete).splitlines()
            first = next(i for i, (x, y) in enumerate(zip(lines, solution)) if x != y)
            if kind == "answer_digit":
                assert len(lines) == len(solution) and first == len(solution) - 1
                got, want = lines[-1][3:], solution[-1][3:]
            else:
                assert first < len(solution) - 1
                if complete:  # the error is carried through every later step to a wrong answer
                    assert len(lines) == len(solution) and lines[-1] != solution[-1]
                    for ln in lines[first + 1:-1]:
                        x, y = ln.split("=")
                        assert sum(int(v) for v in x.split("+")) == int(y)
                    assert lines[-1] == "A: " + lines[-2].split("=")[1]
                else:  # the solution stops at the end of its first wrong line
                    assert len(lines) == first + 1
                (a, rest), (a0, rest0) = lines[first].split("+"), solution[first].split("+")
                (b, c), (b0, c0) = rest.split("="), rest0.split("=")
                if kind == "step_digit":
                    assert (a, b) == (a0, b0)
                    got, want = c, c0
                else:
                    assert (a, b) != (a0, b0) and int(c) == int(a) + int(b)
                    got, want = (a, a0) if a != a0 else (b, b0)
            assert len(got) == len(want) and sum(u != v for u, v in zip(got, want)) == 1, (lines, solution)


# ------------------------------------------------------------------ mining from env groups
def _grouped_rollout(G=4, groups=3):
    env = TokenVectorEnv(G * groups, ArithmeticTask(n_operands=2, digits=1, operators="+"), group_size=G, max_new_tokens=6)
    return collect(env, Policy.from_pretrained("tiny", seed=0), seed=0)


def test_mining_takes_best_and_worst_and_skips_groups_without_a_gap():
    ro = _grouped_rollout()
    G = ro.group_size
    ro.outcome = torch.tensor([0.0, 0.6, 0.5, 0.2,   0.3, 0.3, 0.3, 0.3,   1.0, 1.0, 0.0, 1.0])
    ro.rewards = torch.zeros_like(ro.rewards)
    ro.rewards[torch.arange(12), ro.lengths - 1] = ro.outcome
    data = mine_pairs(ro)
    assert len(data) == 2  # group 1 has no reward gap
    assert [r["group"] for r in data.records] == [0, 2]
    for i, (best, worst) in enumerate([(1, 0), (8, 10)]):
        P = ro.prompt_len
        assert torch.equal(data.prompts[i], ro.tokens[best, :P].masked_fill(~ro.attention_mask[best, :P], data.pad_id))
        for k, row in enumerate((best, worst)):
            n = int(data.completion_lens[k, i])
            assert n == int(ro.lengths[row])
            assert torch.equal(data.completions[k, i, :n], ro.tokens[row, P:P + n])  # the rollout's own tokens
        assert data.records[i]["chosen_reward"] > data.records[i]["rejected_reward"]
    assert len(mine_pairs(ro, min_gap=0.9)) == 1  # only group 2 has a gap above 0.9
    ro.outcome = torch.full((12,), 0.5)
    ro.rewards.zero_()
    empty = mine_pairs(ro)
    assert len(empty) == 0 and empty.records == []
    with pytest.raises(ValueError, match="group_size"):
        mine_pairs(ro.select(range(12)).__class__(**{**ro.__dict__, "group_size": 1}))


def test_mined_batches_reproduce_the_rollout_rows():
    ro = _grouped_rollout(G=2, groups=4)
    ro.outcome = torch.tensor([1.0, 0.0] * 4)
    ro.rewards = torch.zeros_like(ro.rewards)
    ro.rewards[torch.arange(8), ro.lengths - 1] = ro.outcome
    data = mine_pairs(ro)
    b = data.batch(torch.arange(len(data)))
    P = b.prompt_len
    for i in range(4):
        for row, src in ((i, 2 * i), (4 + i, 2 * i + 1)):
            real = b.tokens[row][b.mask[row]]
            assert torch.equal(real, ro.tokens[src][ro.attention_mask[src]])

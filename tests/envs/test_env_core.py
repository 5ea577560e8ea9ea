"""TokenVectorEnv / TokenEnv semantics: layout, stopping, rewards placement, groups, resets."""

import numpy as np
import pytest
import torch

from tokengym.envs import TokenEnv, TokenVectorEnv, char_tokenizer
from tokengym.envs.tasks.toy import TargetTask

TOK = char_tokenizer()
EOS = TOK.eos_token_id


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def drive(env, columns):
    """Step `env` with a list of per-step action lists; return the step outputs."""
    return [env.step(torch.tensor(col)) for col in columns]


def test_layout_prompt_left_padded_generation_from_P():
    env = TokenVectorEnv(2, TargetTask("ok"), max_prompt_len=6)
    obs, _ = env.reset(options={"samples": ["p0\n", "p1\n"]})
    P = env.max_prompt_len
    # row = [pad, pad, <bos>, 'p', '0', '\n'] then generation
    assert obs["tokens"][0, :P].tolist() == [TOK.pad_token_id] * 2 + [TOK.bos_token_id] + ids("p0\n")
    assert obs["mask"][0].tolist() == [False, False, True, True, True, True] + [False] * env.max_new_tokens
    a = ids("o")[0]
    obs, *_ = env.step(torch.tensor([a, a]))
    assert obs["tokens"][:, P].tolist() == [a, a] and obs["mask"][:, P].all()


def test_terminated_on_eos_truncated_on_budget_and_eos_on_last_slot_is_termination():
    env = TokenVectorEnv(3, TargetTask("ok", max_new_tokens=3))
    env.reset(seed=0)
    x = ids("x")[0]
    outs = drive(env, [[EOS, x, x], [x, x, x], [x, x, EOS]])
    _, _, term, trunc, _ = outs[0]
    assert term.tolist() == [True, False, False] and not trunc.any()
    _, _, term, trunc, _ = outs[2]
    assert term.tolist() == [True, False, True]  # EOS as the M-th token terminates
    assert trunc.tolist() == [False, True, False]
    assert env.gen_len.tolist() == [1, 3, 3]


def test_finished_slots_are_masked_and_flags_sticky_in_disabled_mode():
    env = TokenVectorEnv(2, TargetTask("ok"))
    env.reset(seed=0)
    x = ids("x")[0]
    drive(env, [[EOS, x]])
    before = env.tokens[0].clone()
    obs, r, term, trunc, _ = env.step(torch.tensor([x, x]))
    assert torch.equal(env.tokens[0], before), "a finished slot's buffer changed"
    assert term.tolist() == [True, False] and r[0] == 0 and env.gen_len.tolist() == [1, 2]


def test_outcome_reward_on_last_token_and_info():
    env = TokenVectorEnv(2, TargetTask("ok"))
    env.reset(seed=0)
    o, k = ids("ok")
    outs = drive(env, [[o, o], [k, o], [EOS, EOS]])
    _, r, term, _, info = outs[2]
    assert r.tolist() == [1.0, 0.0] and term.all()
    assert info["completion"].tolist() == ["ok", "oo"] and info["_completion"].all()
    assert env.rewards[0].tolist()[:3] == [0.0, 0.0, 1.0]
    assert env.reward_components[0] == {"target_match": 1.0}
    assert env.outcome.tolist() == [1.0, 0.0]


def test_groups_are_contiguous_and_group_ids_unique_across_resets():
    env = TokenVectorEnv(6, TargetTask("ok", n_prompts=50), group_size=3)
    _, info = env.reset(seed=3)
    p = env.prompts
    assert p[0] == p[1] == p[2] and p[3] == p[4] == p[5]
    g1 = info["group_id"].tolist()
    assert g1[:3] == [g1[0]] * 3 and g1[3:] == [g1[3]] * 3 and g1[0] != g1[3]
    _, info = env.reset()
    assert not set(info["group_id"].tolist()) & set(g1)


def test_partial_reset_mask_resets_only_whole_groups():
    env = TokenVectorEnv(4, TargetTask("ok"), group_size=2)
    env.reset(seed=0)
    x = ids("x")[0]
    drive(env, [[EOS, EOS, x, x]])
    env.reset(options={"reset_mask": torch.tensor([True, True, False, False])})
    assert env.gen_len.tolist() == [0, 0, 1, 1] and not env.done[:2].any()
    with pytest.raises(ValueError, match="whole groups"):
        env.reset(options={"reset_mask": torch.tensor([True, False, False, False])})


def test_next_step_autoreset_restarts_slot_with_zero_reward():
    env = TokenVectorEnv(2, TargetTask("ok", n_prompts=10), autoreset_mode="next_step")
    env.reset(seed=0)
    x = ids("x")[0]
    _, _, term, _, _ = env.step(torch.tensor([EOS, x]))
    assert term.tolist() == [True, False]
    obs, r, term, trunc, _ = env.step(torch.tensor([x, x]))
    assert r[0] == 0 and not term[0] and not trunc[0]
    assert env.gen_len.tolist() == [0, 2] and obs["tokens"][0, env.max_prompt_len] == TOK.pad_token_id


def test_multi_token_stop_string_ends_at_its_last_token():
    env = TokenVectorEnv(1, TargetTask("ok", max_new_tokens=8), stop_strings=["##"])
    env.reset(seed=0)
    h, x = ids("#")[0], ids("x")[0]
    flags = [bool(env.step(torch.tensor([a]))[2][0]) for a in (h, x, h, h)]
    assert flags == [False, False, False, True]
    assert env.completions[0] == "#x##"


def test_seeded_reset_replays_prompts():
    a = TokenVectorEnv(4, TargetTask("ok", n_prompts=100))
    b = TokenVectorEnv(4, TargetTask("ok", n_prompts=100))
    a.reset(seed=7)
    b.reset(seed=7)
    assert a.prompts == b.prompts
    a.reset(seed=8)
    assert a.prompts != b.prompts


def test_single_env_info_at_episode_end():
    env = TokenEnv(TargetTask("ok"))
    obs, info = env.reset(seed=0, options={"prompt": "p1\n"})
    assert info["prompt"] == "p1\n" and obs["mask"].dtype == np.int8
    o, k = ids("ok")
    assert env.step(o)[4] == {}
    env.step(k)
    _, r, term, trunc, info = env.step(EOS)
    assert (r, term, trunc) == (1.0, True, False)
    assert info["completion"] == "ok" and info["episode_return"] == 1.0 and info["outcome_reward"] == 1.0


def test_local_tokenizer_folder_works(tmp_path):
    char_tokenizer().save_pretrained(tmp_path / "tok")
    env = TokenVectorEnv(2, TargetTask("ok"), tokenizer=str(tmp_path / "tok"))
    obs, _ = env.reset(seed=0)
    assert env.vocab_size == len(TOK) and obs["tokens"].shape[0] == 2


def test_a_cuda_env_names_its_device_index(monkeypatch):
    """Tensors made on "cuda" report "cuda:0"; an env that kept the bare "cuda" refused its own policy's actions
    ("actions are on cuda:0 but the env is on cuda"), seen on an H200 with bench/cuda_check.py."""
    from tokengym.envs.vector_setup import with_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert with_index("cuda") == torch.device("cuda", 0) == torch.device("cuda:0")
    assert with_index("cuda:1") == torch.device("cuda:1") and with_index("cpu") == torch.device("cpu")

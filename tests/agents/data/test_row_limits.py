"""Preference pairs against the model's positions: ``max_length`` (and DPO's ``max_prompt_len``) cut the long rows,
and the metrics say how many were cut (``train/truncated``); GPT-2's ``n_positions`` is a limit too."""

import json

import pytest


def _pairs(path):
    """4 pairs, the first 2 with prompts of 3,001 tokens (past the tiny model's 512 positions), the rest short."""
    with open(path, "w") as f:
        for i in range(4):
            prompt = ("1+2" * 1000 if i < 2 else "1+2") + f"{i}\n"
            f.write(json.dumps({"prompt": prompt, "chosen": f"A: {i}", "rejected": f"A: {i + 1}"}) + "\n")


def test_dpo_cuts_long_pairs_to_max_length_and_logs_the_fraction(tmp_path):
    from tokengym.agents import DPOConfig, DPOLearner, Policy

    pairs = tmp_path / "pairs.jsonl"
    _pairs(pairs)
    cfg = DPOConfig(steps=1, batch_size=4, max_length=300, max_prompt_len=200, share_prefix=False)
    history = DPOLearner(Policy.from_pretrained("tiny-arithmetic"), cfg).fit(str(pairs))
    assert [r["train/truncated"] for r in history if "train/truncated" in r] == [0.5]  # one step of 4 pairs, 2 cut
    with pytest.raises(ValueError, match=r"^the longest pair \(prompt '1\+21\+2.*is 3008 tokens long, over the model's "
                                         r"512 positions .*train/truncated logs the fraction of pairs cut$"):
        DPOLearner(Policy.from_pretrained("tiny-arithmetic"), DPOConfig(steps=1)).fit(str(pairs))


def test_a_reward_model_logs_the_fraction_of_rows_max_length_cut(tmp_path):
    from tokengym.agents import Policy
    from tokengym.rewards import LikelihoodRewardModel, RewardModelConfig, train_reward_model

    pairs = tmp_path / "pairs.jsonl"
    _pairs(pairs)
    policy = Policy.from_pretrained("tiny-arithmetic")
    rm = LikelihoodRewardModel(policy.model, policy.tokenizer, max_length=300)
    history = train_reward_model(rm, None, str(pairs), RewardModelConfig(batch_size=4, val_fraction=0))
    assert [r["train/truncated"] for r in history if "train/truncated" in r] == [0.5]  # 4 of the 8 rows


def test_gpt2_positions_are_the_models_limit():
    from transformers import GPT2Config, GPT2LMHeadModel

    from tokengym.rewards.common import check_rows_fit, max_positions

    model = GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=8, n_layer=1, n_head=1, vocab_size=16))
    assert max_positions(model) == 64
    check_rows_fit(model, [10, 64, 3], str, "fix it")
    with pytest.raises(ValueError, match=r"^1 is 65 tokens long, over the model's 64 positions \(max_position_embeddings\): "
                                         r"fix it$"):
        check_rows_fit(model, [10, 65, 3], str, "fix it")

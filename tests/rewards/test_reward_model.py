"""Bradley-Terry reward model: the wrapper is an outcome reward any env takes; training learns a preference."""

import json

import numpy as np
import pytest
import torch

from tokengym.agents.engine.models import load_classifier
from tokengym.envs import TokenVectorEnv
from tokengym.rewards import OutcomeReward, RewardModel, RewardModelConfig, train_reward_model
from tokengym.rewards.reward_model import load_rows, split_rows


@pytest.fixture(scope="module")
def tiny_rm():
    return load_classifier("tiny", head="sequence", seed=0)


def marked_pairs(n, seed=0):
    """Random texts; the chosen one ends with '!' and the rejected one with '?'."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefgh")
    out = []
    for i in range(n):
        body = lambda: "".join(rng.choice(letters, size=int(rng.integers(2, 6))))  # noqa: E731
        out.append({"prompt": f"q{i}\n", "chosen": body() + "!", "rejected": body() + "?"})
    return out


def test_scores_are_batched_deterministic_and_match_one_by_one(tiny_rm):
    model, tok = tiny_rm
    prompts = ["1+2\n", "33+4\n", "5+60+7\n"]
    comps = ["1+2=3\nA: 3", "", "5+60=65\n65+7=72\nA: 72"]
    rm = RewardModel(model, tok, batch_size=2)
    scores = rm(prompts, comps, answer=[3, 37, 72])  # task fields are ignored
    assert isinstance(rm, OutcomeReward)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and not scores.requires_grad
    one_by_one = torch.cat([RewardModel(model, tok, batch_size=1)([p], [c]) for p, c in zip(prompts, comps)])
    torch.testing.assert_close(scores, one_by_one, atol=1e-5, rtol=1e-5)
    with torch.enable_grad():
        assert rm.forward_ids(rm.encode(prompts, comps)).requires_grad


def test_scoring_leaves_train_mode_alone(tiny_rm):
    model, tok = tiny_rm
    model.train()
    RewardModel(model, tok)(["1+1\n"], ["A: 2"])
    assert model.training
    model.eval()


def test_layout_is_prompt_then_completion_then_eos(tiny_rm):
    model, tok = tiny_rm
    ids = RewardModel(model, tok).encode(["1+2\n"], ["A: 3"])[0]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[1:-1]) == "1+2\nA: 3"
    assert RewardModel(model, tok, max_length=4).encode(["1+2\n"], ["A: 3"])[0] == ids[-4:]


def test_plugs_into_an_env_as_the_outcome_reward(tiny_rm):
    model, tok = tiny_rm
    rm = RewardModel(model, tok)
    env = TokenVectorEnv(4, "arithmetic", reward=rm, max_new_tokens=3)
    env.reset(seed=0)
    for t in "A:":
        env.step(torch.full((4,), tok.convert_tokens_to_ids(t)))
    _, reward, terminated, _, info = env.step(torch.full((4,), tok.eos_token_id))
    assert terminated.all()
    expected = rm(env.prompts, ["A:"] * 4)
    torch.testing.assert_close(reward, expected)
    torch.testing.assert_close(env.outcome, expected)
    assert set(info["reward_components"]) == {"reward_model"}


def test_save_and_load_round_trip(tiny_rm, tmp_path):
    model, tok = tiny_rm
    rm = RewardModel(model, tok, batch_size=7, name="rm")
    rm.save_pretrained(tmp_path / "rm")
    files = {p.name for p in (tmp_path / "rm").iterdir()}
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    assert json.loads((tmp_path / "rm" / "reward_model.json").read_text())["batch_size"] == 7
    loaded = RewardModel.from_pretrained(tmp_path / "rm")
    assert loaded.batch_size == 7 and loaded.name == "rm"
    prompts, comps = ["1+2\n", "9+9\n"], ["A: 3", "9+9=18\nA: 18"]
    torch.testing.assert_close(loaded(prompts, comps), rm(prompts, comps))
    # a folder written by load_classifier's model alone loads too (given its tokenizer)
    model.save_pretrained(tmp_path / "bare")
    torch.testing.assert_close(RewardModel.from_pretrained(tmp_path / "bare", tokenizer=tok)(prompts, comps), rm(prompts, comps))
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        RewardModel.from_pretrained(tmp_path / "missing")


def test_normalize_centres_and_scales_a_reference_set(tiny_rm, tmp_path):
    model, tok = tiny_rm
    prompts, comps = [f"{i}+1\n" for i in range(8)], [f"A: {i}" for i in range(8)]
    rm = RewardModel(model, tok)
    raw = rm(prompts, comps)
    scores = rm.normalize(prompts, comps)(prompts, comps)
    assert abs(scores.mean().item()) < 1e-5 and scores.std().item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(scores, (raw - raw.mean()) / raw.std())
    rm.save_pretrained(tmp_path / "rm")
    torch.testing.assert_close(RewardModel.from_pretrained(tmp_path / "rm")(prompts, comps), scores)
    with pytest.raises(ValueError, match="scale"):
        RewardModel(model, tok, scale=0.0)


def test_training_learns_a_preference_and_reports_heldout_accuracy():
    model, tok = load_classifier("tiny", head="sequence", seed=0)
    pairs = marked_pairs(192)
    train, held = pairs[:128], pairs[128:]
    rm = RewardModel(model, tok)

    def accuracy():
        rc = rm([p["prompt"] for p in held], [p["chosen"] for p in held])
        rr = rm([p["prompt"] for p in held], [p["rejected"] for p in held])
        return (rc > rr).float().mean().item()

    before = accuracy()
    seen = []
    hist = train_reward_model(model, tok, train, RewardModelConfig(lr=2e-3, batch_size=16, epochs=2, eval_every=4),
                              eval_pairs=held, callback=seen.append)
    assert seen == hist
    evals = [h for h in hist if "eval/accuracy" in h]
    assert [h["step"] for h in evals] == [4, 8, 12, 16]
    assert evals[-1]["eval/accuracy"] == pytest.approx(accuracy())
    assert before < 0.75 and evals[-1]["eval/accuracy"] > 0.95, (before, evals[-1])
    losses = [h["train/loss"] for h in hist if "train/loss" in h]
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])
    assert not model.training


def test_default_holds_out_prompts_and_callback_stops():
    model, tok = load_classifier("tiny", head="sequence", seed=0)
    hist = train_reward_model(model, tok, marked_pairs(40), RewardModelConfig(batch_size=8, val_fraction=0.25),
                              callback=lambda r: r["step"] < 2)
    assert [h["step"] for h in hist] == [1, 2]
    full = train_reward_model(model, tok, marked_pairs(40), RewardModelConfig(batch_size=8, val_fraction=0.25))
    assert [h["step"] for h in full if "train/loss" in h] == [1, 2, 3, 4]  # 30 training pairs, 10 held out
    assert "eval/accuracy" in full[-1]


def test_centering_term_pulls_rewards_to_zero():
    def mean_reward(center):
        model, tok = load_classifier("tiny", head="sequence", seed=0)
        with torch.no_grad():
            model.score.weight.add_(0.5)  # start far from zero
        hist = train_reward_model(model, tok, marked_pairs(64), RewardModelConfig(lr=1e-3, batch_size=16, center_coef=center, epochs=2),
                                  eval_pairs=marked_pairs(16, seed=1))
        return abs(hist[-1]["eval/reward_mean"])

    assert mean_reward(1.0) < 0.5 * mean_reward(0.0)


def test_rows_from_jsonl_dataset_and_their_errors(tmp_path):
    rows = marked_pairs(3)
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_rows(str(path), ("prompt", "chosen", "rejected")) == rows
    datasets = pytest.importorskip("datasets")
    assert load_rows(datasets.Dataset.from_list(rows), ("prompt", "chosen", "rejected")) == rows
    with pytest.raises(ValueError, match=r"no \['rejected'\] column"):
        load_rows([{"prompt": "p", "chosen": "c"}], ("prompt", "chosen", "rejected"))
    with pytest.raises(ValueError, match="empty"):
        load_rows([], ("prompt",))
    with pytest.raises(TypeError, match="cannot read"):
        load_rows(42, ("prompt",))
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match="pairs.jsonl:1"):
        load_rows(str(path), ("prompt",))
    train, held = split_rows(marked_pairs(20), 0.25, seed=0)
    assert len(held) == 5 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}


def test_bad_inputs_are_named(tiny_rm):
    model, tok = tiny_rm
    with pytest.raises(ValueError, match="'chosen' must be a string"):
        train_reward_model(model, tok, [{"prompt": "p", "chosen": 1, "rejected": "r"}] * 2, RewardModelConfig(val_fraction=0))
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModel(load_classifier("tiny", num_labels=2)[0], tok)
    with pytest.raises(TypeError, match="nn.Module"):
        RewardModel(lambda x: x, tok)
    with pytest.raises(ValueError, match="got 2 prompts for 1"):
        RewardModel(model, tok)(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="distinct prompts"):
        train_reward_model(model, tok, [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4)


@pytest.mark.parametrize("field, value", [("lr", 0.0), ("epochs", 0), ("batch_size", 0), ("val_fraction", 1.0),
                                          ("center_coef", -1.0), ("max_length", 1), ("eval_every", -1)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"RewardModelConfig.{field}"):
        RewardModelConfig(**{field: value})


def test_likelihood_rm_scores_the_completion_given_the_prompt_and_trains_as_a_reward_model(tmp_path):
    from tokengym.agents.engine.models import frozen_copy, load_model
    from tokengym.rewards import LikelihoodRewardModel

    lm, tok = load_model("tiny")
    rm = LikelihoodRewardModel(lm, tok, beta=0.5)
    prompts, comps = ["1+2\n", "12+30\n", "1+2\n"], ["A: 3", "12+30=42\nA: 42", ""]
    # by hand: 0.5 * sum of log p(token | prefix) over the completion's tokens and the closing EOS
    expected = []
    for p, c in zip(prompts, comps):
        pid, cid = tok(p)["input_ids"], tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            lp = torch.log_softmax(lm(input_ids=torch.tensor([pid + cid])).logits[0, :-1], -1)
        expected.append(0.5 * sum(lp[len(pid) - 1 + j, t].item() for j, t in enumerate(cid)))
    torch.testing.assert_close(rm(prompts, comps), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    # batched like one by one (padding and sorting change nothing); max_length keeps the last tokens
    torch.testing.assert_close(LikelihoodRewardModel(lm, tok, beta=0.5, batch_size=1)(prompts, comps), rm(prompts, comps))
    short = LikelihoodRewardModel(lm, tok, beta=0.5, max_length=4)(["12+30\n"], ["12+30=42\nA: 42"])
    assert torch.isfinite(short).all()
    # with a reference equal to the model, the (implicit) reward is 0; training moves it off 0 the right way
    implicit = LikelihoodRewardModel(lm, tok, beta=0.5, reference=frozen_copy(lm))
    torch.testing.assert_close(implicit(prompts, comps), torch.zeros(3))
    pairs = marked_pairs(96)
    hist = train_reward_model(implicit, None, pairs[:64], RewardModelConfig(lr=2e-3, batch_size=16, epochs=2), eval_pairs=pairs[64:])
    assert hist[-1]["eval/accuracy"] > 0.9, hist[-1]
    assert not lm.training and all(not p.requires_grad for p in implicit.reference.parameters())
    implicit.save_pretrained(tmp_path / "lrm")
    loaded = LikelihoodRewardModel.from_pretrained(tmp_path / "lrm")  # the reference is not saved: log p alone
    assert loaded.beta == 0.5 and loaded.reference is None
    torch.testing.assert_close(loaded(prompts, comps), LikelihoodRewardModel(lm, tok, beta=0.5)(prompts, comps))
    # the generic loader recognises the folder instead of reading the LM as a classifier with a random head
    generic = RewardModel.from_pretrained(tmp_path / "lrm")
    assert type(generic) is LikelihoodRewardModel
    torch.testing.assert_close(generic(prompts, comps), loaded(prompts, comps))
    with pytest.raises(ValueError, match="beta"):
        LikelihoodRewardModel(lm, tok, beta=0.0)


@pytest.mark.parametrize("loader", ["RewardModel", "LikelihoodRewardModel", "LearnedPRM"])
def test_trust_remote_code_cannot_be_turned_on(tmp_path, loader):
    """The README says trust_remote_code is never on: the loaders take no such switch."""
    import tokengym.rewards as R

    with pytest.raises(ValueError, match="^trust_remote_code: tokengym never runs a model folder's own Python code"):
        getattr(R, loader).from_pretrained(str(tmp_path), trust_remote_code=True)

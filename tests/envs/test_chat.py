"""Chat prompts (TRL's conversational format) in token envs, with a small chat tokenizer: the bundled char tokenizer
plus ChatML's ``<|im_start|>`` / ``<|im_end|>`` and a ChatML template, whose pad token is its end-of-turn token (as
SmolLM2's is). The real chat model's own checks are in ``tests/agents/engine/test_real_model.py``."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.envs import char_tokenizer
from tokengym.envs.chat import encode_prompts, end_of_turn_ids, is_messages, prompt_texts
from tokengym.envs.tasks import ArithmeticTask, DatasetTask
from tokengym.rewards import number_match

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    t = char_tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML
    t.eos_token = t.pad_token = "<|im_end|>"
    return t


def vec(tok, n=2, **kw):
    return gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point", tokenizer=tok,
                        chat=True, n_operands=2, digits=1, **kw)


def test_the_template_is_applied_once_and_every_prompt_token_is_real(tok):
    env = vec(tok)
    obs, _ = env.reset(seed=0)
    msgs = env.samples[0]["prompt"]
    assert is_messages(msgs) and msgs == [{"role": "user", "content": msgs[0]["content"]}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    P = env.max_prompt_len
    row = obs["tokens"][0, :P][obs["mask"][0, :P]]
    assert tok.decode(row.tolist()) == want  # no BOS or other token added, the end-of-turn marker inside kept
    assert int((row == tok.pad_token_id).sum()) == 1  # the prompt's own <|im_end|>, though it is also the pad id
    assert env.prompts[0] == want == prompt_texts(tok, [msgs])[0]
    assert encode_prompts(tok, [msgs])[0] == row.tolist()


def test_end_of_turn_ends_the_episode_and_the_reply_is_scored_free_form(tok):
    env = vec(tok)
    env.reset(seed=0)
    answers = [s["answer"] for s in env.samples]
    reply = f"The answer is {answers[0]}."
    for ch in reply:
        env.step(torch.full((2,), tok.convert_tokens_to_ids(ch)))
    _, reward, terminated, truncated, _ = env.step(torch.full((2,), tok.convert_tokens_to_ids("<|im_end|>")))
    assert terminated.all() and not truncated.any()
    assert env.completions == [reply, reply]
    assert reward.tolist() == [1.0, float(answers[1] == answers[0])]
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_the_prompt_buffer_fits_the_template_and_the_longest_question(tok):
    task = ArithmeticTask(n_operands=3, digits=2, chat=True, system_prompt="Be brief.")
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=1, vectorization_mode="vector_entry_point", tokenizer=tok,
                       chat=True, n_operands=3, digits=2, system_prompt="Be brief.")
    longest = max(len(encode_prompts(tok, [s["prompt"]])[0]) for s in task.batch(np.random.default_rng(1), 500))
    assert longest <= env.max_prompt_len <= longest + 4  # one token per character, plus a spare


def test_dataset_prompts_may_be_message_lists(tok):
    rows = [{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6"}]
    env = gym.make_vec("tokengym/Dataset-v0", num_envs=2, vectorization_mode="vector_entry_point", data=rows,
                       tokenizer=tok, shuffle=False)
    env.reset(seed=0)
    assert env.prompts[0].startswith("<|im_start|>system\nAdd.<|im_end|>")
    with pytest.raises(ValueError, match="row 1: the prompt .* must be a list of chat messages"):
        DatasetTask([rows[0], {"prompt": "3+3?", "answer": "6"}])


def test_chat_prompts_need_a_chat_template():
    with pytest.raises(ValueError, match="chat prompts need a tokenizer with a chat template"):
        vec(char_tokenizer())
    with pytest.raises(ValueError, match="system_prompt needs chat=True"):
        ArithmeticTask(system_prompt="hi")


def test_number_match_reads_free_form_answers():
    replies = ["17 + 25 = 42", "The answer is **42**.", "so \\boxed{42}", "42", "17 + 25 = 32", "", "Answer: 4,2"]
    assert number_match([""] * 7, replies, answer=[42] * 7) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_an_unknown_chat_role_is_refused_naming_it():
    """A typo'd role ('usr') would be rendered however the template treats unknown roles, or dropped: refuse it."""
    from tokengym.envs.tasks import DatasetTask
    from tokengym.envs.chat import CHAT_ROLES

    bad = [{"role": "user", "content": "1+2?"}, {"role": "usr", "content": "and 3?"}]
    with pytest.raises(ValueError, match=r"^row 1: unknown chat role 'usr' \(roles: system, user, assistant, tool\)$"):
        DatasetTask([{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}, {"prompt": bad, "answer": "2"}])
    for role in CHAT_ROLES:  # every known role is accepted
        DatasetTask([{"prompt": [{"role": role, "content": "hi"}], "answer": "1"}])

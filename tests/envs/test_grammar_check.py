"""``check_grammar``: an env's grammar walked to a finished answer before any episode (envs/grammar_check.py)."""

import importlib.util

import pytest
import torch

from tokengym.envs import TokenVectorEnv, check_grammar

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                reason="grammar masks need llguidance: pip install 'tokengym[grammar]'")


def _env(grammar, budget=12, task="arithmetic"):
    return TokenVectorEnv(1, task, grammar=grammar, max_new_tokens=budget)


@pytest.mark.parametrize("grammar, budget", [
    ({"regex": "-?[0-9]+"}, 1),
    ({"regex": "(a[0-9]{5}|b[0-9])"}, 2),  # "a" and "b" lead to the same next mask; only "b" finishes in 2 tokens
    ({"regex": "x{11}"}, 11),  # exactly the budget
    ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, 7),  # {"n":0}
    ({"lark": 'start: "<" item ("," item)* ">"\nitem: /[a-z]+/'}, 3),
])
def test_a_grammar_that_can_finish_within_the_budget_passes(grammar, budget):
    check_grammar(_env(grammar, budget))


def test_the_shipped_tool_call_grammar_and_an_env_without_one_pass():
    check_grammar(TokenVectorEnv(2, "tool_call"))
    check_grammar(TokenVectorEnv(2, "arithmetic"))
    check_grammar(TokenVectorEnv(2, "tool_call", grammar=False))


@pytest.mark.parametrize("grammar, budget, message", [
    ({"regex": "x{11}"}, 10, r"reaches no accepting state \(where EOS is allowed\) within max_new_tokens=10"),
    ({"regex": "[0-9]+\u20ac"}, 12, "reaches no accepting state"),  # the euro sign: no token spells it
    ({"lark": 'start: "a" start'}, 12, r"stops the grammar engine after 'a': .*error"),  # never ends
    ({"regex": "\u20ac+"}, 12, "allows no token at the start of the answer"),
    ({"regex": "ab\u20ac"}, 12, r"reaches a dead end on every path \(after 'ab', no token"),
    ({"regex": "[0-9]+|[a-z]\u20ac"}, 12, r"can reach a dead end: after '[a-z]' no token of the tokenizer may follow"),
    ({"regex": "[0-9]{3}|[a-z]{2}\u20ac"}, 12, r"can reach a dead end: after '[a-z]{2}' no token"),  # dead before done
])
def test_a_grammar_that_cannot_finish_is_one_line_naming_what_is_wrong(grammar, budget, message):
    env = _env(grammar, budget)
    with pytest.raises(ValueError, match=message) as e:
        check_grammar(env)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"its grammar {grammar!r:.80}"), e.value


def test_a_dead_end_deeper_than_the_shortest_answer_passes_the_check_and_stops_the_episode_in_one_error():
    """The check walks no deeper than the shortest finished answer (a digit here); the env's mask then names a deeper
    dead end when a row reaches it: at a dead end llguidance still allows the specials (here <unk>), which are not a way
    on. (Before, the row sampled <unk> and llguidance's matcher failed with a dump of its state.)"""
    from tokengym.envs.masks import GrammarDeadEnd

    env = _env({"regex": "[0-9]|[a-z]{3}\u20ac"})
    check_grammar(env)
    env.reset(seed=0)
    tok = env.tokenizer
    for ch in "abc":
        env.action_masks()
        env.step(torch.tensor([tok.convert_tokens_to_ids(ch)]))
    with pytest.raises(GrammarDeadEnd, match=r"env row 0 allows no token after the prefix 'abc' \(its grammar is at a "
                                             r"dead end\)"):
        env.action_masks()

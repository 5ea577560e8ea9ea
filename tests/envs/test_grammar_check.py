"""``check_grammar``: an env's grammar walked to a finished answer before any episode (envs/grammar_check.py)."""

import importlib.util

import pytest

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
])
def test_a_grammar_that_cannot_finish_is_one_line_naming_what_is_wrong(grammar, budget, message):
    env = _env(grammar, budget)
    with pytest.raises(ValueError, match=message) as e:
        check_grammar(env)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"its grammar {grammar!r:.80}"), e.value

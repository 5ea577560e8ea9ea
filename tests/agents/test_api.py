"""Public surface of `tokengym.agents.functional`: exports, signatures, docstrings, doctests."""

import doctest
import inspect

import pytest
import torch

import tokengym.agents
from tokengym.agents import functional as fn

FUNCTIONS = {
    "gae": ["rewards", "values", "mask", "gamma", "lam", "last_values"],
    "whiten": ["x", "mask", "shift_mean"],
    "group_advantages": ["rewards", "group_size", "scale", "eps"],
    "process_advantages": ["step_rewards", "step_ends", "group_size", "seq_len", "eps"],
    "kl_penalty": ["logp", "ref_logp", "estimator"],
    "masked_aggregate": ["x", "mask", "aggregation"],
    "policy_loss": ["logp", "old_logp", "advantages", "mask", "clip_eps", "clip_eps_high", "aggregation", "weights"],
    "value_loss": ["values", "old_values", "returns", "mask", "clip_eps"],
    "dpo_loss": [
        "policy_chosen_logps",
        "policy_rejected_logps",
        "ref_chosen_logps",
        "ref_rejected_logps",
        "beta",
        "loss_type",
        "label_smoothing",
    ],
    "token_logprobs": ["logits", "labels", "chunk_size", "allowed"],
    "entropy": ["logits", "mask", "chunk_size", "allowed"],
}


def test_exports_and_signatures():
    assert tokengym.agents.functional is fn
    for name, params in FUNCTIONS.items():
        assert name in fn.__all__
        assert list(inspect.signature(getattr(fn, name)).parameters) == params, name
    for name in fn.__all__:
        assert hasattr(fn, name), name


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_docstrings_have_shapes_and_examples(name):
    doc = inspect.getdoc(getattr(fn, name))
    for section in ("Args:", "Returns:", "Example:"):
        assert section in doc, (name, section)
    assert "[B" in doc, name  # documents shapes


def test_docstring_examples_run():
    result = doctest.testmod(fn, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= len(FUNCTIONS)
    assert result.failed == 0


def test_float_and_bool_masks_agree():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    m = torch.rand(3, 5, generator=g) > 0.4
    for mask in (m.float(), m.long()):
        torch.testing.assert_close(fn.gae(x, x.flip(1), mask)[0], fn.gae(x, x.flip(1), m)[0])
        torch.testing.assert_close(fn.whiten(x, mask), fn.whiten(x, m))
        torch.testing.assert_close(fn.policy_loss(x, x.flip(1), x, mask)[0], fn.policy_loss(x, x.flip(1), x, m)[0])
        torch.testing.assert_close(fn.value_loss(x, x, x.flip(1), mask)[0], fn.value_loss(x, x, x.flip(1), m)[0])

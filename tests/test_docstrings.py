"""Every docstring example in the packages runs and prints what it says (Google-style `Example:` blocks)."""

import doctest
import importlib
import pkgutil

import pytest

import tokengym.agents
import tokengym.envs
import tokengym.rewards

SKIP = {"tokengym.agents.cli.__main__"}  # runs the command on import


def modules():
    for pkg in (tokengym.envs, tokengym.rewards, tokengym.agents):
        yield pkg.__name__
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name not in SKIP:
                yield info.name


@pytest.mark.parametrize("name", sorted(set(modules())))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"

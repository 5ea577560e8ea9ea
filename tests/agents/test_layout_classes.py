"""Class size in ``agents/algorithms/``: no class over 350 lines, so that an algorithm's skeleton stays split along
its seams (``OnPolicyAgent``: its hooks and step; the update, the rollouts and the run in modules beside it)."""

import ast
import pathlib

import pytest

ALGORITHMS = pathlib.Path(__file__).resolve().parents[2] / "agents" / "algorithms"
LIMIT = 350
PENDING = {"DPOLearner"}
"""Classes still over the limit, awaiting their own split (issue 48); each must still be over it, so that the
exemption goes once the class is split."""


def class_sizes() -> dict[str, int]:
    sizes = {}
    for path in sorted(ALGORITHMS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_the_folder_is_found():
    assert any(key.endswith(":OnPolicyAgent") for key in class_sizes())


def test_no_class_in_agents_algorithms_is_over_the_limit():
    over = {key: n for key, n in class_sizes().items() if n > LIMIT and key.split(":")[1] not in PENDING}
    assert not over, f"classes over {LIMIT} lines (split them along their seams): {over}"


@pytest.mark.parametrize("name", sorted(PENDING))
def test_each_exemption_is_still_needed(name):
    sizes = [n for key, n in class_sizes().items() if key.split(":")[1] == name]
    assert sizes and max(sizes) > LIMIT, f"{name} is within {LIMIT} lines now: drop it from PENDING"

"""Class size in ``agents/algorithms/``: no class over 350 lines, so that an algorithm's skeleton stays split along
its seams (``OnPolicyAgent``: its hooks and step; the update, the rollouts and the run in modules beside it;
``DPOLearner``: its state and loss; the reference side, the sequence log-probs and the fit loop beside it)."""

import ast
import pathlib

ALGORITHMS = pathlib.Path(__file__).resolve().parents[2] / "agents" / "algorithms"
LIMIT = 350


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
    over = {key: n for key, n in class_sizes().items() if n > LIMIT}
    assert not over, f"classes over {LIMIT} lines (split them along their seams): {over}"



def test_the_tests_mirror_the_agents_subpackages():
    """``tests/agents/<sub>/`` for each subpackage ``agents/<sub>/`` and no other folder (the pure math's tests,
    ``functional.py`` and ``variants.py``, and the house checks stay in ``tests/agents/``)."""
    tests = pathlib.Path(__file__).resolve().parent
    subpackages = {p.parent.name for p in ALGORITHMS.parent.glob("*/__init__.py")}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert subpackages == {"algorithms", "cli", "data", "engine", "runtime"}
    assert folders == subpackages, f"test folders {sorted(folders)} vs subpackages {sorted(subpackages)}"
    assert all(any((tests / sub).glob("test_*.py")) for sub in subpackages)

"""The envs package stays in classes one can read whole: none over 350 lines (``TokenVectorEnv`` was once 690, and
its parts now live in their own modules; a class that grows past the limit is split along its seams, not waved
through)."""

import ast
from pathlib import Path

import tokengym.envs

MAX_CLASS_LINES = 350
ENVS = Path(tokengym.envs.__file__).parent


def test_no_class_in_envs_is_over_the_limit():
    sizes = {
        f"{path.relative_to(ENVS)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in sorted(ENVS.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
    }
    assert sizes, f"no classes found under {ENVS}"
    too_long = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines in envs/: {too_long}"

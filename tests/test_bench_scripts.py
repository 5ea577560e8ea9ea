"""The bench scripts cannot rot unseen: each one imports, does no work on import, and every tokengym name it imports
(at the top or lazily inside a function, where importing the script would never reach it) still exists.

A script that imports an optional package (trl, vllm, datasets, ...) at the top is skipped, with that package named,
where the package is not installed; a missing ``tokengym`` module or name always fails. Nothing here runs a bench.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
LOCAL = {p.stem for p in SCRIPTS}
ALLOWED_TOP_CALLS = ("sys.path.insert(", "os.environ.setdefault(")
"""Module-level calls a script may make on import: finding its sibling helpers, quieting libraries' progress bars."""


def imported_names(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` of every import in ``tree``, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.module, a.name, node.lineno) for a in node.names]
    return out


def resolve(module: str, name: str | None) -> str | None:
    """None if ``from module import name`` (or ``import module``) works, else why not."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        return f"no module {e.name!r}"
    if name is None or hasattr(mod, name):
        return None
    try:  # a submodule not yet imported
        importlib.import_module(f"{module}.{name}")
        return None
    except ModuleNotFoundError:
        return f"{module} has no {name!r}"


@pytest.fixture
def bench_path():
    """``bench/`` first on ``sys.path``, as a script run as ``python bench/x.py`` has it; its modules forgotten after."""
    before, loaded = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(BENCH))
    yield
    sys.path[:] = before
    for name in set(sys.modules) - loaded:
        if name in LOCAL or name.startswith("bench_script_"):
            del sys.modules[name]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_tokengym_names_a_script_imports_exist(path, bench_path):
    """Every ``tokengym`` import and every import of a sibling bench module, lazy ones included, resolves."""
    missing = []
    for module, name, line in imported_names(ast.parse(path.read_text())):
        if module.split(".")[0] == "tokengym" or module in LOCAL:
            why = resolve(module, name)
            if why is not None:
                missing.append(f"line {line}: {why}")
    assert not missing, f"{path.name} imports what is gone: {missing}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_does_no_work_on_import(path):
    """At module level a script defines, imports and sets constants; its work runs under ``__main__``."""
    calls = [f"line {s.lineno}: {ast.unparse(s)[:60]}" for s in ast.parse(path.read_text()).body
             if (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                 and not ast.unparse(s).startswith(ALLOWED_TOP_CALLS))
             or isinstance(s, (ast.For, ast.While, ast.With))]
    assert not calls, f"{path.name} works at import time (move it under if __name__ == '__main__'): {calls}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_imports(path, bench_path):
    """Importing the script (as another module name, so its ``__main__`` block stays shut) works and prints nothing."""
    spec = importlib.util.spec_from_file_location(f"bench_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top == "tokengym" or top in LOCAL or not top:
            raise
        pytest.skip(f"{path.name} needs the optional package {top!r}, not installed here")
    assert out.getvalue() == "", f"{path.name} printed on import: {out.getvalue()[:200]!r}"
    if "__main__" in path.read_text():  # a script, not a helper module (_measure, longtail)
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"

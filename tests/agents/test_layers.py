"""The package's layers: imports go down only (cli -> algorithms -> data -> engine -> runtime -> pure math), no module
is in an import cycle, no module imports another's private name, and the bundled benches import helpers, never each
other in a cycle.

Every ``import`` statement of every module is read, ``__init__.py`` files too (lazy ones inside functions count: a
lazy import upward is still a dependency upward). The checker is ``tests/import_graph.py``; the tests below also show
it catching each kind of violation injected into the sources. Then, at run time: importing the engine (what a rollout
worker runs) or the ``tokengym.agents`` facade loads no training algorithm.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "agents"

_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tests" / "import_graph.py")
G = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("import_graph", G)  # (its dataclasses look their module up)
_spec.loader.exec_module(G)

RANK = {"cli": 5, "algorithms": 4, "data": 3, "engine": 2, "runtime": 1, "functional": 0, "variants": 0,
        "shared_math": 0, "__init__": 0}
"""Layer of each subpackage / top-level module of ``tokengym.agents``; a module imports only lower or equal ones.
The package's own ``__init__`` (the facade every module's import runs first) is at the bottom: it imports its exports
on first use, never eagerly."""


@pytest.fixture(scope="module")
def sources():
    return G.read_tree(ROOT)


def check(sources) -> list[str]:
    """Every violation of every kind in ``sources``."""
    graph = G.build(sources)
    return (G.upward_imports(graph, RANK) + G.cross_package_imports(graph) + G.import_cycles(graph)
            + G.private_imports(graph))


def inject(sources, module: str, line: str):
    """A copy of ``sources`` with ``line`` appended to ``module``'s text."""
    src = sources[module]
    return {**sources, module: G.Source(src.text + "\n" + line + "\n", src.is_package, src.path)}


def test_every_agents_module_sits_in_a_layer():
    loose = sorted(p.name for p in AGENTS.glob("*.py") if p.stem not in RANK)
    loose += sorted(p.name for p in AGENTS.iterdir() if (p / "__init__.py").exists() and p.name not in RANK)
    assert not loose, f"modules outside the layers: {loose}"


def test_imports_go_down_only(sources):
    bad = G.upward_imports(G.build(sources), RANK)
    assert not bad, "\n".join(bad)


def test_envs_and_rewards_never_import_agents(sources):
    bad = G.cross_package_imports(G.build(sources))
    assert not bad, "\n".join(bad)


def test_no_import_cycle(sources):
    bad = G.import_cycles(G.build(sources))
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_name(sources):
    bad = G.private_imports(G.build(sources))
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------- the checker catches
@pytest.mark.parametrize("module, line, expected", [
    ("tokengym.agents.engine", "from tokengym.agents.algorithms.grpo import GRPOAgent",
     "(engine) imports tokengym.agents.algorithms.grpo (algorithms), a higher layer"),
    ("tokengym.agents", "from .algorithms import grpo",
     "(__init__) imports tokengym.agents.algorithms.grpo (algorithms), a higher layer"),
    ("tokengym.agents.runtime.runs", "def f():\n    from ..engine import policy",
     "(runtime) imports tokengym.agents.engine.policy (engine), a higher layer"),
    ("tokengym.agents.engine.rollout", "from tokengym.agents import Policy",
     " imports Policy from the tokengym.agents facade"),
    ("tokengym.rewards", "from tokengym.envs import Task", " imports tokengym.envs"),
])
def test_the_checker_reports_an_upward_import(sources, module, line, expected):
    clean = check(sources)
    assert not clean, clean
    bad = check(inject(sources, module, line))
    assert any(b.startswith(module + ":") and b.endswith(expected) for b in bad), bad


def test_the_checker_reports_a_cycle_with_its_path(sources):
    lazy = "def f():\n    from tokengym.agents.engine import rollout"  # lazy, inside a function: still an edge
    bad = G.import_cycles(G.build(inject(sources, "tokengym.agents.engine.replay", lazy)))
    assert len(bad) == 1 and bad[0].startswith("import cycle: tokengym.agents.engine.replay:"), bad
    assert "tokengym.agents.engine.rollout:" in bad[0] and bad[0].endswith("-> tokengym.agents.engine.replay"), bad
    cycle = G.import_cycles(G.build(inject(sources, "tokengym.agents.engine", "from . import policy")))
    assert not cycle  # a package importing its own module is no cycle (nothing imports the package back)


@pytest.mark.parametrize("module, line, where, expected", [
    ("tokengym.agents.variants", "from .functional import _safe_div",
     "tokengym.agents.variants:", "imports tokengym.agents.functional._safe_div"),
    ("tokengym.envs.tasks", "from .arithmetic import _OPERATORS", "tokengym.envs.tasks:",
     "imports tokengym.envs.tasks.arithmetic._OPERATORS"),
    ("tokengym.agents.engine.policy", "Fn._safe_div", "tokengym.agents.engine.policy:",
     "uses tokengym.agents.functional._safe_div"),
])
def test_the_checker_reports_a_private_import(sources, module, line, where, expected):
    bad = G.private_imports(G.build(inject(sources, module, line)))
    assert any(b.startswith(where) and b.endswith(expected) for b in bad), bad


def test_the_checker_reports_a_private_module(sources):
    extra = {**sources, "tokengym.agents._maths": G.Source("X = 1\n")}
    bad = G.private_imports(G.build(inject(extra, "tokengym.agents.variants", "from . import _maths")))
    assert len(bad) == 1 and bad[0].endswith(" imports the private module tokengym.agents._maths"), bad


# ---------------------------------------------------------------------------------------------- at run time
ENGINE = sorted(name for name in G.read_tree(ROOT) if G.agents_layer(name) in ("engine", "runtime", "functional",
                                                                              "variants", "shared_math"))
ABOVE_ENGINE = ("tokengym.agents.algorithms", "tokengym.agents.cli", "tokengym.agents.data")


def _loaded(code: str) -> list[str]:
    """The ``tokengym.agents`` modules above the engine that ``code`` leaves loaded in a fresh interpreter."""
    probe = (f"{code}\nimport sys\n"
             f"print([m for m in sorted(sys.modules) if m.startswith({ABOVE_ENGINE!r})])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_facade_loads_no_algorithm_until_a_name_is_used():
    code = ("import sys, tokengym.agents\n"
            "assert [m for m in sys.modules if m.startswith('tokengym.agents.')] == [], sorted(sys.modules)\n"
            "from tokengym.agents import Policy, functional\n")
    assert _loaded(code) == []
    later = "import tokengym.agents\nassert tokengym.agents.GRPOAgent.__name__ == 'GRPOAgent'\n"
    assert "tokengym.agents.algorithms.grpo" in _loaded(later)


def test_the_engine_and_the_worker_entry_load_no_layer_above_the_engine():
    """Every module of the engine, runtime and the math in one interpreter (what loads with all of them loads with
    each): a rollout worker (``engine.workers._worker_main``, ``engine.remote.WorkerServer``) needs nothing above."""
    assert "tokengym.agents.engine.workers" in ENGINE and "tokengym.agents.engine.worker_loop" in ENGINE
    assert _loaded("\n".join(f"import {m}" for m in ENGINE)) == []


# ---------------------------------------------------------------------------------------------- bench scripts
def test_bench_scripts_import_no_cycle():
    """Bench scripts import shared helpers (``_measure``, ``_isolate``) and each other one way only."""
    bench = ROOT / "bench"
    names = {p.stem for p in bench.glob("*.py")}
    graph = {}
    for p in bench.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in names:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in names}
        graph[p.stem] = deps

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph[start])

    cycles = sorted(n for n in graph if reaches(n, n, {n}))
    assert not cycles, f"bench modules in an import cycle: {cycles}"

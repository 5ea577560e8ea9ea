"""The package's layers: imports go down only (cli -> algorithms -> data -> engine -> runtime -> pure math), and
the bundled benches import helpers, never each other in a cycle.

Every ``import`` statement of every module is read (lazy ones inside functions too): a lazy import upward is still
a dependency upward.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "agents"
RANK = {"cli": 5, "algorithms": 4, "data": 3, "engine": 2, "runtime": 1, "functional": 0, "variants": 0, "shared_math": 0}
"""Layer of each subpackage / top-level module of ``tokengym.agents``; a module imports only lower or equal ones."""


def _imports(path: Path) -> set[str]:
    """Dotted names of the ``tokengym.*`` modules ``path`` imports (``from tokengym.agents import functional`` is
    the module ``tokengym.agents.functional``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tokengym")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokengym") and node.level == 0:
            if node.module == "tokengym.agents":
                out |= {f"tokengym.agents.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out


def _layer(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["tokengym", "agents"] and parts[2] in RANK else None


def test_every_agents_module_sits_in_a_layer():
    loose = sorted(p.name for p in AGENTS.glob("*.py") if p.stem not in RANK and p.name != "__init__.py")
    assert not loose, f"modules outside the layers: {loose}"


def test_imports_go_down_only():
    bad = []
    for path in sorted(AGENTS.rglob("*.py")):
        rel = path.relative_to(AGENTS)
        if rel == Path("__init__.py"):
            continue  # the public facade re-exports every layer
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for dotted in _imports(path):
            layer = _layer(dotted)
            if dotted == "tokengym.agents" or (layer is not None and RANK[layer] > RANK[own]):
                bad.append(f"{rel} ({own}) imports {dotted}")
    assert not bad, "\n".join(bad)


def test_envs_and_rewards_never_import_agents():
    bad = [f"{p.relative_to(ROOT)} imports {d}" for pkg in ("envs", "rewards") for p in (ROOT / pkg).rglob("*.py")
           for d in _imports(p) if d.startswith("tokengym.agents")]
    bad += [f"{p.relative_to(ROOT)} imports {d}" for p in (ROOT / "rewards").rglob("*.py")
            for d in _imports(p) if d.startswith("tokengym.envs")]
    assert not bad, "\n".join(bad)


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

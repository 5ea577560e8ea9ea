"""The import graph of the tokengym packages, read from their source (a test helper, not a test module).

:func:`read_tree` reads every module (``__init__.py`` files too) into ``{dotted name: Source}``; a test may change a
module's text in that dict before :func:`build` turns it into a :class:`Graph`, so a checker can be shown to catch what
it checks. Every ``import`` statement counts, at module level or inside a function (a lazy import is still a
dependency), relative ones resolved. The checks return one line per violation (empty: none):

* :func:`upward_imports`: an ``agents`` module importing a higher layer, or the ``tokengym.agents`` facade;
* :func:`cross_package_imports`: ``envs`` or ``rewards`` importing ``agents``, ``rewards`` importing ``envs``;
* :func:`import_cycles`: each strongly connected component of the graph, shown as one of its cycles;
* :func:`private_imports`: an import of another module's private name (``from m import _x``, ``import m._x``, or
  ``m._x`` on a module bound by an import).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = {"envs": "tokengym.envs", "rewards": "tokengym.rewards", "agents": "tokengym.agents"}
"""Source folder -> the package it is (``tokengym`` is a namespace mapped by pyproject)."""


@dataclass
class Source:
    """One module's text; ``is_package``: it is an ``__init__.py`` (its relative imports start at itself)."""

    text: str
    is_package: bool = False
    path: str = ""


@dataclass(frozen=True)
class Import:
    """``importer`` imports the module ``target`` (line ``line``); ``name``: the name taken from it, when that name is
    not itself a module (``from m import f``); ``lazy``: the statement is inside a function."""

    importer: str
    target: str
    line: int
    name: str | None = None
    lazy: bool = False


@dataclass
class Graph:
    """The tokengym modules and their imports of one another."""

    modules: dict[str, Source]
    imports: list[Import] = field(default_factory=list)
    private_uses: list[str] = field(default_factory=list)
    """``module:line uses other._x`` for a private attribute read on a module bound by an import."""

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            if imp.target != imp.importer:
                out[imp.importer].add(imp.target)
        return out

    def where(self, importer: str, target: str) -> int:
        """The first line of ``importer`` that imports ``target``."""
        return min(i.line for i in self.imports if i.importer == importer and i.target == target)


def read_tree(root: Path) -> dict[str, Source]:
    """Every module of the packages under ``root`` (the repository) by dotted name."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            out[name] = Source(path.read_text(), is_package, str(path.relative_to(root)))
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(importer: str, src: Source, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    base = importer.split(".") if src.is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Reader(ast.NodeVisitor):
    def __init__(self, graph: Graph, importer: str, src: Source):
        self.graph, self.importer, self.src, self.depth = graph, importer, src, 0
        self.aliases: dict[str, str] = {}  # local name -> the tokengym module an import bound it to

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, target: str, line: int, name: str | None = None) -> None:
        self.graph.imports.append(Import(self.importer, target, line, name, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name in self.graph.modules:
                self._add(a.name, node.lineno)
                if a.asname:
                    self.aliases[a.asname] = a.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve(self.importer, self.src, node)
        if module not in self.graph.modules:
            return
        for a in node.names:
            sub = f"{module}.{a.name}"
            if sub in self.graph.modules:
                self._add(sub, node.lineno)
                self.aliases[a.asname or a.name] = sub
            else:
                self._add(module, node.lineno, a.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases and _is_private(node.attr):
            self.graph.private_uses.append(f"{self.importer}:{node.lineno} uses {self.aliases[node.value.id]}.{node.attr}")
        self.generic_visit(node)


def build(sources: dict[str, Source]) -> Graph:
    """The graph of ``sources`` (:func:`read_tree`'s dict, possibly edited)."""
    graph = Graph(dict(sources))
    for name, src in sources.items():
        _Reader(graph, name, src).visit(ast.parse(src.text, filename=src.path or name))
    return graph


# ---------------------------------------------------------------------------------------------- the checks
def agents_layer(module: str) -> str | None:
    """The layer an ``agents`` module belongs to: its subpackage, or its own name for a top-level module
    (``__init__`` for the package itself); ``None`` outside ``tokengym.agents``."""
    parts = module.split(".")
    if parts[:2] != ["tokengym", "agents"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def upward_imports(graph: Graph, rank: dict[str, int]) -> list[str]:
    """Imports inside ``tokengym.agents`` that go up (to a layer of a higher ``rank``), to a module outside every
    layer, or to a name of the ``tokengym.agents`` facade (a module imports a name from where it is defined)."""
    bad = []
    for imp in graph.imports:
        own, theirs = agents_layer(imp.importer), agents_layer(imp.target)
        if own is None or theirs is None:
            continue
        at = f"{imp.importer}:{imp.line}"
        if own not in rank:
            bad.append(f"{at}: {own} sits in no layer")
        elif imp.target == "tokengym.agents" and imp.name is not None:
            bad.append(f"{at} imports {imp.name} from the tokengym.agents facade")
        elif theirs not in rank:
            bad.append(f"{at} imports {imp.target}, which sits in no layer")
        elif rank[theirs] > rank[own]:
            bad.append(f"{at} ({own}) imports {imp.target} ({theirs}), a higher layer")
    return sorted(set(bad))


def cross_package_imports(graph: Graph) -> list[str]:
    """``envs`` and ``rewards`` never import ``agents``; ``rewards`` never imports ``envs``."""
    order = {"tokengym.rewards": 0, "tokengym.envs": 1, "tokengym.agents": 2}

    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    return sorted({f"{i.importer}:{i.line} imports {i.target}" for i in graph.imports
                   if order[package(i.target)] > order[package(i.importer)]})


def import_cycles(graph: Graph) -> list[str]:
    """One line per strongly connected component of more than one module: a cycle through it, with the line of each
    import (module-level and lazy imports alike)."""
    edges = graph.edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm (the graph is a hundred modules: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_show_cycle(graph, edges, comp) for comp in components]


def _show_cycle(graph: Graph, edges: dict[str, set[str]], comp: list[str]) -> str:
    """A shortest cycle through ``comp[0]`` inside the component, as ``a:line -> b:line -> a`` (each module with the
    line of its import of the next), then the component's other modules."""
    start, inside = comp[0], set(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & inside):
                if w == start:
                    path = paths[v] + [start]
                    hops = [f"{a}:{graph.where(a, b)}" for a, b in zip(path, path[1:])]
                    rest = sorted(inside - set(path))
                    return "import cycle: " + " -> ".join(hops + [start]) + (f" (with {', '.join(rest)})" if rest else "")
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return f"import cycle among {comp}"


def private_imports(graph: Graph) -> list[str]:
    """Imports of another module's private name (one starting with ``_``, dunders aside): ``from m import _x``,
    ``import m._x`` / ``from m import _x`` of a private module, and ``m._x`` read on a module bound by an import."""
    bad = [f"{i.importer}:{i.line} imports {i.target}.{i.name}" for i in graph.imports
           if i.name is not None and _is_private(i.name) and i.target != i.importer]
    bad += [f"{i.importer}:{i.line} imports the private module {i.target}" for i in graph.imports
            if i.target != i.importer and any(_is_private(p) for p in i.target.split("."))]
    return sorted(set(bad + graph.private_uses))

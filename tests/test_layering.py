"""Layering of track_1_short, read from the source: every module's AST is walked for `import` and
`from ... import` (inside functions and under `if TYPE_CHECKING:` too), and three rules are checked
(DESIGN.md section 1):

- no import cycle among the package's modules (TYPE_CHECKING-only imports are not edges here: they
  never run);
- `model/` imports only `model/`, the standard library and torch (TYPE_CHECKING imports count: a
  type from above the model is still a dependency on it);
- config modules (`config.py`, every `*_config.py`, `schedule.py`, the constants modules
  `constants.py` and `model/tokens.py`) import no runtime module of the package, only each other;
  the constants modules import nothing at all.

The checker is run on the real package and on small synthetic packages written to tmp_path, one
with every kind of violation planted (each must be reported) and one without (none may be). Last,
the names the step-graph seed imports must still resolve (thin re-exports where code moved).
Hardware: CPU only, < 5 s (only the last test imports the package).
Run: `.venv/bin/python -m pytest tests/test_layering.py -q`.
"""

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "track_1_short"
CONSTANTS = ("constants", "model.tokens")  # import nothing
CONFIG_MODULES = ("config", "schedule", *CONSTANTS)  # plus every *_config module
MODEL = "model"
MODEL_EXTERNAL = {"torch"}  # besides the standard library


@dataclass(frozen=True, slots=True)
class Edge:
    source: str  # importing module (dotted)
    target: str  # imported module (dotted): a package module, or an external top-level name
    line: int
    type_checking: bool  # only under `if TYPE_CHECKING:` (never runs)
    internal: bool  # target is a module of the package


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of `package` under `root` (packages by __init__.py)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False):
    """(node, under TYPE_CHECKING) for every Import/ImportFrom, at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_checking)
        else:
            yield from _imports(node, type_checking)


def _resolve(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `name`)."""
    if not node.level:
        return node.module
    base = name.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(root: Path, package: str) -> list[Edge]:
    modules = _modules(root, package)
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, tc in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, is_package, node)
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in dict.fromkeys(targets):
                internal = target == package or target.startswith(package + ".")
                edges.append(Edge(name, target if internal else target.split(".")[0], node.lineno,
                                  tc, internal))
    return edges


def _find_cycles(edges: list[Edge]) -> list[list[str]]:
    """One cycle (as a closed path of modules) per strongly connected component that has one."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.internal and not e.type_checking:
            graph.setdefault(e.source, set()).add(e.target)
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(_cycle_path(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def _cycle_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A closed path inside one strongly connected component, from its smallest module."""
    start = min(component)
    path, seen, v = [start], {start}, start
    while True:
        v = min(w for w in graph[v] if w in component)
        path.append(v)
        if v in seen:
            return path[path.index(v):]
        seen.add(v)


def _is_config(name: str, package: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.endswith("_config") or name in {f"{package}.{m}" for m in CONFIG_MODULES}


def check_layering(root: Path, package: str) -> list[str]:
    """Every violation of the three rules, one message each (empty: the layering holds)."""
    edges = import_edges(root, package)
    problems = [f"import cycle: {' -> '.join(cycle)}" for cycle in _find_cycles(edges)]
    model, constants = f"{package}.{MODEL}", {f"{package}.{c}" for c in CONSTANTS}
    for e in edges:
        where = f"{e.source} line {e.line} imports {e.target}"
        if e.source == model or e.source.startswith(model + "."):
            inside = e.target == model or e.target.startswith(model + ".")
            if e.internal and not inside:
                problems.append(f"model/ imports outside model/: {where}")
            if not e.internal and e.target not in MODEL_EXTERNAL | sys.stdlib_module_names:
                problems.append(f"model/ imports a third-party module: {where}")
        if e.source in constants:
            problems.append(f"the constants module imports something: {where}")
        if _is_config(e.source, package) and e.internal and not _is_config(e.target, package):
            problems.append(f"config module imports a runtime module: {where}")
    return problems


def test_package_layering():
    problems = check_layering(REPO, PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_walk_sees_the_package():
    """Guards against a checker that passes because it reads nothing."""
    edges = import_edges(REPO, PACKAGE)
    pairs = {(e.source, e.target) for e in edges if e.internal}
    assert ("track_1_short.model.gpt", "track_1_short.model.ngram_lookup") in pairs
    assert ("track_1_short.config", "track_1_short.model.gpt_config") in pairs
    assert any(e.type_checking for e in edges)
    assert any(e.source == "track_1_short.trainer.build" and not e.internal and e.target == "torch"
               for e in edges)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN = {
    "pkg/__init__.py": "",
    "pkg/constants.py": "BOS = 1\n",
    "pkg/config.py": "from pkg.model.net_config import NetConfig\nfrom pkg import schedule\n",
    "pkg/schedule.py": "from pkg.constants import BOS\n",
    "pkg/model/__init__.py": "",
    "pkg/model/tokens.py": "BOS = 1\n",
    "pkg/model/net_config.py": "import dataclasses\nimport torch\nfrom pkg.model.tokens import BOS\n",
    "pkg/model/net.py": "import math\nimport torch\nfrom . import net_config\n"
                        "from .net_config import NetConfig\n",
    "pkg/runtime.py": "from pkg.model.net import *\nfrom pkg.config import *\n",
    # a cycle only through TYPE_CHECKING is no cycle
    "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
    "pkg/b.py": "import pkg.a\n",
}


def test_checker_passes_a_clean_package(tmp_path):
    _write(tmp_path, CLEAN)
    assert check_layering(tmp_path, "pkg") == []


def test_checker_catches_planted_violations(tmp_path):
    _write(tmp_path, {
        **CLEAN,
        # cycle through an import inside a function: x -> y -> x
        "pkg/x.py": "import pkg.y\n",
        "pkg/y.py": "def f():\n    from pkg import x\n    return x\n",
        # model/ importing the systems layer, at module level and under TYPE_CHECKING
        "pkg/model/net.py": "import torch\nfrom pkg.runtime import helper\n",
        "pkg/model/typed.py": "import typing\nif typing.TYPE_CHECKING:\n"
                              "    from pkg.runtime import Store\n",
        # model/ importing a third-party library, relative import climbing out of model/
        "pkg/model/third.py": "import numpy\nfrom ..runtime import helper\n",
        # config modules importing runtime modules
        "pkg/config.py": "from pkg.runtime import Store\n",
        "pkg/model/net_config.py": "from pkg.model.net import Net\n",
        "pkg/constants.py": "import os\n",
        # model/ importing the systems constants module (outside model/)
        "pkg/model/uses_constants.py": "from pkg.constants import BOS\n",
    })
    problems = "\n".join(check_layering(tmp_path, "pkg"))
    expected = [
        "import cycle: pkg.x -> pkg.y -> pkg.x",
        "model/ imports outside model/: pkg.model.net line 2 imports pkg.runtime",
        "model/ imports outside model/: pkg.model.typed line 3 imports pkg.runtime",
        "model/ imports a third-party module: pkg.model.third line 1 imports numpy",
        "model/ imports outside model/: pkg.model.third line 2 imports pkg.runtime",
        "config module imports a runtime module: pkg.config line 1 imports pkg.runtime",
        "config module imports a runtime module: pkg.model.net_config line 1 imports pkg.model.net",
        "the constants module imports something: pkg.constants line 1 imports os",
        "model/ imports outside model/: pkg.model.uses_constants line 1 imports pkg.constants",
    ]
    missing = [e for e in expected if e not in problems]
    assert not missing, f"not reported: {missing}\nreported:\n{problems}"
    assert "pkg.a" not in problems, "a TYPE_CHECKING-only cycle was reported"


# The names shared/reference/step_graphs_seed.py imports: its contract (DESIGN.md section 1).
SEED_IMPORTS = {
    "track_1_short.data": ("Batch",),
    "track_1_short.model.gpt": ("ForwardScheduleConfig",),
    "track_1_short.ngram_table": ("MAX_CYCLE_STEPS", "NGRAM_DIM", "NgramTable"),
    "track_1_short.optim.anvil": ("AnvilAndAdam",),
    "track_1_short.perf.cuda_graphs.capture_plan": ("StepGraphKey",),
    "track_1_short.perf.cuda_graphs.capture_support": ("WARM_ITERATIONS",),
    "track_1_short.perf.value_embed_pull": ("ValueEmbedPull",),
}


def test_seed_names_stay_importable():
    import importlib

    missing = [f"{module}.{name}" for module, names in SEED_IMPORTS.items()
               for name in names if not hasattr(importlib.import_module(module), name)]
    assert not missing, f"the seed's imports no longer resolve: {missing}"
    from track_1_short.ngram_table import NgramConfig, NgramTable

    table = NgramTable(NgramConfig(dim=8, bigram_rows=16, trigram_rows=16, cache_rows=8))
    sink = table.grad_sink(4)  # the seed's use: grad_sink(T), then sinks read live
    assert table.sinks == {4: sink} and sink.shape == (8, 8)


def test_readme_package_map_matches_the_tree():
    """Every module of the package has a line in README.md's package map, and every line there
    names a module that exists (kept true by this test, not by hand)."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Package map", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^  ([a-z0-9_/]+\.py)\b", block, re.M))
    tree = {str(p.relative_to(REPO / PACKAGE)) for p in (REPO / PACKAGE).rglob("*.py")
            if p.name != "__init__.py"}
    assert tree - listed == set(), f"modules missing from the README package map: {sorted(tree - listed)}"
    assert listed - tree == set(), f"README package map lines without a module: {sorted(listed - tree)}"

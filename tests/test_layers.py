"""Imports run one way: core (pure) <- engine (torch) <- actors (trio) <- control <- http <- cli.

The import graph is read from the source with ``ast`` (no spark module is imported):
``import spark.x``, ``from spark.x import y`` and relative imports, at any depth (an
import inside a function counts: a function-level import that climbs a layer is the
code telling us it sits in the wrong place). Imports built from strings at run time
(``importlib.import_module(f"...")``) are not seen.

Every top-level module or package of ``spark/`` has one place in ``LAYER_OF``: a new
one fails ``test_every_module_has_a_layer`` until it is placed on purpose.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import attrs

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPARK = ROOT / "spark"

LAYERS = ("core", "engine", "actors", "control", "http", "cli")  # lowest first

# Top-level name under spark/ -> layer. A module may import its own layer and the ones below.
LAYER_OF = {
    "": "core",  # spark/__init__.py: empty; every module is inside it
    "core": "core",  # plans, pages, policies, the step loop: no torch, no trio
    "parsers": "core",  # tool-call and reasoning parsers: text in, events out, stdlib only
    "engine": "engine",  # tokenizer, model, kernels, weights: torch
    "serve_config": "engine",  # what `spark serve` is configured with; read by actors, control, http
    "recipes": "engine",  # serving profiles -> ServeConfig; reads engine.config / weights, read by control, http
    "actors": "actors",  # trio actors around the engine
    "metrics": "actors",  # Prometheus metrics of one actor system
    "gc_tuning": "actors",  # the collector of a serving process (the engine process, the HTTP server)
    "control": "control",  # the slot: loads, switches and proxies recipes
    "state": "control",  # stored responses and conversations (trio), a service the HTTP app holds
    "http": "http",  # the API
    "cli": "cli",  # the `spark` command
    "chat": "cli",  # `spark chat`
    "cli_inference": "cli",  # `spark inference ...`, `spark recipe ...`
}

# Must import with these unimportable (the core layer's promise).
HEAVY = ("torch", "trio", "triton", "numpy")


@attrs.frozen
class Import:
    source: str  # the importing module, "spark.x.y"
    target: str  # the module whose code the statement runs
    line: int
    text: str  # the statement as written
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs
    named: bool  # False: a package that importing `target`'s submodule runs on the way


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SPARK.rglob("*.py"))}


def layer_key(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(nodes, type_checking: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, True)
            yield from _statements(node.orelse, type_checking)
        else:
            yield from _statements(ast.iter_child_nodes(node), type_checking)


def _targets(source: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The spark modules a statement names ("spark.x" for `from spark import x` when x is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "spark"]
    if node.level:
        package = source.split(".") if MODULES[source].name == "__init__.py" else source.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "spark":
        return []
    names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return names if len(names) == len(node.names) else [base, *names]


def imports(source: str) -> list[Import]:
    """What ``source`` imports from spark, including the packages an import runs on the way
    (``spark.http.errors`` runs ``spark/http/__init__.py``), except its own enclosing packages,
    which are already running when it runs."""
    tree = ast.parse(MODULES[source].read_text(), str(MODULES[source]))
    out = []
    for node, type_checking in _statements([tree]):
        text = ast.unparse(node)
        for target in _targets(source, node):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                runs = ".".join(parts[:i])
                if runs != source and not source.startswith(runs + "."):
                    out.append(Import(source, runs, node.lineno, text, type_checking, named=runs == target))
    return out


GRAPH = {m: imports(m) for m in MODULES}


def where(imp: Import) -> str:
    return f"spark/{MODULES[imp.source].relative_to(SPARK)}:{imp.line}: `{imp.text}`"


def test_every_module_has_a_layer():
    unplaced = sorted({layer_key(m) for m in MODULES} - set(LAYER_OF))
    stale = sorted(set(LAYER_OF) - {layer_key(m) for m in MODULES})
    assert not unplaced, f"spark.{unplaced[0]} has no layer: give it one in LAYER_OF (unplaced: {unplaced})"
    assert not stale, f"LAYER_OF names what spark/ no longer has: {stale}"
    assert set(LAYER_OF.values()) <= set(LAYERS)


def test_imports_go_down_the_layers():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    problems = []
    for module, edges in GRAPH.items():
        for imp in (e for e in edges if e.named):  # a package run on the way is in its submodule's layer
            if imp.target not in MODULES:
                problems.append(f"{where(imp)} names {imp.target}, which spark/ does not have")
                continue
            low, high = LAYER_OF.get(layer_key(module)), LAYER_OF.get(layer_key(imp.target))
            if low and high and rank[high] > rank[low]:
                problems.append(f"{where(imp)}: {module} ({low}) imports up into {imp.target} ({high})")
    assert not problems, f"{len(problems)} imports against the layers ({' <- '.join(LAYERS)}):\n" + "\n".join(problems)


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Tarjan: the strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in {e.target for e in graph[v]}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def one_cycle(graph: dict[str, list[Import]], component: list[str]) -> list[Import]:
    """A shortest way round the component from its first module back to it."""
    start, inside = component[0], set(component)
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for imp in graph[v]:
                if imp.target == start:
                    return paths[v] + [imp]
                if imp.target in inside and imp.target not in paths:
                    paths[imp.target] = paths[v] + [imp]
                    nxt.append(imp.target)
        frontier = nxt
    raise AssertionError(component)


def test_cycles_are_found():
    edge = Import("a", "b", 1, "import b", False, True)
    back = attrs.evolve(edge, source="b", target="a", text="import a")
    graph = {"a": [edge], "b": [back], "c": [attrs.evolve(edge, source="c")]}
    assert cycles(graph) == [["a", "b"]] and one_cycle(graph, ["a", "b"]) == [edge, back]


def test_no_import_cycles():
    # `if TYPE_CHECKING:` imports never run, so they cannot close a cycle; they still count for layers.
    runtime = {m: [e for e in edges if not e.type_checking and e.target in MODULES] for m, edges in GRAPH.items()}
    found = cycles(runtime)
    report = []
    for component in found:
        report.append(f"cycle among {', '.join(component)}:")
        report += [f"  {where(imp)}  ({imp.source} -> {imp.target}{'' if imp.named else ', run on the way'})"
                   for imp in one_cycle(runtime, component)]
    assert not found, f"{len(found)} import cycles inside spark/:\n" + "\n".join(report)


_BLOCKED_IMPORT = f"""
import importlib, sys
heavy = {HEAVY!r}
loaded = [m for m in sys.modules if m.split(".")[0] in heavy]
assert not loaded, f"already imported at start-up: {{loaded}}"

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in heavy:
            raise ImportError(f"{{name}} is made unimportable here")

sys.meta_path.insert(0, Block())
for name in heavy:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the block let {{name}} through")
failed = []
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except Exception as exc:
        failed.append(f"{{module}}: {{type(exc).__name__}}: {{exc}}")
print("\\n".join(failed))
raise SystemExit(1 if failed else 0)
"""


def test_the_core_layer_imports_without_torch_trio_triton_numpy():
    core = [m for m in MODULES if LAYER_OF.get(layer_key(m)) == "core"]
    assert "spark.core" in core and len([m for m in core if m.startswith("spark.core.")]) > 0
    done = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT, *core], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"the core layer needs {'/'.join(HEAVY)}:\n{done.stdout}{done.stderr}"

"""The tree shows the architecture: every package imports only the layers below it, and no module
imports itself back through others, not even from inside a function."""

import ast
import pathlib

import networkx as nx

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardplan"

LAYERS = (
    "errors",
    "common",
    "models",
    "frontend.chain",  # the plain data the front end hands on: below the plan that names its blocks
    "plan",
    "plan_changes",
    "frontend",
    "costmodel",
    "solver",
    "compile",
    "runtime",
    "calibration",
    "integrations",
    "cli",
    "",  # the package's __init__: the public API
)
"""Lowest first: a module may import from its own layer and the layers before it."""


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module → the shardplan modules it imports anywhere in its body, imports made only for the type
    checker (under `if TYPE_CHECKING:`) aside."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        tree = ast.parse(path.read_text())
        typing_only = {
            id(node)
            for branch in ast.walk(tree)
            if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
            for statement in branch.body
            for node in ast.walk(statement)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardplan"):
                submodules = [f"{node.module}.{a.name}" for a in node.names]
                found = [m for m in submodules if m in modules]
                targets = found + ([node.module] if len(found) < len(submodules) else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("shardplan")]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific layer holding `module`; a module in none is a KeyError."""
    inside = module.removeprefix("shardplan").removeprefix(".")
    if not inside:
        return len(LAYERS) - 1
    holding = [
        layer for layer in LAYERS if layer and (inside == layer or inside.startswith(layer + "."))
    ]
    if not holding:
        raise KeyError(f"{module} is in no layer: add its package to LAYERS")
    return LAYERS.index(max(holding, key=len))


def test_no_module_imports_itself_back():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_every_import_goes_down_the_layers():
    upward = [f"{a} imports {b}" for a, b in import_graph().edges if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


def test_every_module_has_a_layer_and_the_most_specific_one_counts():
    for module in import_graph():
        layer_of(module)
    assert layer_of("shardplan.frontend.chain") < layer_of("shardplan.plan")
    assert layer_of("shardplan.plan") < layer_of("shardplan.frontend.passes.blocks")
    # the runtime re-plans an elastic restart (compile) and must not reach for the CLI's tables
    assert layer_of("shardplan.compile") < layer_of("shardplan.runtime.elastic")
    assert layer_of("shardplan.runtime.elastic") < layer_of("shardplan.cli.report")

"""The package layering of ``../shared/DESIGN.md``, checked on the source with ``ast``.

Nothing is imported: every module under ``halfmoon/`` is parsed, and each ``import`` /
``from ... import`` (inside functions too, relative ones resolved, literal
``importlib.import_module("...")`` calls included) becomes an edge between the two
packages. Imports under ``if TYPE_CHECKING:`` are exempt: they never run.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "halfmoon"

#: The layer order of DESIGN.md's "Package layout" section (L0 core; L1 workload,
#: costmodel, metrics; L2 conductor, engine, store, transfer; L3 sim; L4 serve, bench),
#: with the top layer docs/architecture.md adds for what the brief does not list: L5
#: deploy/ (Ray actors over serve/), vllm_kv/ (the KV connector vLLM loads; it imports
#: vLLM and torch, so nothing of halfmoon imports it), cli.py and demo.py. A package imports only from lower
#: layers ("layers import downward only").
LAYERS: list[set[str]] = [
    {"core"},
    {"workload", "costmodel", "metrics"},
    {"conductor", "engine", "store", "transfer"},
    {"sim"},
    {"serve", "bench"},
    {"deploy", "cli", "demo", "vllm_kv"},
]

#: Imports within one layer that are allowed, each for a reason (still no cycles).
SAME_LAYER: dict[tuple[str, str], str] = {
    ("transfer", "store"): "the transfer engine serves and fills store blocks "
    "(docs/store-transfer.md)",
}

#: Further rules of DESIGN.md's package layout: importer -> packages it must not import.
FORBIDDEN: dict[str, set[str]] = {
    "sim": {"engine", "serve"},  # "Never imports engine/ or serve/."
}

#: "conductor/ ... Pure Python: no torch, no sockets."
NO_SOCKETS = {"socket", "zmq", "httpx", "uvicorn", "fastapi"}

Edges = dict[tuple[str, str], list[str]]


def _module_name(path: Path) -> list[str]:
    parts = ["halfmoon", *path.relative_to(ROOT).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _owner(module: list[str]) -> str | None:
    """The package (or top-level module) of ``halfmoon.X...``; None for others."""
    if len(module) < 2 or module[0] != "halfmoon":
        return None
    return module[1]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _literal_import_module(call: ast.Call) -> bool:
    """Whether ``call`` is ``import_module("a.literal")`` (``importlib.`` or not)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    literal = call.args and isinstance(call.args[0], ast.Constant)
    return name == "import_module" and bool(literal) and isinstance(call.args[0].value, str)


def _top_level() -> set[str]:
    """The packages and top-level modules of halfmoon/."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    return packages | {p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"}


def _imports(tree: ast.AST, package: list[str]) -> list[tuple[list[str], int]]:
    """(imported module as parts, line) for each import that can run, in any scope."""
    found: list[tuple[list[str], int]] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name.split("."), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            # ``from halfmoon import engine`` imports the package ``halfmoon.engine``
            found += [(module + [alias.name], node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and _literal_import_module(node):
            found.append((node.args[0].value.split("."), node.lineno))
        todo.extend(ast.iter_child_nodes(node))
    return found


@cache
def _scan() -> tuple[Edges, dict[str, list[str]]]:
    """Package edges with where they occur, and each top-level external import's sites."""
    names = _top_level()
    edges: Edges = defaultdict(list)
    external: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        source = _owner(module)
        package = module if path.name == "__init__.py" else module[:-1]
        where = str(path.relative_to(ROOT.parent))
        for target, line in _imports(ast.parse(path.read_text(), str(path)), package):
            if target[0] != "halfmoon":
                external[target[0]].append(f"{where}:{line} ({source})")
                continue
            owner = _owner(target)
            if source and owner in names and owner != source:
                edges[(source, owner)].append(f"{where}:{line}")
    return dict(edges), dict(external)


def _layer_of() -> dict[str, int]:
    return {name: level for level, names in enumerate(LAYERS) for name in names}


def _cycles(edges: Edges) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_package_has_a_layer():
    assert _top_level() == set(_layer_of()), "place new packages in LAYERS"


def test_no_import_cycle_between_packages():
    edges, _ = _scan()
    cycles = _cycles(edges)
    detail = {
        f"{a} -> {b}": sites[:3]
        for cycle in cycles
        for (a, b), sites in edges.items()
        if a in cycle and b in cycle
    }
    assert not cycles, f"import cycles between packages {cycles}: {detail}"


def test_packages_import_downward_only():
    edges, _ = _scan()
    layer = _layer_of()
    wrong = {
        f"{source} (L{layer[source]}) -> {target} (L{layer[target]})": sites[:3]
        for (source, target), sites in edges.items()
        if layer[target] > layer[source]
        or (layer[target] == layer[source] and (source, target) not in SAME_LAYER)
        or target in FORBIDDEN.get(source, set())
    }
    assert not wrong, f"imports against DESIGN.md's layer order: {wrong}"


#: Packages that may import torch: the engine, and the connector that runs inside vLLM.
TORCH_PACKAGES = ("(engine)", "(vllm_kv)")


def test_torch_is_imported_only_in_engine():
    _, external = _scan()
    torch = external.get("torch", [])
    outside = [site for site in torch if not site.endswith(TORCH_PACKAGES)]
    assert torch, "the scan found no torch import at all"
    assert not outside, f"torch imported outside halfmoon/engine/ and halfmoon/vllm_kv/: {outside}"


def test_vllm_is_imported_only_by_its_connector():
    _, external = _scan()
    outside = [site for site in external.get("vllm", []) if not site.endswith("(vllm_kv)")]
    assert not outside, f"vllm imported outside halfmoon/vllm_kv/: {outside}"


def test_conductor_opens_no_sockets():
    _, external = _scan()
    found = {
        name: sites
        for name in NO_SOCKETS
        if (sites := [s for s in external.get(name, []) if s.endswith("(conductor)")])
    }
    assert not found, f"halfmoon/conductor/ must stay pure Python: {found}"

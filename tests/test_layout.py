"""The package's layering, checked on its source: one layer talks to torch.distributed, no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import decent_optim

PACKAGE = Path(decent_optim.__file__).resolve().parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _runtime_imports(tree: ast.Module, annotations: bool = False) -> set[str]:
    """Modules imported when the module runs (``if TYPE_CHECKING:`` blocks left out, unless
    ``annotations``: then those too)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            if not annotations:
                return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


MODULES = _modules()


def test_the_module_list_is_not_empty():
    assert "decent_optim.gossip.p2p" in MODULES and "decent_optim.optim.engine" in MODULES


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_the_gossip_layer_imports_torch_distributed(name):
    uses = {m for m in _runtime_imports(MODULES[name]) if m.startswith("torch.distributed")}
    if name == "decent_optim.gossip" or name.startswith("decent_optim.gossip."):
        return
    assert not uses, f"{name} imports {sorted(uses)}; go through decent_optim.gossip instead"


@pytest.mark.parametrize("annotations", [False, True], ids=["runtime", "with-annotations"])
def test_the_package_has_no_import_cycle(annotations):
    """Also none through the imports of annotations (``if TYPE_CHECKING:``): a circle there
    mirrors a two-way dependency between modules, which a protocol should name instead."""
    graph = {
        name: {m for m in _runtime_imports(tree, annotations) if m in MODULES and m != name}
        for name, tree in MODULES.items()
    }
    # a package's __init__ importing its own submodules is how it re-exports them, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])


def test_topologies_and_runtime_model_need_no_communication():
    for name, tree in MODULES.items():
        if name.startswith(("decent_optim.topologies", "decent_optim.runtime")):
            assert not {m for m in _runtime_imports(tree) if m.startswith("decent_optim.gossip")}

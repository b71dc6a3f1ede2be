"""No circle of runtime imports in ``skyrl_train/`` or ``inference/``: a module of a
circle cannot be read without the others, and the last one (``runs/checkpoint.py`` ->
``runs/reshard.py`` -> ``runs/rank_state.py`` -> ``runs/checkpoint.py``) hid behind an
import inside a function.

So imports inside functions count: deferring an import only hides a circle from
Python's loader, not from a reader. Imports under ``if TYPE_CHECKING:`` do not: they
never run. An edge goes from a module to every module of ``skyrl_train`` or
``inference`` it names: ``from package import name`` is an edge to the submodule
``package.name`` when there is one, else to ``package``. Importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``, but not as the importer's dependency: a
package that re-exports its submodules (``workers/megatron/__init__.py``) is not in a
circle with them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layering import runtime_imports

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("skyrl_train", "inference")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports at run time (``sources``: module
    name -> its source text)."""
    graph: dict[str, set[str]] = {}
    for name, text in sources.items():
        targets: set[str] = set()
        for node in _runtime_import_nodes(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in sources)
                continue
            if node.module is None or node.level:
                continue
            for alias in node.names:
                if (sub := f"{node.module}.{alias.name}") in sources:
                    targets.add(sub)
                elif node.module in sources:
                    targets.add(node.module)
        targets.discard(name)
        graph[name] = targets
    return graph


def _runtime_import_nodes(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    lines = {line for line, _ in runtime_imports(tree)}
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno in lines
    ]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_of_runtime_imports() -> None:
    sources = {
        module_name(path): path.read_text()
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }
    assert circles(import_graph(sources)) == []


def test_the_check_finds_a_circle_through_a_function_local_import() -> None:
    sources = {
        "skyrl_train.runs.checkpoint": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from skyrl_train.runs import rank_state\n"
            "def check():\n    from skyrl_train.runs.reshard import saved_layout\n"
        ),
        "skyrl_train.runs.reshard": "from skyrl_train.runs import rank_state\n",
        "skyrl_train.runs.rank_state": "from skyrl_train.runs.checkpoint import RESUME_KEY\n",
        "skyrl_train.runs.folder": "import skyrl_train.runs.checkpoint\n",
    }
    assert circles(import_graph(sources)) == [
        ["skyrl_train.runs.checkpoint", "skyrl_train.runs.rank_state", "skyrl_train.runs.reshard"]
    ]
    # Only under TYPE_CHECKING: no circle.
    sources["skyrl_train.runs.checkpoint"] = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from skyrl_train.runs.reshard import saved_layout\n"
    )
    assert circles(import_graph(sources)) == []

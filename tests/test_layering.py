"""Every runtime import follows the package order written in docs/design.md section 1:
within a package, a folder imports only from itself and folders to its left; across
packages, only from packages to the left."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layering() -> dict[str, list[str]]:
    text = (REPO / "docs" / "design.md").read_text()
    block = re.search(r"```layering\n(.*?)```", text, re.S)
    assert block, "docs/design.md: expected a ```layering block"
    order = {}
    for line in block.group(1).strip().splitlines():
        name, _, items = line.partition(":")
        order[name.strip()] = items.split()
    return order


def runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every absolute import not under ``if TYPE_CHECKING:``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.lineno, child.module))
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            visit(child)

    visit(tree)
    return found


def unit(package: str, path: Path) -> str | None:
    """The layering unit of a module: its top folder, or its own name at the top."""
    parts = path.relative_to(REPO / package).parts
    if parts == ("__init__.py",):
        return None
    return parts[0].removesuffix(".py")


def test_every_import_goes_left() -> None:
    order = layering()
    packages = order.pop("packages")
    violations = []
    for package, units in order.items():
        for path in sorted((REPO / package).rglob("*.py")):
            source = unit(package, path)
            if source is None:
                continue
            assert source in units, f"{path}: {source!r} is not in docs/design.md's order"
            for line, module in runtime_imports(ast.parse(path.read_text())):
                top, _, rest = module.partition(".")
                where = f"{path.relative_to(REPO)}:{line} imports {module}"
                if top in packages and packages.index(top) > packages.index(package):
                    violations.append(where)
                elif top == package and rest:
                    target = rest.split(".")[0]
                    if target in units and units.index(target) > units.index(source):
                        violations.append(where)
    assert violations == [], "\n".join(violations)


def test_the_check_sees_a_violation() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from skyrl_train.trainer.loop import GRPOLoop\n"
        "if TYPE_CHECKING:\n    from skyrl_train.workers import x\n"
    )
    assert runtime_imports(tree) == [(1, "typing"), (2, "skyrl_train.trainer.loop")]

"""Finds every exception class a package defines, for the tests that pin each tree.

Modules are found by reading source, and only those that define an exception are
imported, so the scan never pulls in Megatron or Ray. A class counts when one of its
bases is a builtin exception, a name ending in ``Error``/``Exception``, or (transitively)
another class found this way; the imported class must then really be an exception.
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

_SEEDS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, Exception)}


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def exception_classes(package: str) -> list[type[BaseException]]:
    """The exception classes defined at module level anywhere under ``package``."""
    root = Path(importlib.import_module(package).__file__ or "").parent
    classes: dict[str, list[tuple[str, set[str]]]] = {}
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(file.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases = {_base_name(b) for b in node.bases}
                classes.setdefault(module, []).append((node.name, bases))
    known = set(_SEEDS)
    grew = True
    while grew:  # a subclass may come before its base (another module, sorted later)
        grew = False
        for defs in classes.values():
            for name, bases in defs:
                is_exc = bases & known or any(b.endswith(("Error", "Exception")) for b in bases)
                if is_exc and name not in known:
                    known.add(name)
                    grew = True
    found = []
    for module, defs in classes.items():
        names = [name for name, _ in defs if name in known]
        if names:
            loaded = importlib.import_module(module)
            found += [getattr(loaded, name) for name in names]
    return [c for c in found if isinstance(c, type) and issubclass(c, BaseException)]

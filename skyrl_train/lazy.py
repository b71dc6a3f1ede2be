"""A package's public names, resolved on first use from the module that owns each.

A package ``__init__`` that imports its modules eagerly makes every importer of any one
module pay for all of them: importing ``skyrl_train.config.schema`` ran
``config/__init__.py``, which loaded Hydra, skyrl_gym and every launch rule on each
trainer rank. ``lazy_exports`` gives the package the module-level ``__getattr__`` and
``__dir__`` (PEP 562) that keep ``from package import name`` working without that cost.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``homes`` maps each public name to
    the module (relative to ``package``) that defines it."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__

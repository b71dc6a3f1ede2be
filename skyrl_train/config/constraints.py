"""Range and choice constraints, declared beside each schema field.

``setting(default, ge=1)`` is a dataclass ``field`` whose metadata carries the rule;
``check_constraints(cfg)`` walks a config and refuses the first value that breaks
one, naming its dotted path. Types are OmegaConf's job (at composition, so ``--cfg
job`` already refuses them); what OmegaConf cannot express (ranges, a closed set of
strings: it has no ``Literal``) lives here, once, instead of in a hand-written check
per key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from skyrl_train.errors import ConfigValidationError

_RULES = ("choices", "ge", "gt", "le", "lt", "also", "length")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    choices: Sequence[str] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    also: Sequence[Any] = (),
    length: int | None = None,
) -> Any:
    """A dataclass field with constraints. ``choices``: the allowed strings; ``ge``/
    ``gt``/``le``/``lt``: bounds (a bounded float must also be finite); ``also``:
    sentinel values allowed besides the range (``-1`` for "off"); ``length``: the
    exact item count of a list. Bounds apply to each item of a list. ``None`` always
    passes (a field that allows it is typed ``X | None``)."""
    rules = {
        "choices": tuple(choices) if choices is not None else None,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "also": tuple(also),
        "length": length,
    }
    metadata = {k: v for k, v in rules.items() if v not in (None, ())}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_constraints(cfg: Any, *, prefix: str = "") -> None:
    """Refuse the first field of ``cfg`` (a config dataclass, walked recursively) whose
    value breaks its declared rule; ``ConfigValidationError.path`` is its dotted path."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            check_constraints(value, prefix=path)
            continue
        rules = {k: f.metadata[k] for k in _RULES if k in f.metadata}
        if rules and value is not None:
            check_value(value, path, **rules)


def check_value(value: Any, path: str, **rules: Any) -> None:
    """One value against ``setting``'s rules (lists: the length, then each item)."""
    if isinstance(value, (list, tuple)):
        length = rules.pop("length", None)
        if length is not None and len(value) != length:
            raise ConfigValidationError(path, expected=f"a list of {length}", got=repr(list(value)))
        for i, item in enumerate(value):
            check_value(item, f"{path}[{i}]", **rules)
        return
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        raise ConfigValidationError(path, expected=f"one of {list(choices)}", got=repr(value))
    bounds = [(op, rules[op]) for op in ("ge", "gt", "le", "lt") if rules.get(op) is not None]
    if not bounds or value in rules.get("also", ()):
        return
    finite = not isinstance(value, float) or math.isfinite(value)
    if finite and all(_holds(op, value, bound) for op, bound in bounds):
        return
    wanted = " and ".join(f"{_SYMBOL[op]} {bound}" for op, bound in bounds)
    kind = "an int" if isinstance(value, int) else "a finite number"
    sentinels = "".join(f"{a!r} or " for a in rules.get("also", ()))
    raise ConfigValidationError(path, expected=f"{sentinels}{kind} {wanted}", got=repr(value))


def shown(value: Any) -> str:
    """A config value as a message shows it, spelled as YAML and the command line write
    it: ``true``/``false``, ``null``, anything else as its repr."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else repr(value)


_SYMBOL = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _holds(op: str, value: float, bound: float) -> bool:
    if op == "ge":
        return value >= bound
    if op == "gt":
        return value > bound
    if op == "le":
        return value <= bound
    return value < bound

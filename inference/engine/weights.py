"""Named-tensor weight loading and export in the engine's own layout.

The layout is the transformers ``state_dict`` naming (for example
``model.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]``). Everything is validated
before the first copy, so a bad batch of tensors never leaves the model half-updated:
names, shapes, floating dtypes, and that every value is finite in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from inference.errors import RequestValidationError

__all__ = ["export_weights", "load_named_tensors", "parameter_shapes"]

# Elements per finiteness-check slice: the cast copy and the mask of one slice are the
# check's only temporaries (~24 MiB at 4M elements), whatever the tensor's size.
_FINITE_CHECK_ELEMENTS = 1 << 22


def parameter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Engine-layout name -> shape of every parameter ``load_named_tensors`` accepts."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_named_tensors(model: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies ``named_tensors`` into ``model`` (cast to its dtype); returns the count.

    Raises ``RequestValidationError`` (a ``ValueError``) naming the tensor for an unknown
    name, a repeat, a shape mismatch, a non-floating tensor, or a value that is NaN or
    infinite once cast to the parameter's dtype; nothing is copied then.
    """
    params = dict(model.named_parameters())
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[str] = set()
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise RequestValidationError(
                f"named_tensors[{i}]", "a (name, tensor) pair", type(item).__name__
            )
        name, tensor = item
        if name not in params:
            raise RequestValidationError(
                f"named_tensors[{i}]",
                f"a parameter name of the engine layout such as {next(iter(params))!r}",
                name,
            )
        if name in seen:
            raise RequestValidationError(f"named_tensors[{i}]", "a name not given before", name)
        seen.add(name)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise RequestValidationError(name, "a floating-point torch.Tensor", got)
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise RequestValidationError(name, f"shape {tuple(target.shape)}", tuple(tensor.shape))
        _check_finite(name, tensor, target.dtype)
        staged.append((target, tensor))
    with torch.no_grad():
        for target, tensor in staged:
            target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
    return len(staged)


def _check_finite(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Checked after the cast: 1e5 is finite in float32 but inf in a float16 model."""
    flat = tensor.detach().reshape(-1)
    for low in range(0, flat.numel(), _FINITE_CHECK_ELEMENTS):
        part = flat[low : low + _FINITE_CHECK_ELEMENTS]
        bad = ~torch.isfinite(part.to(dtype))
        if bool(bad.any()):
            index = low + int(bad.nonzero()[0, 0])
            position = ", ".join(str(int(j)) for j in np.unravel_index(index, tensor.shape))
            raise RequestValidationError(
                f"{name}[{position}]" if position else name,
                f"a finite value in {str(dtype).removeprefix('torch.')} (the engine's dtype)",
                float(flat[index]),
            )


def export_weights(model: Any) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, keyed by engine-layout name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}

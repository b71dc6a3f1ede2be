"""Named-tensor weight loading and export in the engine's own layout.

The layout is the transformers ``state_dict`` naming (for example
``model.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]``). Everything is validated
before the first copy, so a bad batch of tensors never leaves the model half-updated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["export_weights", "load_named_tensors"]


def load_named_tensors(model: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies ``named_tensors`` into ``model`` (cast to its dtype); returns the count.

    Raises ``ValueError`` naming the tensor for an unknown name, a duplicate, a shape
    mismatch or a non-floating tensor; nothing is copied then.
    """
    params = dict(model.named_parameters())
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[str] = set()
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"named_tensors[{i}]: expected a (name, tensor) pair, got {item!r}")
        name, tensor = item
        if name not in params:
            raise ValueError(
                f"named_tensors[{i}] {name!r}: expected a parameter name of the engine "
                f"layout such as {next(iter(params))!r}, got an unknown name"
            )
        if name in seen:
            raise ValueError(f"named_tensors[{i}] {name!r}: expected each name once, got a repeat")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name}: expected a floating-point torch.Tensor, got {got}")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        staged.append((target, tensor))
    with torch.no_grad():
        for target, tensor in staged:
            target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
    return len(staged)


def export_weights(model: Any) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, keyed by engine-layout name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}

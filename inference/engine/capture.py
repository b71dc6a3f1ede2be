"""Expert-route capture: forward hooks on every MoE layer's router.

In transformers 5.x each sparse layer's ``mlp.gate`` returns ``(logits, scores,
indices)`` with ``indices`` shaped ``[batch * seq, top_k]``, so a forward hook sees
exactly the experts each fed token was dispatched to — the selection the trainer
must replay, not a recomputation that could flip on near-ties.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RouteCapture", "route_dtype"]


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned/signed integer dtype holding every expert id."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


class RouteCapture:
    """Records top-k expert ids of every layer for each forward while ``active``.

    Usage per forward: ``begin(batch, seq)``, run the model, ``end()`` returns a
    ``[batch, seq, layers, top_k]`` tensor (or ``None`` when inactive). Hooks stay
    installed for the engine's lifetime; when inactive they return at once, so a
    batch without capture pays one attribute check per layer.
    """

    def __init__(self, model: Any, *, num_experts: int) -> None:
        self.gates = _find_gates(model)
        self.active = False
        self._dtype = _torch_dtype(route_dtype(num_experts))
        self._shape: tuple[int, int] | None = None
        self._layers: list[torch.Tensor | None] = [None] * len(self.gates)
        self._handles = [
            gate.register_forward_hook(self._make_hook(i)) for i, gate in enumerate(self.gates)
        ]

    @property
    def num_layers(self) -> int:
        return len(self.gates)

    def _make_hook(self, layer: int) -> Any:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if not self.active:
                return
            indices = output[2] if isinstance(output, tuple) else None
            if indices is None or indices.dim() != 2:
                raise RuntimeError(
                    f"route capture layer {layer}: expected the gate to return "
                    f"(logits, scores, indices[tokens, top_k]), got {type(output).__name__}"
                )
            # Narrowing now (uint8 for <=256 experts) keeps the per-step copy tiny.
            self._layers[layer] = indices.to(self._dtype)

        return hook

    def begin(self, batch: int, seq: int) -> None:
        self._shape = (batch, seq)
        self._layers = [None] * len(self.gates)

    def end(self) -> torch.Tensor | None:
        if not self.active:
            return None
        if self._shape is None or any(t is None for t in self._layers):
            missing = [i for i, t in enumerate(self._layers) if t is None]
            raise RuntimeError(f"route capture: layers {missing} produced no routes this forward")
        batch, seq = self._shape
        stacked = torch.stack(self._layers, dim=1)  # type: ignore[arg-type]
        self._layers = [None] * len(self.gates)
        return stacked.view(batch, seq, len(self.gates), -1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _find_gates(model: Any) -> list[torch.nn.Module]:
    gates = []
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None:
            gates.append(gate)
    if not gates:
        raise ValueError("route capture: expected MoE layers with mlp.gate, found none")
    return gates


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return {
        np.dtype(np.uint8): torch.uint8,
        np.dtype(np.int16): torch.int16,
        np.dtype(np.int32): torch.int32,
    }[dtype]

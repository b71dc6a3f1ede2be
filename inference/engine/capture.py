"""Expert-route capture: forward hooks on every MoE layer's router.

In transformers 5.x each sparse layer's router (the family's ``capture_point``,
``mlp.gate`` in all four families) returns ``(logits, scores, indices)`` with
``indices`` shaped ``[batch * seq, top_k]``, so a forward hook sees exactly the
experts each fed token was dispatched to — the selection the trainer must replay, not
a recomputation that could flip on near-ties. Dense layers (Qwen ``mlp_only_layers``)
have no router and no route: the route tensor's layer axis counts MoE layers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference.wire import route_dtype_for

__all__ = ["RouteCapture"]


class RouteCapture:
    """Records top-k expert ids of every MoE layer for each forward while ``active``.

    ``moe_layers`` are the decoder layers with a router (``MoEArchitecture.moe_layers``),
    ``capture_point`` the router's path under each (``Family.capture_point``). Usage
    per forward: ``begin(batch, seq)``, run the model, ``end()`` returns a
    ``[batch, seq, len(moe_layers), top_k]`` tensor (or ``None`` when inactive). Hooks
    stay installed for the engine's lifetime; when inactive they return at once, so a
    batch without capture pays one attribute check per layer.

    ``end()`` raises when a layer's hook did not fire in the forward. That is the one
    check for an uncaptured layer: the trainer cannot tell one from the ids (with top-1
    a layer may really send every token of a trajectory to expert 0), so
    ``skyrl_train.workers.routes.validate_routes`` relies on it.
    """

    def __init__(
        self,
        model: Any,
        *,
        num_experts: int,
        moe_layers: Sequence[int],
        capture_point: str = "mlp.gate",
    ) -> None:
        self.moe_layers = tuple(moe_layers)
        self.gates = _find_gates(model, self.moe_layers, capture_point)
        self.active = False
        # The wire's canonical dtype for the largest id, so routes leave without a cast
        # (torch names uint8/int16/int32 as numpy does).
        self._dtype: torch.dtype = getattr(torch, route_dtype_for(num_experts - 1).name)
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
                    f"route capture, decoder layer {self.moe_layers[layer]}: expected the "
                    "router to return "
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
            missing = [self.moe_layers[i] for i, t in enumerate(self._layers) if t is None]
            raise RuntimeError(
                f"route capture: decoder layers {missing} produced no routes this forward"
            )
        batch, seq = self._shape
        stacked = torch.stack(self._layers, dim=1)  # type: ignore[arg-type]
        self._layers = [None] * len(self.gates)
        return stacked.view(batch, seq, len(self.gates), -1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _find_gates(model: Any, moe_layers: Sequence[int], capture_point: str) -> list[torch.nn.Module]:
    layers = model.model.layers
    if not moe_layers:
        raise ValueError("route capture: expected at least one MoE layer, got none")
    gates = []
    for i in moe_layers:
        if not 0 <= i < len(layers):
            raise ValueError(
                f"route capture: MoE layer {i}: expected a decoder layer in [0, {len(layers)})"
            )
        try:
            gates.append(layers[i].get_submodule(capture_point))
        except AttributeError:
            raise ValueError(
                f"route capture: model.layers.{i}.{capture_point}: expected the router of an "
                "MoE layer, found no such module"
            ) from None
    return gates

"""Route checks every backend shares: a ``[B, S, L_moe, K]`` route tensor against the
model's routers, before any microbatch replays it (the route contract of
``workers/base.py``).

``RouteLayout`` is what the checks read of a backend's routers: Megatron's
``LocalRouters`` (``workers/megatron/replay.py``) and the FSDP backend's ``GateReplay``
(``workers/fsdp/replay.py``) both satisfy it. Importing this module loads no backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from skyrl_train.errors import RouteReplayError

__all__ = ["RouteLayout", "check_route_shape", "describe_route_layer", "validate_routes"]


class RouteLayout(Protocol):
    """The model's routers as a route tensor sees them."""

    @property
    def num_layers(self) -> int:
        """The route tensor's layer count: the model's MoE layers, every stage's."""
        ...

    @property
    def num_experts(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    def describe_layer(self, route_layer: int) -> str:
        """How messages name route layer ``route_layer`` (``describe_route_layer``)."""
        ...


def describe_route_layer(moe_layers: Sequence[int], route_layer: int) -> str:
    """``layer 2`` when route and decoder layers coincide, else both numbers
    (``moe_layers``: the 0-based decoder layer of each route layer)."""
    decoder = moe_layers[route_layer]
    if decoder == route_layer:
        return f"layer {route_layer}"
    return f"MoE layer {route_layer} (decoder layer {decoder})"


def check_route_shape(routes: torch.Tensor, routers: RouteLayout) -> None:
    """Refuse a route tensor that is not ``[B, S, L_moe, K]`` for this model."""
    if routes.dim() != 4:
        raise RouteReplayError(
            "routed_experts", expected="[B, S, L, K]", got=f"shape {tuple(routes.shape)}"
        )
    layers, top_k = routes.shape[2], routes.shape[3]
    if layers != routers.num_layers or top_k != routers.top_k:
        raise RouteReplayError(
            "routed_experts",
            expected=f"{routers.num_layers} MoE layers x top-{routers.top_k} (the model's)",
            got=f"{layers} layers x top-{top_k}",
        )


def validate_routes(
    routes: torch.Tensor,
    routers: RouteLayout,
    *,
    trajectory_ids: Sequence[str] | None = None,
) -> None:
    """Refuse routes the routers cannot replay; the message names trajectory and layer.

    ``routes`` is batch-first ``[B, S, L_moe, K]``: one layer per MoE layer of the model.
    Checks: shape against the model; ids in ``[0, num_experts)``; K distinct ids per
    row. A layer the engine never captured cannot be told from its ids (with top-1,
    every token of a short trajectory can really go to expert 0), so it is refused
    where the routes are made: ``RouteCapture.end()`` (``inference/engine/capture.py``)
    raises when a layer's hook did not fire in a forward, as each backend's dispatch
    recorder does for a router that dispatched nothing (R2).
    """
    names = list(trajectory_ids) if trajectory_ids is not None else None

    def who(b: int) -> str:
        return f"trajectory {names[b]!r} (batch row {b})" if names else f"batch row {b}"

    check_route_shape(routes, routers)
    batch, _seq, _layers, top_k = routes.shape
    if names is not None and len(names) != batch:
        raise RouteReplayError("trajectory_ids", expected=f"{batch} ids", got=str(len(names)))
    if routes.is_floating_point() or routes.dtype == torch.bool:
        raise RouteReplayError(
            "routed_experts.dtype", expected="an integer dtype", got=str(routes.dtype)
        )
    ids = routes.to(torch.int64)
    bad = (ids < 0) | (ids >= routers.num_experts)
    if bad.any():
        b, s, layer, k = (int(x) for x in bad.nonzero()[0])
        where = routers.describe_layer(layer)
        raise RouteReplayError(
            f"{who(b)}, {where}, token {s}",
            expected=f"expert ids in [0, {routers.num_experts})",
            got=str(int(ids[b, s, layer, k])),
        )
    ordered = ids.sort(dim=3).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=3)
    if repeated.any():
        b, s, layer = (int(x) for x in repeated.nonzero()[0])
        where = routers.describe_layer(layer)
        raise RouteReplayError(
            f"{who(b)}, {where}, token {s}",
            expected=f"{top_k} distinct experts",
            got=str(ids[b, s, layer].tolist()),
        )

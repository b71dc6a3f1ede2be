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

from skyrl_train.algorithms.mismatch import RouterAgreement, router_agreement, routes_differ
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.route_rows import PackedRouteRows, RouteTensor
from skyrl_train.errors import RouteReplayError

__all__ = [
    "RouteLayout",
    "check_route_shape",
    "describe_route_layer",
    "replay_requested",
    "rollout_agreement",
    "validate_routes",
]


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


def check_route_shape(routes: RouteTensor, routers: RouteLayout) -> None:
    """Refuse a route tensor that is not ``[B, S, L_moe, K]`` (or rows packed
    ``[T, L_moe, K]``) for this model."""
    if isinstance(routes, PackedRouteRows):
        routes = routes.values[None]
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
    routes: RouteTensor,
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
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise RouteReplayError(
            "routed_experts.dtype", expected="an integer dtype", got=str(routes.dtype)
        )
    # Checked token by token over [N, L, K]: a rectangle's every column, or the packed
    # rows' tokens, each token's (row, batch-layout column) named in a refusal.
    if isinstance(routes, PackedRouteRows):
        ids = routes.values.to(torch.int64)
        flat = routes.batch_index()
    else:
        ids = routes.to(torch.int64).reshape(-1, *routes.shape[2:])
        flat = None

    def where_is(token: int) -> tuple[int, int]:
        place = token if flat is None else int(flat[token])
        return divmod(place, routes.shape[1])

    bad = (ids < 0) | (ids >= routers.num_experts)
    if bad.any():
        token, layer, k = (int(x) for x in bad.nonzero()[0])
        b, s = where_is(token)
        raise RouteReplayError(
            f"{who(b)}, {routers.describe_layer(layer)}, token {s}",
            expected=f"expert ids in [0, {routers.num_experts})",
            got=str(int(ids[token, layer, k])),
        )
    ordered = ids.sort(dim=2).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=2)
    if repeated.any():
        token, layer = (int(x) for x in repeated.nonzero()[0])
        b, s = where_is(token)
        raise RouteReplayError(
            f"{who(b)}, {routers.describe_layer(layer)}, token {s}",
            expected=f"{top_k} distinct experts",
            got=str(ids[token, layer].tolist()),
        )


def replay_requested(
    batch: TrainingBatch,
    replay_routes: bool | None,
    layout: RouteLayout,
    *,
    enabled: bool,
    enabled_key: str,
    trajectory_ids: Sequence[str] | None = None,
) -> bool:
    """Whether a worker's forward replays ``batch``'s routes, the whole batch validated
    up front so a bad trajectory is refused before any microbatch ran.

    ``replay_routes=None`` replays when replay is ``enabled`` (the worker's setting,
    named ``enabled_key`` in the refusal) and the batch carries routes; a replay asked
    for without routes, or with replay off, is refused."""
    if replay_routes is None:
        replay_routes = enabled and batch.routed_experts is not None
    if not replay_routes:
        return False
    if batch.routed_experts is None:
        raise RouteReplayError("routed_experts", expected="routes to replay", got="None")
    if not enabled:
        raise RouteReplayError(enabled_key, expected="true to replay routes", got="false")
    validate_routes(batch.routed_experts, layout, trajectory_ids=trajectory_ids)
    return True


def _not_compared(batch: TrainingBatch, layout: RouteLayout) -> torch.Tensor:
    """``[B, S]`` True where the rollout's routes are not compared: padding and rows the
    rollout did not capture; refuses a batch without routes."""
    if batch.routed_experts is None:
        raise RouteReplayError("routed_experts", expected="routes to compare against", got="None")
    check_route_shape(batch.routed_experts, layout)
    skip = ~batch.attention_mask.to(torch.bool)
    if batch.router_padding_mask is not None:
        skip = skip | batch.router_padding_mask.to(torch.bool)
    return skip


def rollout_differences(
    batch: TrainingBatch, routes: torch.Tensor, layout: RouteLayout
) -> torch.Tensor:
    """``[B, S, L_moe]`` bool, True where ``routes`` (a forward's captured ``[B, S,
    L_moe, K]``, batch layout) chose other experts than the rollout did; False on
    positions the rollout did not capture (padding, uncaptured rows). The per-token form
    of ``rollout_agreement``, for the rollout dumps."""
    skip = _not_compared(batch, layout)
    check_route_shape(routes, layout)
    rollout = batch.routed_experts
    assert rollout is not None  # _not_compared refused a batch without
    if isinstance(rollout, PackedRouteRows):
        rollout = rollout.rectangle()
    if tuple(routes.shape) != tuple(rollout.shape):
        raise RouteReplayError(
            "routes",
            expected=f"shape {tuple(rollout.shape)} (the batch's)",
            got=str(tuple(routes.shape)),
        )
    return routes_differ(routes.cpu(), rollout.cpu()) & ~skip.cpu()[:, :, None]


def rollout_agreement(
    batch: TrainingBatch, routes: torch.Tensor, layout: RouteLayout
) -> RouterAgreement:
    """Agreement of ``routes`` (a forward's captured ``[B, S, L_moe, K]``) with the
    batch's rollout routes over the real positions the rollout captured
    (``router_padding_mask`` False), with the token-layer count that weights it across
    data-parallel ranks."""
    skip = _not_compared(batch, layout)
    assert batch.routed_experts is not None  # _not_compared refused a batch without
    if isinstance(batch.routed_experts, PackedRouteRows):
        # Compared on the packed tokens: no rectangle of the rollout's routes.
        packed = batch.routed_experts
        check_route_shape(routes, layout)
        if tuple(routes.shape) != packed.shape:
            raise RouteReplayError(
                "routes",
                expected=f"shape {packed.shape} (the batch's)",
                got=str(tuple(routes.shape)),
            )
        flat = packed.batch_index()
        got = routes.reshape(-1, *routes.shape[2:])[flat][None]
        return router_agreement(got, packed.values[None], skip.reshape(-1)[flat][None])
    return router_agreement(routes, batch.routed_experts, skip)

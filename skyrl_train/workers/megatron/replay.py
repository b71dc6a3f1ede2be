"""The R3 replay driver: check recorded routes, feed them to Megatron's routers, clean up.

Megatron's ``RouterReplay`` keeps its state in a process-global list of per-router
instances (build order). Replay here is keyed by (model chunk, microbatch)
(``KeyedReplay``), so it holds under every schedule Megatron has, interleaved ones
included; routes are given to the routers **sequence-first** (row ``s*B + b``).
Every session clears the global state on exit, including after an exception.

Only the discrete selection is replayed: the router gathers its live scores at the
given ids, so routing weights (and the router's gradient) are still computed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from skyrl_train.errors import RouteReplayError

# The route checks are backend-neutral (workers/routes.py); their old home keeps them.
from skyrl_train.workers.routes import check_route_shape as check_route_shape
from skyrl_train.workers.routes import describe_route_layer
from skyrl_train.workers.routes import validate_routes as validate_routes


@dataclass(frozen=True)
class LocalRouters:
    """This rank's routers in RouterReplay registration order (its model chunks in
    order, each chunk's layers in order).

    A route tensor ``[B, S, L_moe, K]`` has one layer per MoE layer of the whole model
    (dense layers have no router, and the engine captures none for them);
    ``moe_layers`` names their 0-based decoder layers, ``layers[i]`` the decoder layer
    of local router ``i`` and ``route_layers[i]`` its index on the route layer axis.
    """

    modules: tuple[Any, ...]
    layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    replay_enabled: bool
    chunks: tuple[int, ...]
    """The model chunk (virtual pipeline stage, 0 without one) of each local router."""
    sequence_shards: int = 1
    """Sequence-parallel shards (the tensor-parallel size with sequence parallelism on,
    else 1): each router then sees only ``sequence_shard`` of every sequence."""
    sequence_shard: int = 0
    """This rank's shard: positions ``[r*S/n, (r+1)*S/n)`` of the sequence-first
    ``[S, B, H]`` hidden states, as Megatron's ``scatter_to_sequence_parallel_region``
    splits them before the first layer."""

    @property
    def num_layers(self) -> int:
        """The route tensor's layer count: the model's MoE layers, every stage's."""
        return len(self.moe_layers)

    @property
    def route_layers(self) -> tuple[int, ...]:
        return tuple(self.moe_layers.index(layer) for layer in self.layers)

    def describe_layer(self, route_layer: int) -> str:
        """``layer 2`` when route and decoder layers coincide, else both numbers."""
        return describe_route_layer(self.moe_layers, route_layer)


def moe_layer_numbers(config: Any) -> tuple[int, ...]:
    """0-based decoder layers with a router, from ``moe_layer_freq`` as Megatron reads
    it (an int N: every N-th layer from 0; a list: 1 marks an MoE layer)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i for i in range(config.num_layers) if i % freq == 0)
    return tuple(i for i, flag in enumerate(freq) if flag)


def local_routers(chunks: Sequence[Any]) -> LocalRouters:
    """Find the routers of this rank's model chunks, ordered as RouterReplay
    registered them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    found: list[tuple[Any, int, int]] = []
    for c, chunk in enumerate(chunks):
        for layer in chunk.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                found.append((router, layer.layer_number - 1, c))
    config = chunks[0].config
    moe_layers = moe_layer_numbers(config)
    stray = [n for _, n, _c in found if n not in moe_layers]
    if stray:
        raise RouteReplayError(
            "moe_layer_freq",
            expected=f"routers in decoder layers {list(moe_layers)}",
            got=f"routers in layers {stray}",
        )
    replay_enabled = bool(config.moe_enable_routing_replay)
    if replay_enabled:
        registry = RouterReplay.global_router_replay_instances
        order = {id(inst): i for i, inst in enumerate(registry)}
        missing = [n for r, n, _c in found if id(r.router_replay) not in order]
        if missing or len(registry) != len(found):
            raise RouteReplayError(
                "RouterReplay registry",
                expected=f"this model's {len(found)} routers",
                got=f"{len(registry)} registered (another model built since? layers {missing})",
            )
        found.sort(key=lambda item: order[id(item[0].router_replay)])
    shards, shard = 1, 0
    if config.sequence_parallel:
        from megatron.core import parallel_state

        shards = parallel_state.get_tensor_model_parallel_world_size()
        shard = parallel_state.get_tensor_model_parallel_rank()
    return LocalRouters(
        sequence_shards=shards,
        sequence_shard=shard,
        modules=tuple(r for r, _n, _c in found),
        layers=tuple(n for _r, n, _c in found),
        moe_layers=moe_layers,
        num_experts=int(config.num_moe_experts),
        top_k=int(config.moe_router_topk),
        replay_enabled=replay_enabled,
        chunks=tuple(c for _r, _n, c in found),
    )


def check_registry(routers: LocalRouters) -> None:
    """Refuse to replay if the process-global registry no longer holds these routers
    (a model built later cleared and refilled it; replay would feed the wrong model)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    registered = [id(inst) for inst in RouterReplay.global_router_replay_instances]
    mine = [id(module.router_replay) for module in routers.modules]
    if registered != mine:
        raise RouteReplayError(
            "RouterReplay registry",
            expected=f"this model's {len(mine)} routers",
            got=f"{len(registered)} other instances (a model built since setup replaced them)",
        )


def to_sequence_first(routes: torch.Tensor, routers: LocalRouters) -> list[torch.Tensor]:
    """``[B, S, L_moe, K]`` -> one ``[S/n*B, K]`` int64 tensor per local router (row
    s*B+b), each taken from that router's own route layer, for the tokens that router
    sees: with sequence parallelism over n ranks, this rank's contiguous slice of the
    sequence (positions ``[r*S/n, (r+1)*S/n)``), the rows its hidden states hold."""
    batch, seq, _layers, top_k = routes.shape
    shards, shard = routers.sequence_shards, routers.sequence_shard
    if seq % shards:
        raise RouteReplayError(
            "routed_experts",
            expected=f"a sequence length divisible by {shards} sequence-parallel ranks",
            got=f"{seq}",
        )
    local = seq // shards
    return [
        routes[:, shard * local : (shard + 1) * local, layer, :]
        .transpose(0, 1)
        .reshape(local * batch, top_k)
        .to(torch.int64)
        .contiguous()
        for layer in routers.route_layers
    ]


def gather_sequence_shards(rows: torch.Tensor, routers: LocalRouters) -> torch.Tensor:
    """Sequence-first ``[S/n*B, ...]`` rows of every sequence-parallel rank, in rank
    order: the whole sequence's ``[S*B, ...]`` (the identity without sequence
    parallelism). Every rank of the tensor-parallel group must call it."""
    if routers.sequence_shards == 1:
        return rows
    from megatron.core import parallel_state

    parts = [torch.empty_like(rows) for _ in range(routers.sequence_shards)]
    torch.distributed.all_gather(
        parts, rows.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts)


def clear_replay_state() -> None:
    """Drop every router's targets, backward FIFO, recording and action."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()


class KeyedReplay:
    """Replay keyed by (model chunk, microbatch), for any Megatron schedule.

    Megatron's own helper (``RouterReplay.set_replay_data``) gives every router of the
    rank the next microbatch's routes and appends them to every router's backward
    FIFO, which activation recompute pops. Under an interleaved schedule a rank holds
    several model chunks, each router belongs to one, and the chunks run their
    forwards and backwards in different orders; a chunk's recompute then pops routes
    that another chunk's forwards pushed (``tests/.../test_megatron_pipeline.py`` shows
    it). Here nothing is queued: a chunk's forward of microbatch m sets only that
    chunk's routers to m's routes, and the gradient reaching the chunk's output sets
    them to m's routes again, before autograd reaches the recomputed layers (they sit
    upstream of the output, so their backward runs later). The routers stay in
    REPLAY_FORWARD throughout.
    """

    def __init__(self, routers: LocalRouters, routes: Sequence[torch.Tensor]) -> None:
        """``routes[m]``: microbatch m's batch-first ``[b, S, L_moe, K]`` (validated)."""
        self._routers = routers
        self._targets = [to_sequence_first(r, routers) for r in routes]
        self._of_chunk: dict[int, list[int]] = {}
        for i, chunk in enumerate(routers.chunks):
            self._of_chunk.setdefault(chunk, []).append(i)

    def arm(self, chunk: int, microbatch: int) -> None:
        """Before ``chunk``'s forward of ``microbatch``."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        targets = self._targets[microbatch]
        for i in self._of_chunk.get(chunk, ()):
            instance = self._routers.modules[i].router_replay
            instance.target_topk_idx = targets[i]
            instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def on_backward(self, chunk: int, microbatch: int) -> None:
        """When the gradient of ``chunk``'s output for ``microbatch`` arrives, before
        any recompute inside the chunk."""
        self.arm(chunk, microbatch)


@contextmanager
def replay_session(routers: LocalRouters) -> Iterator[None]:
    """One schedule's use of the routers: refuse a stale registry, start from clean
    state and leave clean state, an exception included."""
    if not routers.replay_enabled:
        raise RouteReplayError(
            "moe_enable_routing_replay",
            expected="True on the built model to replay routes",
            got="False",
        )
    check_registry(routers)
    clear_replay_state()
    try:
        yield
    finally:
        clear_replay_state()


class DispatchCapture:
    """What each router actually dispatched (its routing map), in any mode, per
    microbatch: ``begin(m, batch, seq)`` before a chunk's forward, ``end()`` after it.
    Forwards outside a begin/end pair (activation recompute in the backward) are not
    recorded. Reading the routers' output also proves that a replay took.

    Every token must be dispatched to exactly K experts; a routing map that drops or
    adds some (token dropping at an expert capacity, which launch validation refuses
    with replay) raises ``RouteReplayError`` with both counts."""

    def __init__(self, routers: LocalRouters) -> None:
        self._routers = routers
        self._index = {id(module): i for i, module in enumerate(routers.modules)}
        self._active: tuple[int, int, int] | None = None
        self.got: dict[int, dict[int, torch.Tensor]] = {}
        """microbatch -> local router index -> ``[b, S, K]`` ascending expert ids."""
        self._handles = [module.register_forward_hook(self._hook) for module in routers.modules]

    def _hook(self, module: Any, _inputs: Any, output: Any) -> None:
        if self._active is None:
            return
        microbatch, batch, seq = self._active
        routing_map = output[1]  # [tokens, E] bool, tokens sequence-first
        index = self._index[id(module)]
        tokens, top_k = routing_map.shape[0], self._routers.top_k
        per_token = routing_map.sum(dim=1)
        if not bool((per_token == top_k).all()):
            # nonzero() of a ragged map reshapes into misgrouped rows, or fails opaquely.
            where = self._routers.describe_layer(self._routers.route_layers[index])
            raise RouteReplayError(
                f"dispatched routes, {where}, microbatch {microbatch}",
                expected=f"{tokens} tokens x top-{top_k} = {tokens * top_k} routes",
                got=f"{int(per_token.sum())} ({int((per_token != top_k).sum())} of the {tokens} "
                "tokens with another count; is moe_expert_capacity_factor set?)",
            )
        ids = routing_map.nonzero()[:, 1].reshape(tokens, top_k)
        ids = gather_sequence_shards(ids, self._routers)
        rows = ids.reshape(seq, batch, top_k).transpose(0, 1).detach().cpu()
        self.got.setdefault(microbatch, {})[index] = rows

    def begin(self, microbatch: int, *, batch: int, seq: int) -> None:
        self._active = (microbatch, batch, seq)

    def end(self) -> None:
        self._active = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

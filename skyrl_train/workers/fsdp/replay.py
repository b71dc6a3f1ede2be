"""Routing replay in transformers' own MoE blocks (the FSDP backend), by forward hooks
on each MoE layer's router.

In transformers 5.x every supported family's router (``Family.capture_point``,
``mlp.gate``) returns ``(router_logits, router_scores[T, K], router_indices[T, K])`` and
its block dispatches to exactly those ids with those weights, so a forward hook that
returns another tuple decides the dispatch; no family needs a block of its own. Under
replay the hook returns the replayed ids, with weights computed from the live logits
as the family computes them (fp32 softmax over every expert, the K picked, renormalised
where the family renormalises, cast to the router's own output dtype), so the router
still gets gradients. Only the discrete selection is replayed, as in the Megatron
backend (the route contract of ``workers/base.py``; docs/r3-and-pipeline.md).

The replayed ids are put in the order the family's ``topk`` would give them (the live
probabilities descending): the experts' loop batches each expert's tokens in that
order and the renormalising sum adds in it. Replayed in the routes' ascending order,
a model's own routes moved fp32 logits by up to 4.3e-6 (tiny Mixtral, 4 x 33 tokens);
in this order they give native routing's bits in every family, fp32 and bf16
(tests/skyrl_train/workers/test_fsdp_replay.py).

A session covers one forward and its backward: an activation-checkpoint recompute in
the backward calls each router again, gets the same ids, and is not recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from inference.errors import CheckpointFormatError
from inference.models.architecture import MoEArchitecture
from inference.models.families import family_named
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.routes import describe_route_layer, validate_routes

__all__ = ["GateReplay", "RouteRecorder"]

_GATE_OUTPUT = "(router_logits, router_scores[tokens, K], router_indices[tokens, K])"


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: where an
    activation-checkpoint recompute (reentrant or not) calls the layers again."""
    return bool(torch._C._current_graph_task_id() != -1)


class _Session:
    """One forward's routes and what each router did in it, by route layer."""

    def __init__(self, num_layers: int, routes: torch.Tensor | None, capture: bool) -> None:
        self.routes = routes
        self.capture = capture
        self.shapes: list[tuple[int, int] | None] = [None] * num_layers
        self.calls = [0] * num_layers
        self.dispatched: list[torch.Tensor | None] = [None] * num_layers


class RouteRecorder:
    """What each router dispatched in a ``GateReplay.session``: read after the forward."""

    def __init__(self, replay: GateReplay, session: _Session) -> None:
        self._replay = replay
        self._session = session

    @property
    def gate_calls(self) -> tuple[int, ...]:
        """Forwards of each MoE layer's router so far: 1, plus 1 per checkpoint recompute."""
        return tuple(self._session.calls)

    def routes(self) -> torch.Tensor:
        """``[b, S, L_moe, K]`` int64 expert ids each router dispatched in the session's
        forward, ascending, on the model's device. A router that did not run in it
        (its hook removed, or no forward yet) is refused, naming the layer: no route
        tensor can be made without it."""
        session = self._session
        if not session.capture:
            raise ValueError("RouteRecorder.routes: expected session(capture=True), got False")
        rows: list[torch.Tensor] = []
        shape: tuple[int, int] | None = None
        for index, ids in enumerate(session.dispatched):
            if ids is None or session.shapes[index] is None:
                raise RouteReplayError(
                    f"dispatched routes, {self._replay.describe_layer(index)}",
                    expected="its router to run in the session's forward",
                    got="no call (is its hook installed?)",
                )
            shape = shape or session.shapes[index]
            rows.append(ids)
        assert shape is not None
        return torch.stack(rows, dim=1).view(*shape, len(rows), self._replay.top_k)


class GateReplay:
    """Forward hooks on the router of every MoE layer of a transformers MoE model
    (``model.model.layers[i].<capture_point>``, ``i`` in ``architecture.moe_layers``).

    Outside a ``session`` the hooks return at once: native routing, nothing recorded.
    It is a ``workers.routes.RouteLayout``, so ``validate_routes`` checks routes
    against it. Hooks on the routers survive ``fully_shard`` of the decoder layers
    (FSDP2 hooks the layer, not its submodules).
    """

    def __init__(self, model: Any, architecture: MoEArchitecture) -> None:
        jitter = getattr(model.config, "router_jitter_noise", None) or 0.0
        if jitter > 0:
            # transformers' Mixtral block scales its input by noise in training, routed
            # and replayed alike; the Megatron backend builds no jitter from a
            # checkpoint, so the backends (and a run and its rollouts) would differ.
            raise CheckpointFormatError(
                "config.json:router_jitter_noise",
                "0 (no routing backend here jitters the router's input)",
                jitter,
            )
        self.architecture = architecture
        self._moe_layers = tuple(architecture.moe_layers)
        capture_point = family_named(architecture.family).capture_point
        layers = model.model.layers
        if len(layers) != architecture.num_layers:
            raise RouteReplayError(
                "model.model.layers",
                expected=f"{architecture.num_layers} decoder layers (the architecture's)",
                got=str(len(layers)),
            )
        self._session: _Session | None = None
        self._handles: list[Any] = []
        for index, layer_number in enumerate(self._moe_layers):
            gate = layers[layer_number].get_submodule(capture_point)
            self._check_gate(index, gate)
            parent, _, _ = capture_point.rpartition(".")
            block = layers[layer_number].get_submodule(parent) if parent else layers[layer_number]
            self._install(index, gate, block)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self._moe_layers

    @property
    def num_layers(self) -> int:
        return len(self._moe_layers)

    @property
    def num_experts(self) -> int:
        return self.architecture.num_experts

    @property
    def top_k(self) -> int:
        return self.architecture.num_experts_per_tok

    def describe_layer(self, route_layer: int) -> str:
        return describe_route_layer(self._moe_layers, route_layer)

    def _check_gate(self, index: int, gate: torch.nn.Module) -> None:
        """The router's own settings must be the ones the replayed weights use."""
        arch = self.architecture
        expected = {
            "top_k": arch.num_experts_per_tok,
            "num_experts": arch.num_experts,
            "norm_topk_prob": arch.norm_topk_prob,
        }
        for name, want in expected.items():
            got = getattr(gate, name, want)  # Mixtral's router has no norm_topk_prob
            if got != want:
                raise RouteReplayError(
                    f"{self.describe_layer(index)}: {type(gate).__name__}.{name}",
                    expected=f"{want!r} (the architecture's)",
                    got=repr(got),
                )

    def _install(self, index: int, gate: torch.nn.Module, block: torch.nn.Module) -> None:
        self._handles.append(
            block.register_forward_pre_hook(self._block_hook(index), with_kwargs=True)
        )
        self._handles.append(gate.register_forward_hook(self._gate_hook(index)))

    def _block_hook(self, index: int) -> Any:
        def hook(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            session = self._session
            if session is None:
                return
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                raise RouteReplayError(
                    f"{self.describe_layer(index)}: MoE block input",
                    expected="hidden states [b, S, hidden]",
                    got=type(hidden).__name__
                    if not isinstance(hidden, torch.Tensor)
                    else f"shape {tuple(hidden.shape)}",
                )
            session.shapes[index] = (int(hidden.shape[0]), int(hidden.shape[1]))

        return hook

    def _gate_hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
            session = self._session
            if session is None:
                return None
            where = self.describe_layer(index)
            if not (
                isinstance(output, tuple)
                and len(output) == 3
                and all(isinstance(t, torch.Tensor) for t in output)
                and output[2].dim() == 2
            ):
                raise RouteReplayError(
                    f"{where}: {type(module).__name__} output",
                    expected=_GATE_OUTPUT,
                    got=type(output).__name__
                    if not isinstance(output, tuple)
                    else f"a {len(output)}-tuple",
                )
            if session.calls[index] and not _in_backward():
                raise RouteReplayError(
                    f"{where}: router call {session.calls[index] + 1} in one session",
                    expected="one forward per session (a second call only as the "
                    "backward's activation-checkpoint recompute)",
                    got="a second forward",
                )
            session.calls[index] += 1
            logits, scores, ids = output
            if session.routes is not None:
                ids, scores = self._replayed(index, session, logits, scores, ids)
            if session.capture and session.calls[index] == 1:
                session.dispatched[index] = ids.detach().sort(dim=-1).values.to(torch.int64)
            return (logits, scores, ids) if session.routes is not None else None

        return hook

    def _replayed(
        self,
        index: int,
        session: _Session,
        logits: torch.Tensor,
        scores: torch.Tensor,
        ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The replayed ids of this router's tokens and their weights from ``logits``."""
        assert session.routes is not None
        batch, seq = session.routes.shape[:2]
        fed = session.shapes[index]
        if fed != (batch, seq) or ids.shape[0] != batch * seq:
            got = f"{ids.shape[0]} tokens" + (f" ({fed[0]} x {fed[1]})" if fed else "")
            raise RouteReplayError(
                f"replayed routes, {self.describe_layer(index)}",
                expected=f"the routes' {batch} x {seq} = {batch * seq} tokens at the router",
                got=got,
            )
        if session.routes.device != logits.device:  # once per session
            session.routes = session.routes.to(logits.device)
        target = session.routes[:, :, index].reshape(batch * seq, self.top_k)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        picked, order = probs.gather(1, target).sort(dim=-1, descending=True, stable=True)
        if self.architecture.norm_topk_prob:
            picked = picked / picked.sum(dim=-1, keepdim=True)
        return target.gather(1, order).to(ids.dtype), picked.to(scores.dtype)

    @contextmanager
    def session(self, *, routes: torch.Tensor | None, capture: bool) -> Iterator[RouteRecorder]:
        """Route one forward (and its backward) inside the block.

        ``routes``: ``[b, S, L_moe, K]`` integer expert ids for the ``[b, S]`` tokens
        fed to the model, checked with ``validate_routes``; every MoE layer's router
        then dispatches to ``routes[:, :, l]``. None routes natively. ``capture``: the
        recorder's ``routes()`` returns what each router dispatched."""
        if self._session is not None:
            raise ValueError("GateReplay.session: expected no open session, got one open")
        if routes is not None:
            validate_routes(routes, self)
            routes = routes.to(torch.int64)
        session = _Session(self.num_layers, routes, capture)
        self._session = session
        try:
            yield RouteRecorder(self, session)
        finally:
            self._session = None

    def close(self) -> None:
        """Remove every hook (the model routes natively from then on)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

"""Test oracles for the Megatron worker: ways to read the trainer's routing that the
pipeline itself does not use, so a test can check the pipeline's own path against them.

``record_routes`` reads Megatron's RouterReplay RECORD mode (the router's top-k before
dispatch), a mechanism independent of ``DispatchCapture`` (the routing map after it),
which is what the worker uses. It runs one plain forward of one chunk: PP=1 only.
"""

from __future__ import annotations

import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.workers.megatron import MegatronPolicyWorker
from skyrl_train.workers.megatron.layout import make_contiguous, route_filler_tensor, shift_rows
from skyrl_train.workers.megatron.replay import check_registry, clear_replay_state
from skyrl_train.workers.megatron.schedule import chunk_forward


def record_routes(worker: MegatronPolicyWorker, batch: TrainingBatch) -> torch.Tensor:
    """The trainer's own top-k per MoE layer (router order) as ``[B, S, L_moe, K]`` in
    the batch layout, from RECORD mode; needs replay enabled on the model."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    assert len(worker.chunks) == 1, "record_routes reads one chunk: PP=1 only"
    routers = worker.routers
    assert routers is not None and routers.replay_enabled
    layout = make_contiguous(batch, pad_token_id=worker.pad_token_id)
    rows, seq = layout.tokens.shape
    check_registry(routers)
    clear_replay_state()
    try:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        worker.model.eval()
        with torch.no_grad():
            chunk_forward(worker.chunks[0], layout)
        per_layer = []
        for module in routers.modules:
            recorded = module.router_replay.get_recorded_indices()
            assert recorded is not None, "a router recorded nothing"
            per_layer.append(recorded.reshape(seq, rows, -1).transpose(0, 1))
    finally:
        clear_replay_state()
    local = torch.stack(per_layer, dim=2)
    return shift_rows(local, -layout.shifts, route_filler_tensor(local))


def router_agreement(
    worker: MegatronPolicyWorker,
    batch: TrainingBatch,
    *,
    replay_routes: bool,
    micro_batch_size: int | None = None,
) -> float:
    """Share of real token-layer selections where the trainer dispatched to the same
    experts as the batch's rollout routes, in a forward with or without replay."""
    result = worker.forward(
        batch, micro_batch_size=micro_batch_size, replay_routes=replay_routes, capture_routes=True
    )
    assert result.routes is not None
    return worker.rollout_router_agreement(batch, result.routes).agreement

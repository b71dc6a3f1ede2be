"""Gradient averaging and clipping across Megatron's parallel groups, by hand.

Megatron's DDP and optimizer wrappers hard-code CUDA, so the worker runs plain
``torch.optim.AdamW`` and does here what those wrappers would: average gradients over
the data-parallel groups the way Megatron's DDP scales them (dense and expert grads
both by 1/dp_size), and clip by the global norm over every shard of the model.
Expert parameters are the ones Megatron marks ``allreduce=False``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from skyrl_train.workers.megatron.pipeline import PipelineGroup


def _is_expert(param: torch.Tensor) -> bool:
    return not getattr(param, "allreduce", True)


def average_data_parallel_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum each gradient over its data-parallel group (the expert one for expert
    parameters) and divide by the data-parallel size."""
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    if dp_size == 1:
        return
    dense_group = parallel_state.get_data_parallel_group()
    expert_group = parallel_state.get_expert_data_parallel_group()
    for param in params:
        if param.grad is None:
            continue
        group = expert_group if _is_expert(param) else dense_group
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(param.grad, group=group)
        param.grad.div_(dp_size)


def clip_grad_norm(
    params: Sequence[torch.nn.Parameter], *, max_norm: float, pipeline: PipelineGroup
) -> float:
    """The global L2 norm before clipping (expert shards summed over the EP group,
    stages over the pipeline group); gradients are scaled down to ``max_norm`` when
    above it. ``max_norm`` <= 0 disables clipping (tests only: the schema wants > 0)."""
    from megatron.core import parallel_state

    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    with_grad = [p for p in params if p.grad is not None]
    for p in with_grad:
        assert p.grad is not None
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if _is_expert(p):
            expert_sq += sq
        else:
            dense_sq += sq
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            expert_sq, group=parallel_state.get_expert_model_parallel_group()
        )
    # Each stage holds its own layers: the squares add up over the pipeline group.
    norm = math.sqrt(float(pipeline.sum_over_stages(dense_sq + expert_sq)))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in with_grad:
            assert p.grad is not None
            p.grad.mul_(scale)
    return norm

"""Gradient averaging and clipping across Megatron's parallel groups, by hand.

Megatron's DDP and optimizer wrappers hard-code CUDA, so the worker runs plain
``torch.optim.AdamW`` and does here what those wrappers would: average gradients over
the data-parallel groups the way Megatron's DDP scales them (dense and expert grads
both by 1/dp_size), and clip by the global norm over every shard of the model.
Which parameters are expert weights or tensor-parallel shards, and over which group,
is ``tensor_parallel.py``'s answer, the one loading and export use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from skyrl_train.algorithms.optim import clip_to_norm_
from skyrl_train.algorithms.token_mean import data_parallel_mean_
from skyrl_train.workers.megatron.pipeline import PipelineGroup
from skyrl_train.workers.megatron.tensor_parallel import (
    is_expert,
    is_shard,
    tensor_parallel_group,
)


def sum_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Add up over the tensor-parallel group the gradients of the parameters every TP
    rank holds whole but feeds from its own part of the data: those Megatron marks
    ``sequence_parallel`` (norms and routers, which see one sequence shard each) and
    the q/k norms (which see one shard of the heads), as megatron-core's
    ``finalize_model_grads`` does before its optimizer. Without it the TP ranks' copies
    of those weights drift apart after the first step."""
    _rank, size, group = tensor_parallel_group(expert=False)
    if size == 1:
        return
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        partial = getattr(param, "sequence_parallel", False) or (
            "q_layernorm" in name or "k_layernorm" in name
        )
        if partial:
            torch.distributed.all_reduce(param.grad, group=group)


def average_data_parallel_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum each gradient over its data-parallel group and divide it by the dense
    data-parallel size, as megatron-core's DDP does for both kinds (its
    ``expert_gradient_scaling_factor`` is also 1/dp), and as the loss normalisation
    expects (``algorithms/token_mean.py``: the mini-batch's rows are split over the
    dense data-parallel ranks). An expert parameter's group is the expert-data-parallel
    one: the ranks that hold the same experts, which under TP x EP with a smaller
    expert tensor size (TP=4 x EP=2 x ETP=1: dense DP 1, expert DP 2) outnumber the
    dense data-parallel ranks, each having dispatched its own sequence shard's tokens
    to them."""
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    sizes = (dp_size, parallel_state.get_expert_data_parallel_world_size())
    if max(sizes) == 1:
        return
    groups = (
        parallel_state.get_data_parallel_group(),
        parallel_state.get_expert_data_parallel_group(),
    )
    for param in params:
        if param.grad is None:
            continue
        expert = int(is_expert(param))
        if sizes[expert] > 1:
            torch.distributed.all_reduce(param.grad, group=groups[expert])
        data_parallel_mean_(param.grad, dp_size=dp_size)


def clip_grad_norm(
    params: Sequence[torch.nn.Parameter], *, max_norm: float, pipeline: PipelineGroup
) -> float:
    """The global L2 norm before clipping (expert shards summed over the EP group,
    stages over the pipeline group); gradients are scaled down to ``max_norm`` when
    above it. ``max_norm`` <= 0 disables clipping (tests only: the schema wants > 0)."""
    from megatron.core import parallel_state

    with_grad = [p for p in params if p.grad is not None]
    # On the gradients' device: NCCL reduces only device tensors, gloo CPU ones.
    device = with_grad[0].device if with_grad else torch.device("cpu")
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    # Tensor-parallel shards, [dense, expert]: their squares add up over their TP group;
    # a parameter every TP rank holds whole (and, synced, equal) counts once.
    shard_sq = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
    for p in with_grad:
        assert p.grad is not None
        sq = p.grad.detach().double().pow(2).sum()
        expert = is_expert(p)
        if is_shard(p):
            shard_sq[int(expert)] += sq
        elif expert:
            expert_sq += sq
        else:
            dense_sq += sq
    for expert in (False, True):
        _rank, size, group = tensor_parallel_group(expert=expert)
        if size > 1:
            torch.distributed.all_reduce(shard_sq[int(expert)], group=group)
    dense_sq += shard_sq[0]
    expert_sq += shard_sq[1]
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            expert_sq, group=parallel_state.get_expert_model_parallel_group()
        )
    # Each stage holds its own layers: the squares add up over the pipeline group.
    norm = math.sqrt(float(pipeline.sum_over_stages(dense_sq + expert_sq)))
    clip_to_norm_([p.grad for p in with_grad if p.grad is not None], norm=norm, max_norm=max_norm)
    return norm

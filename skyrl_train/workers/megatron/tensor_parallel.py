"""Tensor-parallel shards of a Megatron parameter, to and from the whole tensor.

Megatron marks a sharded parameter ``tensor_model_parallel`` with its
``partition_dim`` (0: column-parallel, 1: row-parallel); expert weights
(``allreduce=False``) are sharded over the expert tensor-parallel group. Weight loading
(``convert.load_hf_weights``) cuts each rank's shard from the HF tensor and export
gathers the shards back, so the engine always sees whole tensors. The cut itself is
``utils/shards.py``'s, which a checkpoint's resharding shares (``runs/reshard.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from skyrl_train.utils.shards import cut_shard, join_shards


def tensor_parallel_of(param: torch.Tensor) -> tuple[int, int, Any]:
    """(rank, size, group) of the tensor-parallel group ``param`` is a shard over: the
    expert one for expert weights (``allreduce=False``), (0, 1, None) for a parameter
    every rank holds whole."""
    if not getattr(param, "tensor_model_parallel", False):
        return 0, 1, None
    from megatron.core import parallel_state

    if not getattr(param, "allreduce", True):
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_group(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def is_gated(param_name: str) -> bool:
    """A gated MLP's ``linear_fc1`` (``[gate; up]``): Megatron shards the gate and the
    up projection separately, so a rank holds ``[gate_r; up_r]``, not a slice of rows."""
    return param_name.endswith("linear_fc1.weight")


def shard_of(param: torch.Tensor, whole: torch.Tensor, *, gated: bool) -> torch.Tensor:
    """This rank's shard of the whole tensor ``whole`` for ``param`` (``whole`` itself
    when ``param`` is not tensor-parallel). Column-parallel weights split on dim 0,
    row-parallel on dim 1 (megatron's ``partition_dim``); q/k/v, laid out per KV group,
    split into whole groups."""
    rank, size, _group = tensor_parallel_of(param)
    dim = int(getattr(param, "partition_dim", 0))
    return cut_shard(whole, dim=dim, rank=rank, size=size, gated=gated)


def unshard(param: torch.Tensor, *, gated: bool) -> torch.Tensor:
    """The whole tensor of a tensor-parallel ``param``, gathered over its group (every
    rank of it must call this in lockstep); a detached ``param`` otherwise."""
    local = param.detach()
    _rank, size, group = tensor_parallel_of(param)
    if size == 1:
        return local
    dim = int(getattr(param, "partition_dim", 0))
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return join_shards(parts, dim=dim, gated=gated)


def whole_shape_of(param: torch.Tensor) -> torch.Tensor:
    """A stand-in of the whole tensor's shape for a tensor-parallel ``param`` (the
    fused tables read only its shape)."""
    _rank, size, _group = tensor_parallel_of(param)
    if size == 1:
        return param
    shape = list(param.shape)
    shape[int(getattr(param, "partition_dim", 0))] *= size
    return torch.empty(shape, device="meta")

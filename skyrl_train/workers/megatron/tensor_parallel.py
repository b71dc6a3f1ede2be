"""Tensor-parallel shards of a Megatron parameter, to and from the whole tensor.

Megatron marks a sharded parameter ``tensor_model_parallel`` with its
``partition_dim`` (0: column-parallel, 1: row-parallel); expert weights
(``allreduce=False``) are sharded over the expert tensor-parallel group. Weight loading
(``convert.load_hf_weights``) cuts each rank's shard from the HF tensor and export
gathers the shards back, so the engine always sees whole tensors. The cut itself is
``utils/shards.py``'s, which a checkpoint's resharding shares (``runs/reshard.py``).

``tensor_parallel_of`` is the one answer to which group a parameter is a shard over:
loading, export, the rank file's placements and the gradients' norm and reductions
(``gradients.py``) all ask it, so an expert weight never counts over the dense group
in one place and the expert one in another.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from skyrl_train.utils.shards import cut_shard, join_shards


class TensorParallelGroup(NamedTuple):
    """A rank's place in a tensor-parallel group: ``(rank, size, group)``."""

    rank: int
    size: int
    group: Any


_WHOLE = TensorParallelGroup(0, 1, None)


def is_expert(param: torch.Tensor) -> bool:
    """An expert weight: megatron-core marks them ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def is_shard(param: torch.Tensor) -> bool:
    """A parameter megatron-core splits over a tensor-parallel group (marked
    ``tensor_model_parallel``, at any size of that group, 1 included)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def tensor_parallel_group(*, expert: bool) -> TensorParallelGroup:
    """This rank in the expert tensor-parallel group (``expert_tensor_parallel_size``)
    or the dense one: what every rank calls in lockstep when it reduces over all the
    shards of one kind, whether or not it holds one."""
    from megatron.core import parallel_state

    if expert:
        return TensorParallelGroup(
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_group(),
        )
    return TensorParallelGroup(
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def tensor_parallel_of(param: torch.Tensor) -> TensorParallelGroup:
    """(rank, size, group) of the tensor-parallel group ``param`` is a shard over: the
    expert one for expert weights, (0, 1, None) for a parameter every rank holds whole."""
    if not is_shard(param):
        return _WHOLE
    return tensor_parallel_group(expert=is_expert(param))


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

"""The FSDP worker's parameters and gradients as shards: loading whole tensors into
them, gathering them back, and the global gradient norm (a rank's checkpoint is
``fsdp/checkpoint.py``).

Under FSDP2 every parameter and gradient is a ``DTensor`` sharded on dim 0 over the
mesh (``Shard(0)``); unsharded (no process group) they are plain tensors, and each
helper here takes both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from skyrl_train.algorithms import optim
from skyrl_train.workers.base import check_swapped_weights


def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``param`` (this rank's shard of it when
    sharded). Every rank holds ``full``, so each cuts its own shard: no communication."""
    with torch.no_grad():
        value = full.detach().to(param.device, param.dtype)
        if isinstance(param, DTensor):
            value = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            )
        param.copy_(value)


def copy_params_(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """``params[name] <- values[name]`` in place (same shards, same layout)."""
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(values[name])


@contextmanager
def copied_in(
    params: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> Iterator[None]:
    """``weights`` (every parameter, this rank's shards) in ``params`` inside the block,
    the parameters' own values back on exit, an exception included; refused before
    anything is written when a name or a shape differs."""
    check_swapped_weights(params, weights)
    own = {name: param.detach().clone() for name, param in params.items()}
    try:
        copy_params_(params, weights)
        yield
    finally:
        copy_params_(params, own)


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU, detached (an all-gather when sharded)."""
    with torch.no_grad():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        return whole.detach().to("cpu", copy=True)


def reshard(model: torch.nn.Module) -> None:
    """Free every layer's gathered weights, so the next forward gathers the shards anew."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clip_grad_norm(model: torch.nn.Module, *, max_norm: float) -> float:
    """The global L2 norm of the gradients before clipping (each rank's shards' squares
    summed in fp64 over the mesh, equal on every rank); gradients are scaled down to
    ``max_norm`` when above it (``algorithms/optim.clip_to_norm_``, the Megatron
    worker's clip too)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        squares += local.detach().double().pow(2).sum()
    if sharded:
        torch.distributed.all_reduce(squares, group=sharded[0].device_mesh.get_group())
    norm = math.sqrt(float(squares))
    optim.clip_to_norm_(grads, norm=norm, max_norm=max_norm)
    return norm


def require_same_count(count: int, *, what: str, device: torch.device) -> None:
    """Refuse, on every rank alike, a ``count`` that differs between the ranks (one
    tiny all-reduce); a no-op on one rank."""
    if torch.distributed.get_world_size() == 1:
        return
    bounds = torch.tensor([count, -count], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
    most, fewest = int(bounds[0]), -int(bounds[1])
    if most != fewest:
        raise ValueError(
            f"micro_batch_size: expected the same number of {what} on every data-parallel "
            f"rank, got {fewest} to {most} (this rank {count}): give every rank as many rows"
        )

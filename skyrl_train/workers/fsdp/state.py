"""The FSDP worker's parameters and gradients as shards: loading whole tensors into
them, gathering them back, the global gradient norm, and a rank's checkpoint.

Under FSDP2 every parameter and gradient is a ``DTensor`` sharded on dim 0 over the
mesh (``Shard(0)``); unsharded (no process group) they are plain tensors, and each
helper here takes both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from skyrl_train.algorithms import optim


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


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optimizer"}``: this rank's shards of the model's and AdamW's state,
    keyed by parameter name (``torch.distributed.checkpoint.state_dict``), for a resume
    on the same layout."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_checkpoint_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> None:
    """Load a ``checkpoint_state`` of this layout into the model and AdamW."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=saved["model"],
        optim_state_dict=saved["optimizer"],
    )

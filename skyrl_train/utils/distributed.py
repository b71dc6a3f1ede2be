"""Joining torch.distributed's default process group, for every trainer backend.

One rank's join does not depend on the backend that trains over the group, so the
Megatron worker (after its CPU shim, ``workers/megatron/model.py``) and the FSDP worker
(``workers/factory.py``) join through this one function.
"""

from __future__ import annotations

import torch


def init_distributed(*, rank: int, world_size: int, init_method: str) -> None:
    """Join torch.distributed's default group: gloo on CPU, nccl with CUDA.

    ``init_method`` is a torch rendezvous URL (``file://``, ``tcp://``, ``env://``);
    a world of one uses an in-process store whatever it says: no port to pick, so
    nothing to race other processes for (a free-port probe can be taken before gloo
    binds it).
    """
    dist = torch.distributed
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def collective_device() -> torch.device:
    """Where a tensor for a default-group collective lives: this process's current GPU
    under nccl, the CPU under gloo (``init_distributed``'s choice of backend)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""A tensor-parallel shard and its whole tensor, both ways, as plain tensor math.

A parameter split over ``size`` tensor-parallel ranks along ``dim`` holds the rank's
``1/size`` slice; a gated MLP's ``linear_fc1`` (``[gate; up]``) splits the gate and the
up projection separately, so a rank holds ``[gate_r; up_r]``. The Megatron worker
cuts its shards of the HF weights with this (``workers/megatron/tensor_parallel.py``)
and a checkpoint is resharded with it from its rank files' placement records
(``runs/reshard.py``), so both agree on what a shard is.
"""

from __future__ import annotations

import torch


def cut_shard(whole: torch.Tensor, *, dim: int, rank: int, size: int, gated: bool) -> torch.Tensor:
    """Rank ``rank``'s shard of ``whole`` split ``size`` ways along ``dim`` (``whole``
    itself when ``size`` is 1)."""
    if size == 1:
        return whole
    if gated:
        halves = torch.chunk(whole, 2, dim=dim)
        return torch.cat([torch.chunk(h, size, dim=dim)[rank] for h in halves], dim=dim)
    return torch.chunk(whole, size, dim=dim)[rank]


def join_shards(parts: list[torch.Tensor], *, dim: int, gated: bool) -> torch.Tensor:
    """The whole tensor from its ranks' shards in rank order: ``cut_shard``'s inverse."""
    if gated:
        pairs = [torch.chunk(part, 2, dim=dim) for part in parts]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=dim)
    return torch.cat(parts, dim=dim)

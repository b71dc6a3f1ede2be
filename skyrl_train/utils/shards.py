"""A tensor-parallel shard and its whole tensor, both ways, as plain tensor math.

A parameter split over ``size`` tensor-parallel ranks along ``dim`` holds the rank's
``1/size`` slice; a gated MLP's ``linear_fc1`` (``[gate; up]``) splits the gate and the
up projection separately, so a rank holds ``[gate_r; up_r]``. The Megatron worker
cuts its shards of the HF weights with this (``workers/megatron/tensor_parallel.py``)
and a checkpoint is resharded with it from its rank files' placement records
(``runs/reshard.py``), so both agree on what a shard is.

The cut is ``torch.chunk``'s, with empty shards appended up to ``size``: FSDP2 shards
every parameter so on dim 0 (``fully_shard``), the chunks ``ceil(n / size)`` rows each
and the last ones shorter or empty (5 rows over 4 ranks: 2, 2, 1, 0), and an FSDP rank
file records its shard with the same dim, rank and size (``workers/fsdp/checkpoint.py``).
Megatron's tensor-parallel sizes divide their dims, where this is an even split.
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
        return torch.cat([_chunk(h, dim=dim, rank=rank, size=size) for h in halves], dim=dim)
    return _chunk(whole, dim=dim, rank=rank, size=size)


def _chunk(whole: torch.Tensor, *, dim: int, rank: int, size: int) -> torch.Tensor:
    """``torch.chunk(whole, size, dim)[rank]``, or an empty slice along ``dim`` for a
    rank past the chunks ``torch.chunk`` returns (it returns fewer when the rows run out:
    ``torch.chunk`` of 5 rows in 4 gives 2, 2, 1)."""
    chunks = torch.chunk(whole, size, dim=dim)
    if rank < len(chunks):
        return chunks[rank]
    return whole.narrow(dim, whole.shape[dim], 0)


def join_shards(parts: list[torch.Tensor], *, dim: int, gated: bool) -> torch.Tensor:
    """The whole tensor from its ranks' shards in rank order: ``cut_shard``'s inverse."""
    if gated:
        pairs = [torch.chunk(part, 2, dim=dim) for part in parts]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=dim)
    return torch.cat(parts, dim=dim)

"""``utils/shards.py``'s cut and join: FSDP2's uneven and empty dim-0 shards, and
Megatron's even tensor-parallel split (gated or not) left as it was."""

from __future__ import annotations

import pytest
import torch

from skyrl_train.utils.shards import cut_shard, join_shards


@pytest.mark.parametrize(
    ("rows", "size", "sizes"),
    [(5, 4, [2, 2, 1, 0]), (3, 2, [2, 1]), (1, 3, [1, 0, 0]), (8, 4, [2, 2, 2, 2])],
)
def test_dim0_shards_follow_fsdp2s_chunking_and_join_back(
    rows: int, size: int, sizes: list[int]
) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    whole = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    parts = [cut_shard(whole, dim=0, rank=r, size=size, gated=False) for r in range(size)]
    assert [p.shape[0] for p in parts] == sizes
    assert all(p.shape[1:] == whole.shape[1:] for p in parts)
    # FSDP2's own split (torch's private helper, read here as the reference).
    fsdp = _chunk_with_empty(whole, size, dim=0)
    assert all(torch.equal(p, f.reshape(p.shape)) for p, f in zip(parts, fsdp, strict=True))
    assert torch.equal(join_shards(parts, dim=0, gated=False), whole)


def test_megatrons_even_gated_split_is_unchanged() -> None:
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    whole = torch.cat([gate, up])
    parts = [cut_shard(whole, dim=0, rank=r, size=2, gated=True) for r in range(2)]
    assert torch.equal(parts[1], torch.cat([gate[2:], up[2:]]))
    assert torch.equal(join_shards(parts, dim=0, gated=True), whole)

"""Packed microbatches on the Megatron backend (``trainer.remove_microbatch_padding``).

Each microbatch's rows run as one row ``[1, T]`` (``workers/packed_layout.pack_rows``)
through ``GPTModel.forward`` with ``PackedSeqParams(qkv_format="thd")``: positions
restart at 0 in every row (rotary is applied per document from ``cu_seqlens``), the
core attention keeps to each document (``packed_attention.py``), and the routes are the
packed row's own, so replay hands every router its tokens' routes sequence-first as
for a padded row of batch 1 (``replay.to_sequence_first``; with sequence parallelism
each rank's slice of the packed row).

``T`` gets a tail, its own document of pad tokens and padding for the routers (no
replay check, agreement or loss reads it), where the layout needs one:

- sequence parallelism splits ``T`` evenly over the tensor-parallel ranks: a multiple
  of their number;
- pipeline stages exchange one activation shape per schedule: every microbatch as long
  as the longest, and filler microbatches (the interleaved schedule's count) are that
  long too;
- expert parallelism exchanges tokens between ranks that hold different rows (the
  allgather dispatcher's ``all_gather_into_tensor`` needs one size on every rank): each
  microbatch as long as the longest of its index on any rank of the exchange group
  (one all-reduce of the lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.workers.batch_layout import ContiguousBatch
from skyrl_train.workers.megatron.pipeline import PipelineGroup
from skyrl_train.workers.packed_layout import PackedBatch, pack_rows

ScheduledLayout = ContiguousBatch | PackedBatch
"""What the schedule feeds one microbatch as: padded rows, or one packed row."""

__all__ = ["ScheduledLayout", "pack_microbatches", "packed_forward", "packed_seq_params"]


def pack_microbatches(
    micro: Sequence[TrainingBatch],
    pipeline: PipelineGroup,
    *,
    pad_token_id: int,
    sequence_shards: int = 1,
    exchange_group: Any = None,
) -> list[PackedBatch]:
    """The schedule's inputs for ``micro``: each packed into one row with the tail its
    layout needs (this module's docstring), then, when pipelining, filler rows up to
    ``pipeline.padded_count``. ``exchange_group``: the process group whose ranks
    exchange tokens (None: no exchange between ranks holding other rows)."""
    packed = [pack_rows(mb, pad_token_id=pad_token_id) for mb in micro]
    lengths = [p.tokens.shape[1] for p in packed]
    if pipeline.size > 1:
        lengths = [max(lengths)] * len(lengths)
    if exchange_group is not None:
        lengths = _longest_in_group(lengths, exchange_group)
    lengths = [n + (-n % sequence_shards) for n in lengths]
    inputs = [
        p.padded_to(n, pad_token_id=pad_token_id) for p, n in zip(packed, lengths, strict=True)
    ]
    fillers = pipeline.padded_count(len(micro)) - len(micro)
    if fillers:
        blank = _empty_like(packed[0]).padded_to(lengths[0], pad_token_id=pad_token_id)
        inputs += [blank] * fillers
    return inputs


def _longest_in_group(lengths: list[int], group: Any) -> list[int]:
    """Each microbatch's longest packed length over ``group``'s ranks, which must run
    as many microbatches (else the exchange would pair microbatches wrongly, or hang)."""
    count = torch.tensor([len(lengths), -len(lengths)], dtype=torch.int64)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    if int(count[0]) != -int(count[1]):
        raise ValueError(
            "micro_batch_size: expected the same number of microbatches on every rank that "
            f"exchanges tokens (expert parallelism), got between {-int(count[1])} and "
            f"{int(count[0])} (this rank: {len(lengths)})"
        )
    longest = torch.tensor(lengths, dtype=torch.int64)
    torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX, group=group)
    return [int(n) for n in longest.tolist()]


def _empty_like(like: PackedBatch) -> PackedBatch:
    """A packed row of no trajectories (``padded_to`` gives it its tail): a pipeline's
    filler microbatch."""
    none = torch.zeros(0, dtype=torch.int64)
    return PackedBatch(
        tokens=like.tokens[:, :0],
        positions=like.positions[:, :0],
        cu_seqlens=torch.zeros(1, dtype=like.cu_seqlens.dtype),
        row_starts=none,
        lengths=none,
        prompt_lens=none,
        shifts=none,
        padding_mask=like.padding_mask[:, :0],
        routes=None if like.routes is None else like.routes[:, :0],
        width=like.width,
    )


def packed_seq_params(layout: PackedBatch, *, device: torch.device | str) -> Any:
    """megatron-core's THD ``PackedSeqParams`` for ``layout``'s documents (the tail one
    of them): what Transformer Engine's varlen attention and this project's
    ``packed_attention`` read, and what rotary positions restart by."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = layout.cu_seqlens.to(device=device, dtype=torch.int32)
    longest = layout.max_seqlen
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def packed_forward(chunk: Any, layout: PackedBatch) -> torch.Tensor:
    """One model chunk's forward of a packed row: logits ``[1, T, V]`` on the last
    stage, hidden states ``[T, 1, H]`` elsewhere. No attention mask: the documents in
    ``PackedSeqParams`` are the mask. ``padding_mask`` (True = padding, Megatron's
    convention) marks the tail and the uncaptured tokens for the routers."""
    device = next(chunk.parameters()).device
    return chunk(
        layout.tokens.to(device),
        layout.positions.to(device),
        None,
        padding_mask=layout.padding_mask.to(device),
        packed_seq_params=packed_seq_params(layout, device=device),
    )

"""The microbatch plan a trainer rank hands its worker, the same count on every rank.

``trainer.max_tokens_per_microbatch=-1`` (off): ``MicrobatchPlan.by_rows`` of the
row count the caller gives (``micro_train_batch_size_per_gpu`` for an update,
``micro_forward_batch_size_per_gpu`` for a forward), which every rank shares since
every rank holds as many rows. With a budget N > 0 each rank bin-packs its own rows by
their real tokens (``MicrobatchPlan.by_tokens``), and ragged rows give ranks different
counts; but under FSDP every microbatch's forward is a collective and under expert
parallelism the ranks exchange tokens per microbatch, so a rank that stopped early
would hang the others. The ranks agree the largest count any of them needs with one
all-reduce MAX over the default group, and every rank splits its fullest microbatches
until it has that many (never an empty one). The max over the whole world is the max
over the data-parallel ranks: the tensor, pipeline and expert copies of one
data-parallel rank hold the same rows, so they need the same count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.utils.distributed import collective_device
from skyrl_train.workers.microbatches import MicrobatchPlan, row_tokens

__all__ = ["agreed_count", "microbatch_plan"]

MaxOverRanks = Callable[[int], int]
"""This rank's count -> the largest over every rank (a collective: every rank calls it)."""


def agreed_count(count: int) -> int:
    """The largest ``count`` over every rank of the default process group (one
    all-reduce MAX; ``count`` itself without one, or on one rank)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value[0])


def microbatch_plan(
    batch: TrainingBatch,
    *,
    micro_batch_size: int,
    max_tokens_per_microbatch: int,
    max_over_ranks: MaxOverRanks = agreed_count,
) -> MicrobatchPlan:
    """This rank's plan for ``batch``: by ``micro_batch_size`` rows when
    ``max_tokens_per_microbatch`` is -1, else by that token budget, split to the count
    ``max_over_ranks`` agrees (every rank must call this together then). A rank with
    fewer rows than the agreed count cannot reach it without an empty microbatch and is
    refused, naming both counts."""
    if max_tokens_per_microbatch == -1:
        return MicrobatchPlan.by_rows(batch.batch_size, micro_batch_size)
    lengths = row_tokens(batch.attention_mask)
    own = MicrobatchPlan.by_tokens(lengths, max_tokens=max_tokens_per_microbatch)
    count = max_over_ranks(own.count)
    if count == own.count:
        return own
    if count > batch.batch_size:
        raise ValueError(
            f"trainer.max_tokens_per_microbatch: expected every rank to reach the agreed "
            f"{count} microbatches, got {batch.batch_size} rows on this rank (one each at "
            "most): give every rank as many rows"
        )
    return MicrobatchPlan.by_tokens(lengths, max_tokens=max_tokens_per_microbatch, count=count)

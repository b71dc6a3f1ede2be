"""Driver-side data parallelism: which rows each rank trains on, and one metric dict back.

The driver collates and pads the whole batch once, then cuts it by rows, so every
rank's shard has the same number of rows and the same padded widths: with expert
parallelism all ranks of an EP group gather each other's tokens, so they must run
the same number of microbatches of the same shape. Each rank receives only its own
shard (docs/design.md §5: broadcasting every route to every rank ran hosts out of memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skyrl_train.algorithms.metrics import MetricSums
from skyrl_train.dataset.batch import (
    TrainingBatch,
    select_rows,
    training_loss_mask,
)

ROWS_KEY = "train/num_rows"
"""Rows a rank trained on (summed over ranks)."""


def mini_batch_order(batch_size: int, *, mini_batch_size: int, dp_size: int) -> torch.Tensor:
    """A row permutation after which rank r's contiguous block holds, in order, its
    ``mini_batch_size // dp_size`` rows of every global mini-batch.

    Optimizer step k then sees global rows ``[k*mini, (k+1)*mini)`` whatever dp_size
    is, so a run on several ranks takes the same steps as a run on one.
    """
    if mini_batch_size < 1 or batch_size % mini_batch_size:
        raise ValueError(
            f"mini_batch_size: expected a positive divisor of the batch size {batch_size}, "
            f"got {mini_batch_size}"
        )
    if dp_size < 1 or mini_batch_size % dp_size:
        raise ValueError(
            f"dp_size: expected a positive divisor of the mini-batch size {mini_batch_size}, "
            f"got {dp_size}"
        )
    per_rank = mini_batch_size // dp_size
    rows = torch.arange(batch_size).reshape(batch_size // mini_batch_size, dp_size, per_rank)
    return rows.transpose(0, 1).reshape(-1)


def shard_mini_batches(
    batch: TrainingBatch, *, mini_batch_size: int, dp_size: int
) -> list[TrainingBatch]:
    """One shard per data-parallel rank (index = dp rank), each ``batch_size / dp_size``
    rows with the full batch's padded widths; see ``mini_batch_order``."""
    order = mini_batch_order(batch.batch_size, mini_batch_size=mini_batch_size, dp_size=dp_size)
    if dp_size == 1:
        return [batch]
    per_rank = batch.batch_size // dp_size
    # One gather per rank, never a slice: a slice is a view, and pickling a view (ray.put)
    # ships its whole storage, so every rank would receive every rank's routes.
    return [select_rows(batch, order[r * per_rank : (r + 1) * per_rank]) for r in range(dp_size)]


def mini_batch_token_counts(batch: TrainingBatch, *, mini_batch_size: int) -> list[float]:
    """Tokens the loss trains on in each global mini-batch (``training_loss_mask``).

    Every rank divides its loss by its mini-batch's *global* count, so the averaged
    gradient is a token mean over the whole mini-batch, not a mean of rank means
    (which over-weights the tokens of a rank with short responses).
    """
    mask = training_loss_mask(batch)
    return [
        float(mask[start : start + mini_batch_size].sum())
        for start in range(0, batch.batch_size, mini_batch_size)
    ]


def combine_rank_metrics(per_rank: Sequence[MetricSums]) -> dict[str, float]:
    """One metric dict from every rank's sums: each mean's numerators and its own
    denominators are summed over the ranks and divided once, sums add, maxima and
    minima stay extreme, as each producer recorded them (``MetricSums``). The result
    is the metric the whole batch would give on one rank (tests/skyrl_train/trainer/
    test_data_parallel.py computes both and compares every key)."""
    for rank, metrics in enumerate(per_rank):
        if not isinstance(metrics, MetricSums):
            raise ValueError(
                f"per_rank[{rank}]: expected MetricSums (numerators and denominators), "
                f"got {type(metrics).__name__}"
            )
    return MetricSums.combine(per_rank).result()

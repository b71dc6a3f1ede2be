"""Driver-side data parallelism: which rows each rank trains on, and one metric dict back.

The driver collates and pads the whole batch once, then cuts it by rows, so every
rank's shard has the same number of rows and the same padded widths: with expert
parallelism all ranks of an EP group gather each other's tokens, so they must run
the same number of microbatches of the same shape. Each rank receives only its own
shard (docs/design.md §5: broadcasting every route to every rank ran hosts out of memory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from skyrl_train.algorithms.metrics import StepMetrics, reduction_of
from skyrl_train.dataset.batch import (
    TrainingBatch,
    map_tensors,
    shard_for_data_parallel_rank,
    training_loss_mask,
)

ROWS_KEY = "train/num_rows"
"""Rows a rank trained on; the default weight of its mean-reduced metrics (summed)."""
GROUP_WEIGHT_LEAVES = ("num_tokens", "num_token_layers")
"""A mean metric ``g/x`` is weighted by the rank's ``g/<leaf>`` (first leaf present)."""


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
    ordered = map_tensors(batch, lambda t: t[order])
    return [
        shard_for_data_parallel_rank(ordered, rank=r, world_size=dp_size) for r in range(dp_size)
    ]


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


def combine_rank_metrics(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One metric dict from every rank's.

    Reductions follow ``StepMetrics`` (``max_*`` max, ``min_*`` min, ``num_*`` sum).
    Means are weighted: a key ``g/x`` by the rank's ``g/num_tokens`` or
    ``g/num_token_layers`` when the rank reports one (logprob mismatch per token,
    router agreement per token-layer, so a rank with more real tokens counts more),
    otherwise by the rank's rows (``train/num_rows``).
    """
    combined = StepMetrics()
    for rank, metrics in enumerate(per_rank):
        if ROWS_KEY not in metrics:
            raise ValueError(f"per_rank[{rank}]: expected a {ROWS_KEY!r} entry, got none")
        groups: dict[float, dict[str, float]] = {}
        for key, value in metrics.items():
            weight = _weight_of(key, metrics) if reduction_of(key) == "mean" else 1.0
            groups.setdefault(weight, {})[key] = value
        for weight, group in groups.items():
            combined.update(group, weight=weight)
    return combined.result()


def _weight_of(key: str, metrics: Mapping[str, float]) -> float:
    group = key.rsplit("/", 1)[0] if "/" in key else None
    if group is not None:
        for leaf in GROUP_WEIGHT_LEAVES:
            weight = metrics.get(f"{group}/{leaf}")
            if weight is not None:
                return float(weight)
    return float(metrics[ROWS_KEY])

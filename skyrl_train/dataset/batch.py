"""The seam between batch preprocessing and the trainer: ``TrainingBatch`` and the
plain row operations the driver and the workers both use on it (no Megatron import, so
the driver can shard a batch without loading the worker)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from skyrl_train.dataset.route_rows import PackedRouteRows, RouteTensor


@dataclass
class TrainingBatch:
    """A padded training batch of B trajectories.

    Layout (SkyRL's): each row of ``sequences`` is the prompt left-padded to P, then
    the response right-padded to R, so S = P + R and the response occupies the last
    R columns. Trainers that need contiguous tokens (Megatron ignores position_ids
    for RoPE) re-lay rows out themselves, routes with them.
    """

    sequences: torch.Tensor
    """[B, S] int64 token ids; padding holds the pad token id."""
    attention_mask: torch.Tensor
    """[B, S] int64, 1 on real tokens."""
    response_mask: torch.Tensor
    """[B, R] int64, 1 on real response tokens (generated or observation)."""
    loss_mask: torch.Tensor
    """[B, R] int64, 1 on tokens the policy generated."""
    rewards: torch.Tensor
    """[B] float32 trajectory rewards."""
    token_rewards: torch.Tensor
    """[B, R] float32."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, R] float32 sampled-token logprobs from the engine; None if not returned."""
    routed_experts: RouteTensor | None = None
    """The rollout's routes, in the widest sample dtype: as collated, packed by row
    (``dataset/route_rows.PackedRouteRows``, ``[T, L, K]``: no padded rectangle on the
    way to the ranks); or ``[B, S, L, K]`` aligned with ``sequences`` (a batch built by
    hand, R2's captured routes), padding columns holding ``inference.wire.route_filler``
    (``arange(K)``). Uncaptured tokens hold the filler either way. None when R3 is off."""
    router_padding_mask: torch.Tensor | None = None
    """[B, S] bool, True on padding and uncaptured rows (not the loss mask: prompt and
    observation tokens still replay). None when R3 is off."""
    sample_support: torch.Tensor | None = None
    """[B, R, k] int64 token ids the rollout's sampler kept at each response position
    (top-k / top-p), -1 past the kept set and on positions it did not sample; the
    trainer scores each token over this set (sampler replay). None without a cut."""
    advantages: torch.Tensor | None = None
    """[B, R] float32 per-token advantages; set by the trainer before the policy update."""
    loss_rows: torch.Tensor | None = None
    """[B] bool, the rows whose tokens enter the loss (``zero_variance_filter`` leaves
    flat groups out); None: every row. Metrics still describe every row."""
    old_logprobs: torch.Tensor | None = None
    """[B, R] float32 logprobs of the policy that is being updated, taken before the
    first optimizer step of this batch; set by the trainer."""
    ref_logprobs: torch.Tensor | None = None
    """[B, R] float32 logprobs of the reference policy (the run's initial weights); set
    by the trainer when a KL loss needs them."""
    trajectory_rows: torch.Tensor | None = None
    """[B] int64, each row's trajectory as its index in the step's collated batch
    (``convert_to_training_batch``'s order, the index its ``CollationError`` names).
    A row tensor so the driver's data-parallel reorder and every slice carry it: a
    worker's route refusal then names the trajectory, not its row in one rank's shard
    (``trajectory_ids``). None for a batch built by hand."""

    @property
    def batch_size(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def num_actions(self) -> int:
        return int(self.response_mask.shape[1])


def trajectory_ids(batch: TrainingBatch) -> list[str] | None:
    """The names a worker's errors give ``batch``'s rows (``PolicyWorker``'s
    ``trajectory_ids``): ``#i`` for the step's trajectory ``i``; None without
    ``trajectory_rows``."""
    if batch.trajectory_rows is None:
        return None
    return [f"#{row}" for row in batch.trajectory_rows.tolist()]


def training_loss_mask(batch: TrainingBatch) -> torch.Tensor:
    """``[B, R]`` the tokens the loss trains on: ``loss_mask`` on ``loss_rows``."""
    if batch.loss_rows is None:
        return batch.loss_mask
    return batch.loss_mask * batch.loss_rows.to(batch.loss_mask.dtype)[:, None]


def map_tensors(batch: TrainingBatch, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainingBatch:
    """A copy of ``batch`` with ``fn`` applied to every tensor field (routes included):
    a row selection (``[slice]``, ``[index]``) or ``.to(device)``, which packed routes
    (``PackedRouteRows``) answer like a tensor."""
    values = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        row_field = isinstance(value, torch.Tensor | PackedRouteRows)
        values[f.name] = fn(value) if row_field else value  # type: ignore[arg-type]
    return TrainingBatch(**values)


def slice_batch(batch: TrainingBatch, start: int, stop: int) -> TrainingBatch:
    """Rows ``[start, stop)`` of every per-row tensor (routes included)."""
    return map_tensors(batch, lambda t: t[start:stop])


def select_rows(batch: TrainingBatch, rows: torch.Tensor) -> TrainingBatch:
    """Rows ``rows`` (an index tensor) of every per-row field, routes included: a copy
    that owns exactly its rows (a slice is a view, and pickling a view ships its whole
    storage)."""
    return map_tensors(batch, lambda t: t[rows])


def batch_to(batch: TrainingBatch, device: torch.device) -> TrainingBatch:
    """Every tensor of ``batch`` on ``device`` (no copy for tensors already there)."""
    return map_tensors(batch, lambda t: t.to(device))


def shard_for_data_parallel_rank(
    batch: TrainingBatch, *, rank: int, world_size: int
) -> TrainingBatch:
    """This data-parallel rank's contiguous block of rows, routes included.

    The driver sends each rank only its own shard: broadcasting every route to every
    rank is what ran other frameworks' hosts out of memory.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected in [0, {world_size}), got {rank}")
    if batch.batch_size % world_size:
        raise ValueError(
            f"batch_size: expected a multiple of the data-parallel size {world_size}, "
            f"got {batch.batch_size}"
        )
    per_rank = batch.batch_size // world_size
    return slice_batch(batch, rank * per_rank, (rank + 1) * per_rank)

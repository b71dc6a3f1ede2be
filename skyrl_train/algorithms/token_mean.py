"""The loss's token mean over a global mini-batch, however a backend splits it.

The contract, for every trainer backend. An optimizer step trains on one global
mini-batch of N loss-active tokens (``training_loss_mask``; the driver counts N per
mini-batch before sharding, ``trainer/data_parallel.mini_batch_token_counts``). Its
loss is the token mean: the sum of the per-token losses over those N tokens, over N.
The mini-batch's rows are split over ``dp_size`` data-parallel ranks, and each rank's
share into the microbatches of a ``workers/microbatches.MicrobatchPlan``: groups of
rows, by a row count (``num_microbatches(rows, micro_batch_size)`` of them) or by a
token budget, the same count on every rank (``trainer/microbatch_plan.py`` agrees it).
Three parties each divide by one factor:

1. The loss function divides each microbatch's token sum by
   ``microbatch_denominator(N, microbatches=..., dp_size=...)`` = N / (microbatches *
   dp_size), ``microbatches`` the plan's count (``trainer/policy.py``).
2. The backend accumulates the microbatches' gradients as their mean: each
   microbatch's loss times 1 / microbatches. A schedule that divides by another count
   (Megatron's, by its padded microbatch count: ``workers/megatron/schedule.py``)
   multiplies the loss by ``microbatch_loss_weight`` first.
3. The backend sums each gradient over the data-parallel ranks and divides it by
   ``dp_size`` (``data_parallel_mean_``: ``workers/megatron/gradients.py``).

The gradient is then d/dθ of sum / N, whichever way the rows were split (which
rows share a microbatch, in which order, how many tokens each holds), and the
mean of a rank's microbatch losses is its share of the token mean times ``dp_size``:
summed over the ranks and divided by their step count it is the mini-batch's token
mean (``train/policy_loss``). A mean of per-rank or per-microbatch token means
instead over-weights the tokens of short responses. A mini-batch with N = 0 takes no
step (Adam's momentum alone would move the weights), on every rank alike.
"""

from __future__ import annotations

import torch


def num_microbatches(rows: int, *, micro_batch_size: int) -> int:
    """Microbatches a rank cuts ``rows`` into, ``micro_batch_size`` rows each and the
    rest in the last one."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected a positive int, got {micro_batch_size}")
    return -(-rows // micro_batch_size)


def microbatch_denominator(global_tokens: float, *, microbatches: int, dp_size: int) -> float:
    """What one microbatch's loss divides its token sum by: the global mini-batch's
    ``global_tokens`` over the ``microbatches`` a rank averages (its plan's count, the
    same on every rank) and the ``dp_size`` ranks whose gradients are averaged."""
    if microbatches < 1:
        raise ValueError(f"microbatches: expected a positive int, got {microbatches}")
    if dp_size < 1:
        raise ValueError(f"dp_size: expected a positive int, got {dp_size}")
    return global_tokens / (microbatches * dp_size)


def microbatch_loss_weight(*, microbatches: int, divided_by: int) -> float:
    """The factor for each of ``microbatches`` real microbatch losses, in a schedule
    that divides every loss by ``divided_by`` (Megatron's: its microbatch count with
    fillers), so that their gradients accumulate to the real microbatches' mean."""
    if microbatches < 1 or divided_by < microbatches:
        raise ValueError(
            f"divided_by: expected at least microbatches={microbatches} (>= 1), got {divided_by}"
        )
    return divided_by / microbatches


def data_parallel_mean_(grad: torch.Tensor, *, dp_size: int) -> None:
    """Turn ``grad``, summed over the ``dp_size`` data-parallel ranks the mini-batch's
    rows were split over, into their mean, in place."""
    if dp_size > 1:
        grad.div_(dp_size)

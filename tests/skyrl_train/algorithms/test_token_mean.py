"""The loss normalisation every backend follows (``algorithms/token_mean``): a global
mini-batch split over data-parallel ranks and ragged microbatches, each loss divided
by ``microbatch_denominator``, accumulated through a schedule that divides by a
padded count (``microbatch_loss_weight``) and averaged over the ranks
(``data_parallel_mean_``), gives the gradient and the loss of the whole mini-batch's
token mean."""

from __future__ import annotations

import pytest
import torch

from skyrl_train.algorithms import (
    data_parallel_mean_,
    microbatch_denominator,
    microbatch_loss_weight,
    num_microbatches,
)

ROWS, R, D = 6, 4, 3


def _token_losses(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x @ w).pow(2)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, R, D, generator=gen, dtype=torch.float64)
    # Responses of very different lengths: a mean of per-rank or per-microbatch token
    # means would weigh their tokens unequally.
    lengths = [4, 1, 3, 0, 2, 4]
    mask = (torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)
    return x, mask


@pytest.mark.parametrize(("dp", "micro", "padded"), [(1, 6, 1), (2, 2, 3), (3, 1, 4), (2, 3, 1)])
def test_a_split_mini_batch_trains_on_its_token_mean(dp: int, micro: int, padded: int) -> None:
    x, mask = _data()
    w0 = torch.randn(D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = w0.clone().requires_grad_(True)
    want = (_token_losses(whole, x) * mask).sum() / mask.sum()
    want.backward()

    global_tokens = float(mask.sum())
    per_rank = ROWS // dp
    summed = torch.zeros(D, dtype=torch.float64)
    reported = []
    for rank in range(dp):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        count = num_microbatches(per_rank, micro_batch_size=micro)
        denominator = microbatch_denominator(global_tokens, microbatches=count, dp_size=dp)
        # A schedule that divides every microbatch loss by its own count, fillers
        # included (Megatron's), as the backend runs it.
        divided_by = count + padded - 1
        weight = microbatch_loss_weight(microbatches=count, divided_by=divided_by)
        w = w0.clone().requires_grad_(True)
        losses = []
        for start in range(0, per_rank, micro):
            part = slice(rows.start + start, min(rows.start + start + micro, rows.stop))
            loss = (_token_losses(w, x[part]) * mask[part]).sum() / denominator
            losses.append(float(loss.detach()))
            (loss * weight / divided_by).backward()
        assert w.grad is not None
        summed += w.grad  # the all-reduce over the data-parallel group
        reported.append(sum(losses) / len(losses))
    data_parallel_mean_(summed, dp_size=dp)
    assert whole.grad is not None
    assert torch.allclose(summed, whole.grad, rtol=1e-12, atol=0)
    # Each rank reports the mean of its microbatch losses; summed over the ranks and
    # divided by their step counts (one each), that is the mini-batch's token mean.
    assert sum(reported) / dp == pytest.approx(float(want.detach()), rel=1e-12)


def test_the_rules_refuse_counts_that_cannot_be() -> None:
    with pytest.raises(ValueError, match="micro_batch_size: expected a positive int, got 0"):
        num_microbatches(4, micro_batch_size=0)
    with pytest.raises(ValueError, match="dp_size: expected a positive int, got 0"):
        microbatch_denominator(10.0, microbatches=2, dp_size=0)
    with pytest.raises(ValueError, match="microbatches: expected a positive int, got 0"):
        microbatch_denominator(10.0, microbatches=0, dp_size=1)
    with pytest.raises(ValueError, match="divided_by: expected at least microbatches=3"):
        microbatch_loss_weight(microbatches=3, divided_by=2)
    assert num_microbatches(5, micro_batch_size=2) == 3

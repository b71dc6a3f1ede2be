"""Driver-side data parallelism: shard order, token counts, combining rank metrics,
and the per-rank checkpoint checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.rank_state import checkpoint_file, load_rank_state, save_rank_state
from skyrl_train.trainer.data_parallel import (
    combine_rank_metrics,
    mini_batch_order,
    mini_batch_token_counts,
    shard_mini_batches,
)


def _batch(rows: int, *, seq: int = 6, actions: int = 3, layers: int = 2, k: int = 2):
    ids = torch.arange(rows)
    sequences = ids[:, None].repeat(1, seq)  # row b holds b everywhere: easy to trace
    loss_mask = (torch.arange(actions)[None, :] < (ids % actions + 1)[:, None]).long()
    return TrainingBatch(
        sequences=sequences,
        attention_mask=torch.ones(rows, seq, dtype=torch.int64),
        response_mask=torch.ones(rows, actions, dtype=torch.int64),
        loss_mask=loss_mask,
        rewards=ids.float(),
        token_rewards=torch.zeros(rows, actions),
        routed_experts=ids[:, None, None, None].repeat(1, seq, layers, k).to(torch.uint8),
        router_padding_mask=torch.zeros(rows, seq, dtype=torch.bool),
        advantages=ids[:, None].float().repeat(1, actions),
    )


def test_order_gives_each_rank_its_part_of_every_mini_batch() -> None:
    order = mini_batch_order(8, mini_batch_size=4, dp_size=2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert mini_batch_order(6, mini_batch_size=6, dp_size=3).tolist() == [0, 1, 2, 3, 4, 5]


def test_shards_have_equal_shapes_and_only_their_own_rows() -> None:
    full = _batch(8)
    shards = shard_mini_batches(full, mini_batch_size=4, dp_size=2)
    assert [s.batch_size for s in shards] == [4, 4]
    for s in shards:
        # Same padded widths on every rank: EP ranks gather each other's tokens.
        assert s.sequences.shape == (4, full.sequences.shape[1])
        assert s.routed_experts is not None and s.routed_experts.shape[1:] == (6, 2, 2)
    rank_rows = [s.sequences[:, 0].tolist() for s in shards]
    assert rank_rows == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for s, rows in zip(shards, rank_rows, strict=True):
        # Every per-row tensor moved together, routes and advantages included.
        assert s.rewards.tolist() == [float(r) for r in rows]
        assert s.routed_experts[:, 0, 0, 0].tolist() == rows
        assert s.advantages is not None and s.advantages[:, 0].tolist() == rows
    assert sorted(sum(rank_rows, [])) == list(range(8))


def test_one_rank_gets_the_batch_unchanged() -> None:
    full = _batch(4)
    (only,) = shard_mini_batches(full, mini_batch_size=2, dp_size=1)
    assert only is full


@pytest.mark.parametrize(
    ("rows", "mini", "dp", "field"),
    [(6, 4, 2, "mini_batch_size"), (8, 4, 3, "dp_size"), (8, 0, 1, "mini_batch_size")],
)
def test_sizes_that_do_not_divide_are_refused(rows: int, mini: int, dp: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        shard_mini_batches(_batch(rows), mini_batch_size=mini, dp_size=dp)


def test_token_counts_are_per_global_mini_batch() -> None:
    full = _batch(6)  # loss tokens per row: 1, 2, 3, 1, 2, 3
    assert mini_batch_token_counts(full, mini_batch_size=3) == [6.0, 6.0]
    assert mini_batch_token_counts(full, mini_batch_size=2) == [3.0, 4.0, 5.0]


def test_token_counts_and_shards_follow_the_loss_rows() -> None:
    # Rows 0, 1 and 5 left out of the loss (zero_variance_filter / skip_flat_steps):
    # each rank divides by the tokens that train, and a mini-batch of none skips.
    full = _batch(6)
    full.loss_rows = torch.tensor([False, False, True, True, True, False])
    assert mini_batch_token_counts(full, mini_batch_size=2) == [0.0, 4.0, 2.0]
    shards = shard_mini_batches(full, mini_batch_size=2, dp_size=2)
    for shard in shards:
        for row, keep in zip(shard.sequences[:, 0].tolist(), shard.loss_rows.tolist(), strict=True):
            assert keep == bool(full.loss_rows[row])


def test_combine_weights_means_by_rows_tokens_and_token_layers() -> None:
    rank0 = {
        "train/num_rows": 2.0,
        "train/policy_loss": 1.0,
        "mismatch_trained/mean_abs_logp_diff": 0.5,
        "mismatch_trained/max_abs_logp_diff": 2.0,
        "mismatch_trained/num_tokens": 10.0,
        "r3/router_agreement_native": 0.9,
        "r3/router_agreement_trained": 1.0,
        "r3/num_token_layers": 40.0,
    }
    rank1 = {
        "train/num_rows": 6.0,
        "train/policy_loss": 3.0,
        "mismatch_trained/mean_abs_logp_diff": 0.1,
        "mismatch_trained/max_abs_logp_diff": 3.0,
        "mismatch_trained/num_tokens": 30.0,
        "r3/router_agreement_native": 0.5,
        "r3/router_agreement_trained": 1.0,
        "r3/num_token_layers": 120.0,
    }
    got = combine_rank_metrics([rank0, rank1])
    assert got["train/num_rows"] == 8.0
    assert got["train/policy_loss"] == pytest.approx((2 * 1.0 + 6 * 3.0) / 8)
    assert got["mismatch_trained/mean_abs_logp_diff"] == pytest.approx((10 * 0.5 + 30 * 0.1) / 40)
    assert got["mismatch_trained/max_abs_logp_diff"] == 3.0
    assert got["mismatch_trained/num_tokens"] == 40.0
    assert got["r3/router_agreement_native"] == pytest.approx((40 * 0.9 + 120 * 0.5) / 160)
    assert got["r3/router_agreement_trained"] == 1.0
    assert got["r3/num_token_layers"] == 160.0


def test_combine_with_no_tokens_anywhere_is_a_plain_mean() -> None:
    ranks = [
        {"train/num_rows": 1.0, "mismatch_trained/k3_kl": 0.0, "mismatch_trained/num_tokens": 0.0},
        {"train/num_rows": 1.0, "mismatch_trained/k3_kl": 0.0, "mismatch_trained/num_tokens": 0.0},
    ]
    assert combine_rank_metrics(ranks)["mismatch_trained/k3_kl"] == 0.0


def test_one_rank_passes_through() -> None:
    metrics = {"train/num_rows": 4.0, "train/grad_norm": 0.25, "r3/router_agreement_trained": 1.0}
    assert combine_rank_metrics([metrics]) == metrics


def test_combine_refuses_a_rank_without_rows_and_non_finite_values() -> None:
    with pytest.raises(ValueError, match=r"^per_rank\[1\]: expected a 'train/num_rows'"):
        combine_rank_metrics([{"train/num_rows": 1.0}, {"train/policy_loss": 1.0}])
    with pytest.raises(ValueError, match="train/policy_loss"):
        combine_rank_metrics([{"train/num_rows": 1.0, "train/policy_loss": float("nan")}])


def test_checkpoint_of_a_missing_rank_or_other_world_size_is_refused(tmp_path: Path) -> None:
    save_rank_state(checkpoint_file(tmp_path, 0), {"world_size": 2, "model": {}})
    assert load_rank_state(tmp_path, rank=0, world_size=2)["world_size"] == 2
    with pytest.raises(CheckpointError, match=r"^trainer.resume_from: .*policy_rank1.pt: expected"):
        load_rank_state(tmp_path, rank=1, world_size=2)
    with pytest.raises(ConfigValidationError, match="world size 2") as info:
        load_rank_state(tmp_path, rank=0, world_size=1)
    assert info.value.path == "trainer.placement.num_trainers"

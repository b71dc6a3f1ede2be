"""Driver-side data parallelism: shard order, token counts, combining rank metrics,
and the per-rank checkpoint checks."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _stand_in_worker import StandInWorker, check_stand_in

from skyrl_train.algorithms import MetricSums
from skyrl_train.config.compose import load_config
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
from skyrl_train.runs.resume import load_rank_state
from skyrl_train.trainer.data_parallel import (
    combine_rank_metrics,
    mini_batch_order,
    mini_batch_token_counts,
    shard_mini_batches,
)
from skyrl_train.trainer.policy import PolicyTrainer, RankInfo
from skyrl_train.workers.base import ForwardResult, TrainStepResult
from skyrl_train.workers.batch_layout import split_microbatches
from skyrl_train.workers.microbatches import MicrobatchPlan


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


@pytest.mark.parametrize("packed", [False, True], ids=["rectangle", "packed"])
def test_each_shard_pickles_only_its_own_rows(packed: bool) -> None:
    """A shard that is a view of the whole batch pickles (ray.put) the whole storage:
    every rank would receive every rank's routes. Each shard owns just its rows."""
    import dataclasses
    import pickle

    from skyrl_train.dataset.route_rows import PackedRouteRows

    full = _batch(64, seq=32, layers=4, k=4)
    if packed:
        rows = PackedRouteRows.from_rectangle(full.routed_experts, full.attention_mask)
        full = dataclasses.replace(full, routed_experts=rows)
    whole = len(pickle.dumps(full))
    shards = shard_mini_batches(full, mini_batch_size=16, dp_size=4)
    sizes = [len(pickle.dumps(s)) for s in shards]
    assert max(sizes) < 0.35 * whole, (sizes, whole)
    for s in shards:
        routes = s.routed_experts.values if packed else s.routed_experts
        assert routes.untyped_storage().nbytes() == routes.numel() * routes.element_size()


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


def test_combine_sums_each_mean_over_its_own_denominator() -> None:
    # The case: rank 0 keeps 2 of its 10 tokens at weight 1.05, rank 1 (its
    # sequences masked) keeps none of its 10. Weighted by loss tokens the ranks' means
    # gave 0.525; the whole batch's weight mean is 1.05.
    ranks = []
    for kept, weight_sum in ((2.0, 2.1), (0.0, 0.0)):
        m = MetricSums()
        m.total("train/num_rows", 4.0)
        m.total("off_policy/num_tokens", 10.0)
        m.mean("off_policy/weight_mean", weight_sum, kept)
        m.maximum("mismatch_trained/max_abs_logp_diff", 2.0 + kept)
        ranks.append(m)
    assert combine_rank_metrics(ranks) == {
        "mismatch_trained/max_abs_logp_diff": 4.0,
        "off_policy/num_tokens": 20.0,
        "off_policy/weight_mean": pytest.approx(1.05),
        "train/num_rows": 8.0,
    }


def test_combine_refuses_plain_dicts() -> None:
    # A plain dict no longer says what its means were divided by.
    with pytest.raises(ValueError, match=r"^per_rank\[0\]: expected MetricSums"):
        combine_rank_metrics([{"train/num_rows": 1.0}])  # type: ignore[list-item]


def test_checkpoint_of_a_missing_rank_or_other_world_size_is_refused(tmp_path: Path) -> None:
    save_rank_state(checkpoint_file(tmp_path, 0), {"world_size": 2, "model": {}})
    assert load_rank_state(tmp_path, rank=0, world_size=2)["world_size"] == 2
    with pytest.raises(CheckpointError, match=r"^trainer.resume_from: .*policy_rank1.pt: expected"):
        load_rank_state(tmp_path, rank=1, world_size=2)
    with pytest.raises(ConfigValidationError, match="world size 2") as info:
        load_rank_state(tmp_path, rank=0, world_size=1)
    assert info.value.path == "trainer.placement.num_trainers"


# ---- one rank on the whole batch == two ranks on its halves, every metric key ---------

PROMPTS, SAMPLES, MINI_PROMPTS, WIDTH, PROMPT_LEN, LAYERS, K = 4, 2, 2, 5, 3, 2, 2
ROWS = PROMPTS * SAMPLES


class RowTableWorker(StandInWorker):
    """A stand-in ``PolicyWorker`` (its forward/train_step contract) whose
    every output is a table indexed by row id (``sequences[:, 0]``), so a row gives the
    same numbers on whichever rank it lands: logprobs (old, current, reference),
    entropy, and the routes a replayed and a native forward dispatch. ``train_step``
    calls the loss on microbatches of ``micro_batch_size`` rows and returns the mean of
    their losses, as the real worker does; its grad norm is a constant, since the real
    one is all-reduced and the same on every rank."""

    def __init__(self, tables: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tables = tables
        self.old = tables["old"]

    def forward(
        self,
        batch: TrainingBatch,
        *,
        replay_routes: bool | None = False,
        capture_routes: bool = False,
        entropy: bool = False,
        **options: Any,
    ) -> ForwardResult:
        rows = batch.sequences[:, 0]
        routes = self.tables["trained_routes" if replay_routes else "native_routes"][rows]
        return ForwardResult(
            logprobs=self.old[rows] * batch.response_mask,
            routes=routes if capture_routes else None,
            entropy=self.tables["entropy"][rows] * batch.response_mask if entropy else None,
        )

    @contextmanager
    def swapped_weights(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        own, self.old = self.old, weights["table"]
        try:
            yield
        finally:
            self.old = own

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: Any,
        micro_batch_size: int | MicrobatchPlan,
        **options: Any,
    ) -> TrainStepResult:
        micro = split_microbatches(batch, micro_batch_size)
        losses = []
        for mb in micro:
            rows = mb.sequences[:, 0]
            logprobs = self.tables["current"][rows] * mb.response_mask
            # The entropy bonus's per-token entropy, when the trainer asks for it.
            extra = [self.tables["entropy"][rows] * mb.response_mask] if options["entropy"] else []
            losses.append(float(loss_fn(logprobs, mb, *extra)))
        return TrainStepResult(
            loss=sum(losses) / len(losses),
            grad_norm=0.5,
            num_microbatches=len(micro),
            replayed=True,
            lr=1e-3,
        )

    def scheduled_lr(self) -> float:
        return 1e-3


def _uneven_batch(generator: torch.Generator) -> tuple[TrainingBatch, dict[str, torch.Tensor]]:
    # Rank 0 trains rows 0, 1, 4, 5 (mini_batch_order): 1-2 response tokens each; rank 1
    # rows 2, 3, 6, 7: 4-5 tokens, one of them an observation (loss mask 0). Rows 2-3 are
    # a flat group left out of the loss (loss_rows), and 3 rollout logprobs are the
    # engine's placeholder, all on rank 1.
    lengths = [1, 2, 5, 4, 2, 1, 5, 5]
    seq = PROMPT_LEN + WIDTH
    response = torch.zeros(ROWS, WIDTH, dtype=torch.int64)
    for r, n in enumerate(lengths):
        response[r, :n] = 1
    loss_mask = response.clone()
    loss_mask[[2, 6, 7], 1] = 0
    attention = torch.cat([torch.ones(ROWS, PROMPT_LEN, dtype=torch.int64), response], dim=1)
    sequences = torch.ones(ROWS, seq, dtype=torch.int64)
    sequences[:, 0] = torch.arange(ROWS)
    old = -torch.rand(ROWS, WIDTH, generator=generator) * 2 - 0.1
    # Ratios exp(old - rollout) from about 0.2 to 5: some tokens outside the band below.
    rollout = old - torch.randn(ROWS, WIDTH, generator=generator) * 0.8
    rollout[3, 2] = rollout[6, 0] = rollout[7, 4] = -9999.0
    routes = torch.randint(0, 6, (ROWS, seq, LAYERS, K), generator=generator)
    flips = torch.rand(ROWS, seq, LAYERS, 1, generator=generator)
    tables = {
        "old": old,
        "current": old + torch.randn(ROWS, WIDTH, generator=generator) * 0.3,
        "reference": old + torch.randn(ROWS, WIDTH, generator=generator) * 0.5,
        "entropy": torch.rand(ROWS, WIDTH, generator=generator) * 3,
        "trained_routes": torch.where(flips < 0.05, (routes + 1) % 6, routes),
        "native_routes": torch.where(flips < 0.3, (routes + 1) % 6, routes),
    }
    batch = TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response,
        loss_mask=loss_mask,
        rewards=torch.zeros(ROWS),
        token_rewards=torch.zeros(ROWS, WIDTH),
        rollout_logprobs=rollout,
        routed_experts=routes,
        router_padding_mask=~attention.bool(),
        advantages=torch.randn(ROWS, 1, generator=generator) * loss_mask,
        loss_rows=torch.tensor([True, True, False, False, True, True, True, True]),
    )
    return batch, tables


def _rank(
    tmp_path: Path, tables: dict[str, torch.Tensor], dp_rank: int, dp: int, budget: int = -1
) -> Any:
    cfg = load_config(
        [
            f"trainer.max_tokens_per_microbatch={budget}",
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={MINI_PROMPTS}",
            "trainer.micro_train_batch_size_per_gpu=1",
            "trainer.update_epochs_per_batch=2",
            f"generator.n_samples_per_prompt={SAMPLES}",
            "trainer.algorithm.use_kl_loss=true",
            "trainer.algorithm.off_policy_correction.tis_ratio_type=token",
            "trainer.algorithm.off_policy_correction.outlier_token_is_threshold_high=4.5",
            "trainer.algorithm.off_policy_correction.token_mask_is_threshold_low=0.4",
            "trainer.algorithm.off_policy_correction.token_mask_is_threshold_high=3.0",
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    trainer.worker = check_stand_in(RowTableWorker(tables))
    trainer.reference = {"table": tables["reference"]}
    trainer.info = RankInfo(rank=dp_rank, world_size=dp, dp_rank=dp_rank, dp_size=dp, ep_size=1)
    return trainer


# 12 tokens: the whole first mini-batch (rows of 4, 5, 8, 7 tokens) runs as rows
# (0, 2) and (1, 3), while its rank shards need 1 and 2 microbatches (no process group
# here to agree them): the token mean holds whatever the count and order.
@pytest.mark.parametrize("budget", [-1, 12])
def test_two_ranks_with_uneven_masks_combine_to_the_whole_batchs_metrics(
    tmp_path: Path, budget: int
) -> None:
    batch, tables = _uneven_batch(torch.Generator().manual_seed(0))
    whole = _rank(tmp_path, tables, 0, 1, budget).train(copy.deepcopy(batch), step=1)

    mini = MINI_PROMPTS * SAMPLES
    shards = shard_mini_batches(batch, mini_batch_size=mini, dp_size=2)
    tokens = mini_batch_token_counts(batch, mini_batch_size=mini)
    per_rank = [
        _rank(tmp_path, tables, r, 2, budget).train(shard, step=1, mini_batch_tokens=tokens)
        for r, shard in enumerate(shards)
    ]
    combined = combine_rank_metrics(per_rank)

    expected = dict(whole)
    assert sorted(combined) == sorted(expected)
    for key, value in expected.items():
        assert combined[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # The batch is uneven where it matters: the ranks' own values differ, and each
    # family of metrics is present (R3, mismatch, KL, entropy, off-policy, loss).
    rank0, rank1 = per_rank
    for key in ("off_policy/weight_mean", "train/tis_weight_mean", "policy/clip_fraction"):
        assert rank0[key] != pytest.approx(rank1[key]), key
    assert rank0["off_policy/num_tokens"] < rank1["off_policy/num_tokens"]
    assert (
        rank1["off_policy/placeholder_token_frac"] > 0 == rank0["off_policy/placeholder_token_frac"]
    )
    assert 0 < expected["off_policy/token_mask_frac"] < 1
    for prefix in ("r3/", "mismatch_native/", "mismatch_trained/", "policy/kl_to_ref"):
        assert any(key.startswith(prefix) for key in expected), prefix

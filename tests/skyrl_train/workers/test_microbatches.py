"""``MicrobatchPlan`` (``workers/microbatches.py``): row groups by a row count or by a
token budget, split to an agreed count, and per-microbatch results put back in batch
order; every bad input refused naming what it expected."""

from __future__ import annotations

import pytest
import torch

from skyrl_train.workers.microbatches import MicrobatchPlan, row_tokens

LENGTHS = [5, 40, 7, 12, 30, 3, 9]


def _covers_every_row_once(plan: MicrobatchPlan, rows: int) -> None:
    flat = sorted(row for group in plan.groups for row in group)
    assert flat == list(range(rows))


def test_by_rows_is_consecutive_slices_the_last_shorter() -> None:
    plan = MicrobatchPlan.by_rows(5, 2)
    assert plan.groups == ((0, 1), (2, 3), (4,))
    assert plan.count == 3 and plan.rows == 5 and plan.is_consecutive
    assert MicrobatchPlan.by_rows(5, None).groups == ((0, 1, 2, 3, 4),)
    assert MicrobatchPlan.by_rows(3, 8).groups == ((0, 1, 2),)


def test_by_tokens_keeps_every_microbatch_under_the_budget_a_longer_row_alone() -> None:
    plan = MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20)
    _covers_every_row_once(plan, len(LENGTHS))
    alone = {1, 4}  # 40 and 30 tokens: over the budget, each in its own microbatch
    for group in plan.groups:
        tokens = sum(LENGTHS[r] for r in group)
        if set(group) & alone:
            assert len(group) == 1
        else:
            assert tokens <= 20, (group, tokens)
    assert {(1,), (4,)} <= set(plan.groups)
    # First fit, longest first: 12+7 | 9+5+3, and the two long rows.
    assert plan.count == 4
    assert not plan.is_consecutive


def test_by_tokens_splits_its_fullest_microbatches_to_an_agreed_count() -> None:
    own = MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20)
    for count in range(own.count, len(LENGTHS) + 1):
        plan = MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20, count=count)
        assert plan.count == count
        _covers_every_row_once(plan, len(LENGTHS))
        # Splitting only shrinks microbatches: none goes over the budget it kept.
        for group in plan.groups:
            assert len(group) == 1 or sum(LENGTHS[r] for r in group) <= 20
    every_row = MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20, count=len(LENGTHS))
    assert all(len(group) == 1 for group in every_row.groups)


def test_by_tokens_is_deterministic_whatever_the_ties() -> None:
    lengths = [4, 4, 4, 4, 8, 8]
    plans = {MicrobatchPlan.by_tokens(lengths, max_tokens=12, count=4) for _ in range(5)}
    assert len(plans) == 1
    # A row count and a one-row budget cut the same rows alike.
    assert MicrobatchPlan.by_tokens(lengths, max_tokens=1).count == len(lengths)


def test_row_tokens_counts_real_tokens() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    assert row_tokens(mask) == [2, 4, 1]
    assert row_tokens(mask.to(torch.bool)) == [2, 4, 1]


def test_in_batch_order_undoes_the_plans_reordering() -> None:
    plan = MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20)
    values = torch.arange(len(LENGTHS), dtype=torch.float32) * 10
    parts = [values[list(group)] for group in plan.groups]
    assert torch.equal(plan.in_batch_order(parts), values)
    # Trailing dimensions travel with their row.
    wide = torch.arange(len(LENGTHS) * 3).reshape(len(LENGTHS), 3)
    assert torch.equal(plan.in_batch_order([wide[list(g)] for g in plan.groups]), wide)
    consecutive = MicrobatchPlan.by_rows(len(LENGTHS), 3)
    assert torch.equal(
        consecutive.in_batch_order([values[list(g)] for g in consecutive.groups]), values
    )


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (((0, 1), ()), r"groups\[1\]: expected at least one row, got none"),
        (((0, 1), (1,)), r"groups\[1\]: expected each row once and >= 0, got row 1 again"),
        (((0, -1),), r"groups\[0\]: expected rows >= 0, got -1"),
        (((0, 2),), r"groups: expected rows 0..1, missing \[1\]"),
    ],
)
def test_a_plan_that_loses_or_repeats_a_row_is_refused(
    groups: tuple[tuple[int, ...], ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        MicrobatchPlan(groups)


def test_bad_budgets_and_counts_are_refused_naming_the_key() -> None:
    for bad in (0, -1, True, 2.5):
        with pytest.raises(
            ValueError, match="trainer.max_tokens_per_microbatch: expected a positive int"
        ):
            MicrobatchPlan.by_tokens(LENGTHS, max_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lengths: expected at least one row, got none"):
        MicrobatchPlan.by_tokens([], max_tokens=8)
    with pytest.raises(ValueError, match=r"count: expected between 4 .* and 7 .*, got 8"):
        MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20, count=8)
    with pytest.raises(ValueError, match=r"count: expected between 4 .* got 3"):
        MicrobatchPlan.by_tokens(LENGTHS, max_tokens=20, count=3)
    for bad_size in (0, -2, True):
        with pytest.raises(ValueError, match="micro_batch_size: expected a positive int"):
            MicrobatchPlan.by_rows(4, bad_size)  # type: ignore[arg-type]

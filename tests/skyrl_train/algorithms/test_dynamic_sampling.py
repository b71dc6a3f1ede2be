"""Dynamic sampling plans (filter, replace) and the output surgery they drive."""

from __future__ import annotations

import random

import numpy as np
import pytest

from skyrl_train.algorithms.dynamic_sampling import (
    plan_filter,
    plan_replace,
    trajectory_indices,
    varying_groups,
)
from skyrl_train.generators.base import GeneratorOutput, concat_outputs


def test_varying_groups_marks_groups_whose_rewards_differ() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.2, 0.3]
    assert varying_groups(rewards, 2) == [True, False, False, True]
    assert varying_groups(rewards, 4) == [True, True]
    assert varying_groups([0.7], 1) == [False]  # a group of one is flat


def test_varying_groups_refuses_a_ragged_batch() -> None:
    with pytest.raises(ValueError, match="multiple of group_size 3"):
        varying_groups([1.0, 0.0, 1.0, 0.0], 3)


def test_filter_takes_varying_groups_in_sampled_order_then_fills_with_flat_ones() -> None:
    rounds = [[True, False, False], [False, True, True]]
    assert plan_filter(rounds, 3) == [(0, 0), (1, 1), (1, 2)]
    # Too few vary: the flat ones, in sampled order, fill the batch.
    assert plan_filter([[False, True], [False, False]], 2) == [(0, 1), (0, 0)]
    with pytest.raises(ValueError, match="at least 7 groups in all, got 6"):
        plan_filter(rounds, 7)


def test_replace_copies_varying_groups_over_flat_ones() -> None:
    varying = [True, False, True, False]
    plan = plan_replace(varying, min_replace_ratio=0.5, rng=random.Random(0))
    assert plan[0] == 0 and plan[2] == 2  # varying groups keep their slots
    assert plan[1] in (0, 2) and plan[3] in (0, 2)
    # Deterministic for a seeded rng.
    assert plan == plan_replace(varying, min_replace_ratio=0.5, rng=random.Random(0))


def test_replace_leaves_the_batch_alone_below_the_ratio_or_with_nothing_to_copy() -> None:
    rng = random.Random(0)
    assert plan_replace([True, False, False, False], min_replace_ratio=0.3, rng=rng) == [0, 1, 2, 3]
    assert plan_replace([False, False], min_replace_ratio=0.0, rng=rng) == [0, 1]


def test_trajectory_indices_expand_whole_groups() -> None:
    assert trajectory_indices([2, 0, 2], 2) == [4, 5, 0, 1, 4, 5]


def _output(tag: int, rows: int, *, routes: bool = True) -> GeneratorOutput:
    return GeneratorOutput(
        prompt_token_ids=[[tag, i] for i in range(rows)],
        response_ids=[[tag * 10 + i] for i in range(rows)],
        loss_masks=[[1] for _ in range(rows)],
        rewards=[float(tag * 10 + i) for i in range(rows)],
        token_rewards=[[float(i)] for i in range(rows)],
        stop_reasons=[f"r{tag}{i}" for i in range(rows)],
        rollout_metrics={"generate/wall_s": float(tag)},
        rollout_logprobs=[[-float(i)] for i in range(rows)],
        routed_experts=[np.full((2, 1, 2), tag * 10 + i) for i in range(rows)] if routes else None,
        solved=[i % 2 == 0 for i in range(rows)],
    )


def test_take_moves_every_per_trajectory_field_together() -> None:
    out = _output(1, 4).take([3, 1, 3])
    assert out.rewards == [13.0, 11.0, 13.0]
    assert out.prompt_token_ids == [[1, 3], [1, 1], [1, 3]]
    assert out.stop_reasons == ["r13", "r11", "r13"]
    assert out.rollout_logprobs == [[-3.0], [-1.0], [-3.0]]
    assert out.solved == [False, False, False]
    assert out.routed_experts is not None
    assert [int(r[0, 0, 0]) for r in out.routed_experts] == [13, 11, 13]
    assert out.rollout_metrics == {"generate/wall_s": 1.0}


def test_take_refuses_an_index_outside_the_output() -> None:
    with pytest.raises(IndexError, match=r"0 <= i < 4, got \[4\]"):
        _output(1, 4).take([0, 4])


def test_concat_keeps_order_and_refuses_a_mix_of_present_and_missing_routes() -> None:
    joined = concat_outputs([_output(1, 2), _output(2, 1)])
    assert joined.rewards == [10.0, 11.0, 20.0]
    assert joined.routed_experts is not None and len(joined.routed_experts) == 3
    assert joined.rollout_metrics == {"generate/wall_s": 1.0}
    with pytest.raises(ValueError, match="routed_experts: expected it in every part"):
        concat_outputs([_output(1, 2), _output(2, 1, routes=False)])
    with pytest.raises(ValueError, match="at least one"):
        concat_outputs([])

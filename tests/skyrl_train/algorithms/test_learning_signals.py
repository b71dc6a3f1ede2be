"""Per-step learning signals on constructed inputs: entropy, flat groups, success."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_train.algorithms import (
    ENTROPY_BOOST_CAP,
    contiguous_groups,
    entropy_coefficient,
    mean_token_entropy,
    scheduled_entropy_coef,
    success_rate,
    token_entropy,
    zero_variance_group_fraction,
)


def test_token_entropy_in_nats() -> None:
    log_probs = torch.log_softmax(torch.zeros(2, 3, 8), dim=-1)
    assert torch.allclose(token_entropy(log_probs), torch.full((2, 3), math.log(8)))
    two_way = torch.log(torch.tensor([0.5, 0.5, 0.0, 0.0]))  # log 0 = -inf: adds 0, not NaN
    assert token_entropy(two_way).item() == pytest.approx(math.log(2))
    assert token_entropy(torch.log_softmax(torch.tensor([0.0, -math.inf]), -1)).item() == 0.0


def test_entropy_mean_counts_loss_active_tokens_only() -> None:
    # Generated tokens have entropy ln 2, observation tokens (loss mask 0) ln 16 and
    # padding garbage; only the generated ones may count.
    entropy = torch.tensor([[math.log(2), math.log(16), math.log(2)], [math.log(16), 9.0, 9.0]])
    loss_mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert mean_token_entropy(entropy, loss_mask) == pytest.approx(math.log(2))
    assert mean_token_entropy(entropy, torch.zeros(2, 3)) == 0.0
    with pytest.raises(ValueError, match="^loss_mask:"):
        mean_token_entropy(entropy, torch.ones(2, 2))


def test_zero_variance_groups_are_counted() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.1, 0.1, 0.0, 2.0])
    # groups: {1, 0} varies, {0.5, 0.5} flat, {0.1, 0.1} flat, {0, 2} varies
    assert zero_variance_group_fraction(rewards, contiguous_groups(8, 2)) == 0.5
    assert zero_variance_group_fraction(torch.ones(4), [0, 0, 0, 0]) == 1.0
    assert zero_variance_group_fraction(torch.tensor([0.0, 1.0]), ["a", "b"]) == 1.0  # singletons
    with pytest.raises(ValueError, match="^group_ids:"):
        zero_variance_group_fraction(torch.ones(3), [0, 0])


def test_success_rate_over_reporting_trajectories() -> None:
    assert success_rate([True, False, False, True]) == 0.5
    assert success_rate([True, None, False]) == 0.5  # None: that environment never said
    assert success_rate([None, None]) is None
    assert success_rate([]) is None


def test_entropy_coefficient_rises_only_below_the_target_and_at_most_by_the_cap() -> None:
    assert entropy_coefficient(0.03, target=None, entropy=0.01) == 0.03  # no target
    assert entropy_coefficient(0.03, target=0.3, entropy=0.3) == 0.03  # at it
    assert entropy_coefficient(0.03, target=0.3, entropy=4.5) == 0.03  # above: never less
    assert entropy_coefficient(0.03, target=0.3, entropy=0.1) == pytest.approx(0.09)
    assert entropy_coefficient(0.03, target=0.3, entropy=0.001) == 0.03 * ENTROPY_BOOST_CAP
    assert entropy_coefficient(0.03, target=0.3, entropy=0.0) == 0.03 * ENTROPY_BOOST_CAP


def test_entropy_coefficient_is_zero_at_or_above_the_ceiling() -> None:
    assert entropy_coefficient(0.1, target=None, ceiling=3.0, entropy=3.0) == 0.0  # at it
    assert entropy_coefficient(0.1, target=None, ceiling=3.0, entropy=5.4) == 0.0
    assert entropy_coefficient(0.1, target=None, ceiling=3.0, entropy=2.99) == 0.1
    assert entropy_coefficient(0.1, target=None, ceiling=None, entropy=5.4) == 0.1
    # Below both, the target still raises it.
    assert entropy_coefficient(0.1, target=0.5, ceiling=3.0, entropy=0.25) == pytest.approx(0.2)


def test_the_bonus_schedule_runs_from_the_first_step_to_the_last() -> None:
    def at(step: int, end: float | None = 0.0) -> float:
        return scheduled_entropy_coef(0.1, end=end, step=step, num_steps=5)

    assert [at(s) for s in (1, 2, 3, 4, 5, 9)] == pytest.approx([0.1, 0.075, 0.05, 0.025, 0, 0])
    assert at(3, end=None) == 0.1  # no end: constant
    assert at(3, end=0.3) == pytest.approx(0.2)  # it may rise too
    assert scheduled_entropy_coef(0.1, end=0.0, step=1, num_steps=1) == 0.1  # a one-step run

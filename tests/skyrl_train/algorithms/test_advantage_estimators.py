"""RLOO and REINFORCE++ advantages on hand-worked batches, and the estimator dispatch."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from skyrl_train.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSS_TYPES,
    compute_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
    contiguous_groups,
)
from skyrl_train.config.schema import AlgorithmConfig


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 0.4, 0.4, 7.0])
    ids = ["a"] * 4 + ["b"] * 3 + ["c"] * 2 + ["solo"]
    mask = torch.ones(10, 2)
    mask[0, 1] = 0  # an observation token: no advantage
    adv = compute_rloo_advantages(rewards, mask, ids)
    # a: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3 (and the same twice more)
    # b: 3 - (1 + 2) / 2 = 1.5, 1 - (3 + 2) / 2 = -1.5, 2 - (3 + 1) / 2 = 0
    # c: equal rewards, exactly 0; solo: no other sample, 0
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0.0, 0.0, 0.0, 0.0]
    assert adv[:, 0].tolist() == pytest.approx(expected)
    assert adv[1:, 1].tolist() == pytest.approx(expected[1:])
    assert adv[0, 1].item() == 0.0
    assert adv[7:].abs().sum().item() == 0.0  # exact zeros, no rounding residue
    assert adv.dtype == torch.float32


def test_reinforce_plus_plus_whitens_returns_over_loss_active_tokens() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 9.0])
    mask = torch.tensor(
        [
            [1, 0, 1],  # two generated tokens around an observation: return 1 on both
            [1, 0, 0],  # one token, return 0
            [0, 1, 0],  # one token, return 0.5
            [0, 0, 0],  # nothing generated: its reward must not count
        ]
    )
    adv = compute_reinforce_plus_plus_advantages(rewards, mask, eps=0.0)
    # Token returns 1, 1, 0, 0.5: mean 2.5 / 4 = 0.625; squared deviations
    # 0.140625 * 2 + 0.390625 + 0.015625 = 0.6875; unbiased std sqrt(0.6875 / 3).
    std = math.sqrt(0.6875 / 3)
    a1, a0, a05 = 0.375 / std, -0.625 / std, -0.125 / std
    expected = [[a1, 0.0, a1], [a0, 0.0, 0.0], [0.0, a05, 0.0], [0.0, 0.0, 0.0]]
    assert torch.allclose(adv, torch.tensor(expected), rtol=1e-6, atol=0.0)
    # whitened: mean 0 over the active tokens
    assert adv[mask.bool()].sum().item() == pytest.approx(0.0, abs=1e-6)


def test_reinforce_plus_plus_needs_no_groups_and_equal_returns_score_zero() -> None:
    adv = compute_reinforce_plus_plus_advantages(torch.full((3,), 0.1), torch.ones(3, 2), eps=0.0)
    assert adv.abs().sum().item() == 0.0
    empty = compute_reinforce_plus_plus_advantages(torch.tensor([1.0]), torch.zeros(1, 2))
    assert empty.tolist() == [[0.0, 0.0]]
    one = compute_reinforce_plus_plus_advantages(torch.tensor([2.0]), torch.ones(1, 1))
    assert one.tolist() == [[0.0]]


def test_dispatch_by_estimator_name() -> None:
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.ones(4, 2)
    groups = contiguous_groups(4, 2)
    grpo = compute_advantages("grpo", rewards, mask, groups, norm_by_std=False)
    assert torch.equal(
        grpo, compute_grpo_advantages(rewards, mask, groups, norm_by_std=False).advantages
    )
    assert torch.equal(
        compute_advantages("rloo", rewards, mask, groups),
        compute_rloo_advantages(rewards, mask, groups),
    )
    assert torch.equal(
        compute_advantages("reinforce++", rewards, mask, groups, eps=1e-3),
        compute_reinforce_plus_plus_advantages(rewards, mask, eps=1e-3),
    )
    with pytest.raises(ValueError, match=r"^estimator: expected one of \['grpo'"):
        compute_advantages("gae", rewards, mask, groups)


@pytest.mark.parametrize(
    ("fn", "field"),
    [
        (lambda: compute_rloo_advantages(torch.ones(2), torch.ones(3, 1), [0, 0]), "loss_mask"),
        (lambda: compute_rloo_advantages(torch.ones(2), torch.ones(2, 1), [0]), "group_ids"),
        (
            lambda: compute_reinforce_plus_plus_advantages(
                torch.tensor([1.0, math.inf]), torch.ones(2, 1)
            ),
            "rewards[1]",
        ),
        (
            lambda: compute_reinforce_plus_plus_advantages(
                torch.ones(2), torch.ones(2, 1), eps=-1.0
            ),
            "eps",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_argument(fn, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        fn()


def test_names_agree_with_the_config_schema() -> None:
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(AlgorithmConfig)}
    assert choices["advantage_estimator"] == ADVANTAGE_ESTIMATORS == ("grpo", "rloo", "reinforce++")
    assert choices["policy_loss_type"] == POLICY_LOSS_TYPES == ("regular", "gspo")

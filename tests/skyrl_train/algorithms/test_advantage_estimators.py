"""RLOO, REINFORCE++ and per-turn GRPO advantages on hand-worked batches, and the
estimator dispatch."""

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
    compute_turn_grpo_advantages,
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


def _three_turns(turn_rewards: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of three one-token replies with an observation token after each of the first
    two (positions 0, 2, 4 active); each turn's reward on its reply."""
    mask = torch.tensor([[1, 0, 1, 0, 1]] * len(turn_rewards))
    token_rewards = torch.zeros(mask.shape)
    for b, row in enumerate(turn_rewards):
        token_rewards[b, [0, 2, 4]] = torch.tensor(row, dtype=torch.float32)
    return token_rewards, mask


def test_turn_grpo_scores_each_reply_by_its_own_turns_reward_to_go() -> None:
    # One group, every turn varies: turn t scores r_t + r_t+1 + ... against the group.
    token_rewards, mask = _three_turns([[1, 0, 1], [0, 1, 1], [1, 1, 0]])
    adv = compute_turn_grpo_advantages(token_rewards, mask, [0, 0, 0], norm_by_std=False)
    # to go: [2, 1, 1], [2, 2, 1], [2, 1, 0]: turn 0 is flat in the group and over the
    # batch (0); turn 1 mean 4/3; turn 2 mean 2/3
    assert adv[:, [0, 2, 4]].flatten().tolist() == pytest.approx(
        [0.0, -1 / 3, 1 / 3, 0.0, 2 / 3, 1 / 3, 0.0, -1 / 3, -2 / 3]
    )
    assert adv[:, [1, 3]].abs().sum().item() == 0.0  # observations get nothing
    # Trajectory GRPO gives all three the same 0 (equal totals): no turn is told apart.
    grpo = compute_grpo_advantages(token_rewards.sum(1), mask, [0, 0, 0], norm_by_std=False)
    assert grpo.advantages.abs().sum().item() == 0.0


def test_turn_grpo_scores_a_turn_flat_in_its_group_against_that_turn_over_the_batch() -> None:
    # Group 0 never gets turn 2 right; group 1 does once. Group GRPO scores group 0's
    # turn-2 replies 0 for good; here they are scored against turn 2 over the batch.
    token_rewards, mask = _three_turns([[1, 1, 0], [0, 1, 0], [1, 1, 1], [1, 1, 0]])
    adv = compute_turn_grpo_advantages(token_rewards, mask, [0, 0, 1, 1], norm_by_std=False)
    last = adv[:, 4].tolist()
    # turn 2 over the batch: mean 1/4; group 1 varies: mean 1/2
    assert last == pytest.approx([-0.25, -0.25, 0.5, -0.5])
    # turn 1 (to go [1, 1, 2, 1]): group 0 flat -> batch mean 5/4; group 1 varies
    assert adv[:, 2].tolist() == pytest.approx([-0.25, -0.25, 0.5, -0.5])
    normed = compute_turn_grpo_advantages(token_rewards, mask, [0, 0, 1, 1])
    batch_std = torch.tensor([0.0, 0.0, 1.0, 0.0]).std().item()
    assert normed[0, 4].item() == pytest.approx(-0.25 / (batch_std + 1e-6))
    assert normed[2, 4].item() == pytest.approx(
        0.5 / (torch.tensor([1.0, 0.0]).std().item() + 1e-6)
    )


def test_turn_grpo_with_nothing_to_tell_apart_scores_exact_zeros() -> None:
    # Every turn equal over the whole batch (nothing found yet): exactly 0, eps 0 too.
    token_rewards, mask = _three_turns([[0.1, 0, 0.1]] * 4)
    for eps in (0.0, 1e-6):
        adv = compute_turn_grpo_advantages(token_rewards, mask, [0, 0, 1, 1], eps=eps)
        assert adv.abs().sum().item() == 0.0


def test_turn_grpo_turns_are_runs_of_active_tokens_of_any_length() -> None:
    # Row 0: a 2-token reply, an observation, a 1-token reply; row 1 stops after one turn.
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    token_rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    adv = compute_turn_grpo_advantages(token_rewards, mask, [0, 0], norm_by_std=False)
    # turn 0 to go: 3 and 0 (mean 1.5); turn 1: row 0 only -> its own group and the
    # batch are one sample, 0
    assert adv.tolist() == [[1.5, 1.5, 0.0, 0.0], [-1.5, -1.5, 0.0, 0.0]]


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
    token_rewards = torch.stack([torch.zeros(4), rewards], dim=1)
    assert torch.equal(
        compute_advantages("turn_grpo", rewards, mask, groups, token_rewards=token_rewards),
        compute_turn_grpo_advantages(token_rewards, mask, groups),
    )
    with pytest.raises(ValueError, match=r"^token_rewards: expected \[B, R\] per-turn"):
        compute_advantages("turn_grpo", rewards, mask, groups)
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
        (
            lambda: compute_turn_grpo_advantages(torch.ones(2, 2), torch.ones(2, 3), [0, 0]),
            "token_rewards",
        ),
        (
            lambda: compute_turn_grpo_advantages(
                torch.tensor([[0.0, 1.0], [math.nan, 0.0]]), torch.ones(2, 2), [0, 0]
            ),
            "token_rewards[1, 0]",
        ),
        (
            lambda: compute_turn_grpo_advantages(torch.ones(2, 2), torch.ones(2, 2), [0]),
            "group_ids",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_argument(fn, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        fn()


def test_names_agree_with_the_config_schema() -> None:
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(AlgorithmConfig)}
    estimators = ("grpo", "rloo", "reinforce++", "turn_grpo")
    assert choices["advantage_estimator"] == ADVANTAGE_ESTIMATORS == estimators
    assert choices["policy_loss_type"] == POLICY_LOSS_TYPES == ("regular", "gspo")

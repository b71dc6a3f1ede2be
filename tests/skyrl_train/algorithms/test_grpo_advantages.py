"""GRPO advantages on hand-computed groups."""

from __future__ import annotations

import math
import re

import pytest
import torch

from skyrl_train.algorithms import compute_grpo_advantages, contiguous_groups


def test_group_relative_scores_with_std_normalisation() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    mask = torch.ones(8, 3, dtype=torch.int64)
    mask[0, 2] = 0  # an observation token gets no advantage
    out = compute_grpo_advantages(rewards, mask, contiguous_groups(8, 4), eps=0.0)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 1 all equal.
    expected = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(out.scores, torch.tensor([1, -1, -1, 1, 0, 0, 0, 0]) * expected)
    assert torch.allclose(out.group_mean, torch.tensor([0.5] * 4 + [2.0] * 4))
    assert torch.allclose(out.group_std[:4], torch.full((4,), math.sqrt(1 / 3)))
    assert out.advantages.shape == (8, 3) and out.advantages.dtype == torch.float32
    assert out.advantages[0].tolist() == pytest.approx([expected, expected, 0.0])
    assert torch.equal(out.advantages[4:], torch.zeros(4, 3))


def test_without_std_normalisation_scores_are_centred_rewards() -> None:
    out = compute_grpo_advantages(
        torch.tensor([3.0, 1.0]), torch.ones(2, 1), [0, 0], norm_by_std=False
    )
    assert out.scores.tolist() == [1.0, -1.0]


def test_eps_keeps_tiny_spread_bounded() -> None:
    out = compute_grpo_advantages(
        torch.tensor([1.0, 1.0 + 1e-7]), torch.ones(2, 1), [0, 0], eps=1e-6
    )
    assert out.scores.abs().max() < 0.1


def test_equal_rewards_score_exactly_zero_even_without_eps() -> None:
    # 3 x 0.1 / 3 != 0.1 in floating point; the residue must not become +-0.8.
    out = compute_grpo_advantages(torch.full((3,), 0.1), torch.ones(3, 2), [7, 7, 7], eps=0.0)
    assert out.scores.tolist() == [0.0, 0.0, 0.0]
    assert not torch.isnan(out.advantages).any()


def test_singleton_and_interleaved_hashable_groups() -> None:
    rewards = torch.tensor([1.0, 5.0, 0.0, 9.0])
    out = compute_grpo_advantages(
        rewards, torch.ones(4, 1), ["a", "b", "a", "solo"], norm_by_std=False
    )
    # "a": mean 0.5; "b" and "solo" are groups of one: no baseline, score 0.
    assert out.scores.tolist() == [0.5, 0.0, -0.5, 0.0]
    assert out.group_std[1].item() == 0.0
    tensor_ids = compute_grpo_advantages(rewards, torch.ones(4, 1), torch.tensor([0, 1, 0, 2]))
    assert torch.isfinite(tensor_ids.scores).all()


def test_bool_loss_mask_and_all_masked_rows() -> None:
    mask = torch.zeros(2, 4, dtype=torch.bool)
    out = compute_grpo_advantages(torch.tensor([0.0, 1.0]), mask, [0, 0])
    assert torch.equal(out.advantages, torch.zeros(2, 4))


@pytest.mark.parametrize(
    ("rewards", "mask", "ids", "field"),
    [
        (torch.ones(2, 1), torch.ones(2, 3), [0, 0], "rewards"),
        (torch.tensor([1, 2]), torch.ones(2, 3), [0, 0], "rewards"),
        (torch.tensor([0.0, 1.0, float("nan")]), torch.ones(3, 3), [0, 0, 0], "rewards[2]"),
        (torch.ones(2), torch.ones(3, 3), [0, 0], "loss_mask"),
        (torch.ones(2), torch.ones(2), [0, 0], "loss_mask"),
        (torch.ones(2), torch.ones(2, 3), [0], "group_ids"),
        ([1.0, 2.0], torch.ones(2, 3), [0, 0], "rewards"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(rewards, mask, ids, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        compute_grpo_advantages(rewards, mask, ids)


def test_contiguous_groups() -> None:
    assert contiguous_groups(6, 3) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="^group_size:"):
        contiguous_groups(7, 3)
    with pytest.raises(ValueError, match="^group_size:"):
        contiguous_groups(4, 0)

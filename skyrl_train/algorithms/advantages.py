"""GRPO group-relative advantages."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from skyrl_train.algorithms._common import as_float_mask, check_tensor


@dataclass
class GRPOAdvantages:
    advantages: torch.Tensor
    """[B, R] float32: each trajectory's score on its loss-active tokens, 0 elsewhere."""
    scores: torch.Tensor
    """[B] float32: (reward - group mean) / (group std + eps), or without the division."""
    group_mean: torch.Tensor
    """[B] float32: mean reward of the trajectory's group."""
    group_std: torch.Tensor
    """[B] float32: unbiased std of the group's rewards; 0 for a group of one."""


def contiguous_groups(num_trajectories: int, group_size: int) -> list[int]:
    """Group ids for prompt-major batches: trajectories [g*n, (g+1)*n) share prompt g."""
    if group_size < 1 or num_trajectories % group_size:
        raise ValueError(
            f"group_size: expected a positive divisor of num_trajectories ({num_trajectories}), "
            f"got {group_size}"
        )
    return [i // group_size for i in range(num_trajectories)]


@torch.no_grad()
def compute_grpo_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> GRPOAdvantages:
    """Score each trajectory against the other samples of its prompt.

    ``rewards`` [B] are trajectory rewards, ``loss_mask`` [B, R] marks the tokens the
    policy generated, ``group_ids`` (length B) says which trajectories share a prompt.
    A group whose rewards are all equal (including a group of one) scores 0: it has no
    signal to learn from, and dividing by its zero std must not blow up.
    """
    rewards = check_tensor(rewards, "rewards", ndim=1)
    if not rewards.is_floating_point():
        raise ValueError(f"rewards: expected a float tensor, got {rewards.dtype}")
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards[{i}]: expected a finite reward, got {float(rewards[i])}")
    batch = rewards.shape[0]
    loss_mask = check_tensor(loss_mask, "loss_mask", ndim=2)
    if loss_mask.shape[0] != batch:
        raise ValueError(
            f"loss_mask: expected {batch} rows (one per reward), got shape {tuple(loss_mask.shape)}"
        )
    mask = as_float_mask(loss_mask, "loss_mask", shape=loss_mask.shape, ref_name="loss_mask")
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids: expected {batch} ids (one per reward), got {len(ids)}")
    if not eps >= 0.0:
        raise ValueError(f"eps: expected >= 0, got {eps}")

    index: dict[Hashable, int] = {}
    group = torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.long)
    num_groups = len(index)
    r = rewards.to(torch.float64)
    counts = torch.bincount(group, minlength=num_groups).to(torch.float64)
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, r) / counts
    centred = r - mean[group]
    # The mean of equal rewards is not always exactly that reward (3 x 0.1 / 3 is off
    # by 2e-17), and that residue divided by a std of the same size would score +-0.8.
    spread = torch.zeros(num_groups, dtype=torch.float64)
    high = spread.scatter_reduce(0, group, r, "amax", include_self=False)
    low = spread.scatter_reduce(0, group, r, "amin", include_self=False)
    centred = torch.where((high == low)[group], torch.zeros_like(centred), centred)
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centred**2)
    std = (sq / (counts - 1).clamp(min=1.0)).sqrt()[group]
    if norm_by_std:
        # Flat groups have centred == 0 and std == 0; with eps == 0 that would be 0/0.
        denom = std + eps
        scores = centred / torch.where(denom > 0, denom, torch.ones_like(denom))
    else:
        scores = centred
    scores = scores.to(torch.float32)
    return GRPOAdvantages(
        advantages=scores[:, None] * mask,
        scores=scores,
        group_mean=mean[group].to(torch.float32),
        group_std=std.to(torch.float32),
    )

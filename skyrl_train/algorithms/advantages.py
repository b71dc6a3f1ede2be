"""Advantage estimators (``trainer.algorithm.advantage_estimator``, SkyRL's names).

All three take outcome rewards (one per trajectory) and put each trajectory's score on
its loss-active tokens:

- ``grpo``: (r - group mean) / (group std + eps), per prompt group;
- ``rloo``: r minus the mean of the *other* samples of the group (leave-one-out);
- ``reinforce++``: with gamma = 1 every token's return is r, whitened over all
  loss-active tokens of the batch (no groups needed).

``turn_grpo`` (ours) takes the per-turn rewards instead (``token_rewards``: each turn's
reward on its reply's last token) and scores each reply by its own turn, so a turn no
sample of a group gets right is still a signal (``compute_turn_grpo_advantages``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from skyrl_train.algorithms._common import as_float_mask, check_tensor

AdvantageEstimator = Literal["grpo", "rloo", "reinforce++", "turn_grpo"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
GROUPED_ESTIMATORS = ("grpo", "rloo", "turn_grpo")
"""Estimators whose baseline is the prompt's group, so they need >= 2 samples a prompt."""
FLAT_GROUP_ZERO_ESTIMATORS = ("grpo", "rloo")
"""Estimators that give a group of equal rewards zero advantage: a step of only such
groups trains on nothing but the entropy bonus (``trainer.algorithm.skip_flat_steps``)."""


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
    r, mask, group, num_groups = _check_inputs(rewards, loss_mask, group_ids)
    if not eps >= 0.0:
        raise ValueError(f"eps: expected >= 0, got {eps}")
    mean, centred, std, _ = _key_stats(r, group, num_groups)
    std = std[group]
    scores = (_divide_by_std(centred, std, eps) if norm_by_std else centred).to(torch.float32)
    return GRPOAdvantages(
        advantages=scores[:, None] * mask,
        scores=scores,
        group_mean=mean[group].to(torch.float32),
        group_std=std.to(torch.float32),
    )


@torch.no_grad()
def compute_rloo_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
) -> torch.Tensor:
    """RLOO: ``[B, R]`` float32, each trajectory's r_i - mean_{j != i} r_j of its group
    on its loss-active tokens (0 elsewhere).

    That equals n / (n - 1) * (r_i - group mean). A group of one has no other sample
    and a group of equal rewards no signal: both score exactly 0.
    """
    r, mask, group, num_groups = _check_inputs(rewards, loss_mask, group_ids)
    counts = torch.bincount(group, minlength=num_groups).to(torch.float64)
    totals = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, r)
    others = (totals[group] - r) / (counts[group] - 1).clamp(min=1.0)
    scores = r - others
    zero = flat_groups(r, group, num_groups)[group] | (counts[group] < 2)
    scores = torch.where(zero, torch.zeros_like(scores), scores).to(torch.float32)
    return scores[:, None] * mask


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    rewards: torch.Tensor, loss_mask: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ with an outcome reward and gamma = 1: ``[B, R]`` float32.

    The reward sits on the last generated token, so every loss-active token's return
    (the sum of rewards from it on) is the trajectory reward r_i. The returns are
    whitened over all loss-active tokens of the batch: (return - mean) / (std + eps),
    mean and unbiased std over those tokens (a trajectory weighs by its token count).
    Equal returns everywhere score exactly 0. No groups: one sample a prompt is fine.
    """
    r, mask, _, _ = _check_inputs(rewards, loss_mask, None)
    if not eps >= 0.0:
        raise ValueError(f"eps: expected >= 0, got {eps}")
    weights = mask.sum(dim=1).to(torch.float64)  # tokens per trajectory
    count = weights.sum()
    if count == 0:
        return torch.zeros_like(mask)
    mean = (weights * r).sum() / count
    centred = r - mean
    active = weights > 0
    if r[active].max() == r[active].min():  # see compute_grpo_advantages: no residue
        centred = torch.zeros_like(centred)
    std = ((weights * centred**2).sum() / (count - 1).clamp(min=1.0)).sqrt()
    denom = std + eps
    scores = centred / denom if denom > 0 else centred
    return scores.to(torch.float32)[:, None] * mask


@torch.no_grad()
def compute_turn_grpo_advantages(
    token_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-turn GRPO: ``[B, R]`` float32.

    A turn is a run of loss-active tokens; a reward at a position belongs to the last
    turn begun at or before it. Each reply scores its reward-to-go (its turn's reward
    and every later one) against the same turn of its group's other samples, as GRPO
    does with whole trajectories. So a reply is not credited with another turn's luck,
    and a turn every sample of the group got wrong (or right) while another turn
    varied no longer rides on that one's score.

    A (group, turn) cell whose samples all have the same reward-to-go is scored against
    that turn over the whole batch instead (mean, and std with ``norm_by_std``): a
    letter no sample of a group ever copies pushes the wrong replies down, where group
    GRPO leaves it at 0 for good (a never-sampled answer never enters a group). A turn
    equal over the whole batch scores 0 (nothing found yet, or all learned).
    """
    mask = as_float_mask(loss_mask, "loss_mask", shape=loss_mask.shape, ref_name="loss_mask")
    token_rewards = check_tensor(token_rewards, "token_rewards", ndim=2)
    if token_rewards.shape != mask.shape:
        raise ValueError(
            f"token_rewards: expected shape {tuple(mask.shape)} (loss_mask's), "
            f"got {tuple(token_rewards.shape)}"
        )
    bad = (~torch.isfinite(token_rewards)).nonzero()
    if bad.numel():
        i, j = (int(x) for x in bad[0])
        raise ValueError(
            f"token_rewards[{i}, {j}]: expected a finite reward, got {float(token_rewards[i, j])}"
        )
    _, _, group, num_groups = _check_inputs(token_rewards.sum(dim=1), loss_mask, group_ids)
    if not eps >= 0.0:
        raise ValueError(f"eps: expected >= 0, got {eps}")
    batch = mask.shape[0]
    starts = mask * (1.0 - torch.nn.functional.pad(mask[:, :-1], (1, 0)))
    turn = (starts.cumsum(dim=1) - 1).clamp(min=0).long()  # [B, R]
    turns = int(turn.max()) + 1 if mask.numel() else 1
    per_turn = torch.zeros(batch, turns, dtype=torch.float64)
    per_turn.scatter_add_(1, turn, token_rewards.to(torch.float64))
    to_go = per_turn.flip(1).cumsum(1).flip(1)  # [B, T] reward-to-go
    has = (starts.sum(dim=1)[:, None] > torch.arange(turns)[None, :]).flatten()  # [B*T]
    values = to_go.flatten()[has]
    t_index = torch.arange(turns).repeat(batch)[has]
    cell = (group[:, None] * turns + torch.arange(turns)[None, :]).flatten()[has]
    centred = torch.zeros_like(values)
    spread = torch.zeros_like(values)
    # Group cells first; a flat one falls back to its turn over the batch.
    for keys, size in ((t_index, turns), (cell, num_groups * turns)):
        _, key_centred, std, flat = _key_stats(values, keys, size)
        use = ~flat[keys]
        centred = torch.where(use, key_centred, centred)
        spread = torch.where(use, std[keys], spread)
    scores = _divide_by_std(centred, spread, eps) if norm_by_std else centred
    out = torch.zeros(batch * turns, dtype=torch.float64)
    out[has] = scores
    return (out.view(batch, turns).gather(1, turn) * mask).to(torch.float32)


def _key_stats(
    values: torch.Tensor, keys: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group statistics GRPO and per-turn GRPO score with: per value, its distance
    from its key's mean (exactly 0 where the key's values are all equal); per key,
    the mean, the unbiased std (0 for one value or equal values) and whether its
    values are all equal. ``values`` float64, ``keys`` dense indices below ``size``."""
    counts = torch.bincount(keys, minlength=size).to(torch.float64)
    mean = torch.zeros(size, dtype=torch.float64).index_add_(0, keys, values) / counts.clamp(min=1)
    # The mean of equal rewards is not always exactly that reward (3 x 0.1 / 3 is off
    # by 2e-17), and that residue divided by a std of the same size would score +-0.8.
    flat = flat_groups(values, keys, size)
    centred = torch.where(flat[keys], torch.zeros_like(values), values - mean[keys])
    sq = torch.zeros(size, dtype=torch.float64).index_add_(0, keys, centred**2)
    std = (sq / (counts - 1).clamp(min=1.0)).sqrt()
    return mean, centred, std, flat


def _divide_by_std(centred: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """``centred / (std + eps)``; where that denominator is 0 (a flat group, eps 0)
    centred is 0 too, and stays 0 instead of 0/0."""
    denom = std + eps
    return centred / torch.where(denom > 0, denom, torch.ones_like(denom))


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    token_rewards: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``[B, R]`` advantages by ``estimator`` (one of ``ADVANTAGE_ESTIMATORS``).

    ``norm_by_std`` applies to ``grpo`` and ``turn_grpo``; ``eps`` to all but ``rloo``;
    ``reinforce++`` ignores ``group_ids``; ``turn_grpo`` reads ``token_rewards``
    (``[B, R]``, summing to ``rewards``) and needs them.
    """
    if estimator == "turn_grpo":
        if token_rewards is None:
            raise ValueError(
                "token_rewards: expected [B, R] per-turn rewards for turn_grpo, got None"
            )
        return compute_turn_grpo_advantages(
            token_rewards, loss_mask, group_ids, norm_by_std=norm_by_std, eps=eps
        )
    if estimator == "grpo":
        return compute_grpo_advantages(
            rewards, loss_mask, group_ids, norm_by_std=norm_by_std, eps=eps
        ).advantages
    if estimator == "rloo":
        return compute_rloo_advantages(rewards, loss_mask, group_ids)
    if estimator == "reinforce++":
        return compute_reinforce_plus_plus_advantages(rewards, loss_mask, eps=eps)
    raise ValueError(f"estimator: expected one of {list(ADVANTAGE_ESTIMATORS)}, got {estimator!r}")


def group_index(
    group_ids: Sequence[Hashable] | torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Dense group indices ``[B]`` (first appearance order) and the number of groups."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    index: dict[Hashable, int] = {}
    group = torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.long)
    return group, len(index)


def flat_groups(values: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[G]`` bool: True where every value of the group is equal (a group of one too)."""
    spread = torch.zeros(num_groups, dtype=values.dtype)
    high = spread.scatter_reduce(0, group, values, "amax", include_self=False)
    low = spread.scatter_reduce(0, group, values, "amin", include_self=False)
    return high == low


def _check_inputs(
    rewards: object, loss_mask: object, group_ids: Sequence[Hashable] | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """float64 rewards, the 0/1 float mask, dense group indices and the group count
    (``group_ids`` None: every trajectory its own group)."""
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
    group, num_groups = group_index(range(batch) if group_ids is None else group_ids)
    if group.shape[0] != batch:
        raise ValueError(f"group_ids: expected {batch} ids (one per reward), got {group.shape[0]}")
    return rewards.to(torch.float64), mask, group, num_groups

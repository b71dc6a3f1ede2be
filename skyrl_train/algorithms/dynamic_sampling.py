"""Dynamic sampling: which groups a step trains on when some are flat.

A flat group (every sample of a prompt scored the same) has all-zero GRPO/RLOO
advantages, so it adds tokens to the loss's denominator and nothing to its gradient.
On the default run the share of flat groups reaches 1.0 within 8 steps once the policy
collapses onto one guess sequence. Two remedies, named as in SkyRL:

- ``filter`` (DAPO): keep the groups that vary and sample more prompts until a full
  batch varies (``plan_filter``);
- ``replace`` (POLARIS): copy varying groups over the flat ones (``plan_replace``);
- ``filter_flat_steps``: ``filter`` only on a step ``skip_flat_steps`` would leave out
  (``is_learned_flat_step``), so a stuck policy's step can still find a varying group.

Both keep the batch at ``train_batch_size`` whole groups, so mini-batch sizes and data
parallel shards never change shape; plans are lists of group indices, applied to the
generator's output by ``GeneratorOutput.take``.

Flat groups left in the batch still carry the entropy bonus. ``loss_rows`` says which
rows the loss trains on: all of them, the varying groups' (``zero_variance_filter``),
or none when every group is flat but some prompts pay more than others
(``skip_flat_steps``): a bonus-only update is what pulled the default run back
towards uniform once it answered every prompt the same way each time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from skyrl_train.algorithms.advantages import (
    FLAT_GROUP_ZERO_ESTIMATORS,
    contiguous_groups,
    flat_groups,
    group_index,
)


def varying_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """Per group of ``group_size`` consecutive trajectories: whether its rewards differ
    (the same test as ``zero_variance_group_fraction``)."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(
            f"rewards: expected a multiple of group_size {group_size} rewards, got {len(rewards)}"
        )
    values = torch.as_tensor(list(rewards), dtype=torch.float64)
    group, num_groups = group_index(contiguous_groups(len(rewards), group_size))
    return [not bool(f) for f in flat_groups(values, group, num_groups)]


def loss_rows(
    rewards: Sequence[float],
    group_size: int,
    *,
    estimator: str,
    zero_variance_filter: bool,
    skip_flat_steps: bool | None,
) -> torch.Tensor | None:
    """``[B]`` bool, the rows of a batch of ``group_size``-sample groups whose tokens
    enter the loss (``TrainingBatch.loss_rows``); None: every row. Only a group
    baseline (GRPO, RLOO) gives a flat group zero advantage, so other estimators and
    one-sample groups (trivially flat) always train every row.

    ``skip_flat_steps`` (None: on, the config's "the estimator decides", which only
    grpo and rloo act on) leaves every row out when all groups are flat but their
    rewards differ between prompts: the policy answers each prompt the same way every
    time and has learned something (some prompts pay), which a bonus-only update would
    erode with no reward to say so. A batch that scored the same everywhere (typically
    nothing found yet) still trains: there the bonus is the exploration the run needs.
    """
    if group_size < 2 or estimator not in FLAT_GROUP_ZERO_ESTIMATORS:
        return None
    if zero_variance_filter:
        varying = varying_groups(rewards, group_size)
        return torch.tensor([v for v in varying for _ in range(group_size)])
    if skip_flat_steps is not False and is_learned_flat_step(rewards, group_size):
        return torch.zeros(len(rewards), dtype=torch.bool)
    return None


def is_learned_flat_step(rewards: Sequence[float], group_size: int) -> bool:
    """Every group flat while some prompts pay more than others: the step
    ``skip_flat_steps`` leaves out, and the one ``filter_flat_steps`` samples more for."""
    return not any(varying_groups(rewards, group_size)) and len(set(rewards)) > 1


def plan_filter(rounds: Sequence[Sequence[bool]], num_groups: int) -> list[tuple[int, int]]:
    """``(round, group)`` pairs of a filtered batch from each round's ``varying_groups``:
    varying groups in the order they were sampled, the first ``num_groups`` of them; when
    the rounds hold fewer, flat groups (in sampled order) fill the rest."""
    varying = [(r, g) for r, flags in enumerate(rounds) for g, v in enumerate(flags) if v]
    flat = [(r, g) for r, flags in enumerate(rounds) for g, v in enumerate(flags) if not v]
    if len(varying) + len(flat) < num_groups:
        raise ValueError(
            f"rounds: expected at least {num_groups} groups in all, got {len(varying) + len(flat)}"
        )
    return (varying + flat)[:num_groups]


def plan_replace(
    varying: Sequence[bool], *, min_replace_ratio: float, rng: random.Random
) -> list[int]:
    """Source group of each slot: a varying group keeps its slot; a flat slot gets a
    varying group drawn at random (``rng``). Unchanged (``range``) when fewer than
    ``min_replace_ratio`` of the groups vary: copies of so few would dominate the step."""
    keep = [g for g, v in enumerate(varying) if v]
    if not keep or len(keep) < min_replace_ratio * len(varying):
        return list(range(len(varying)))
    return [g if v else rng.choice(keep) for g, v in enumerate(varying)]


def trajectory_indices(groups: Sequence[int], group_size: int) -> list[int]:
    """Trajectory indices of whole groups, in order: group g is rows g*n .. g*n+n-1."""
    return [g * group_size + i for g in groups for i in range(group_size)]

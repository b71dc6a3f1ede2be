"""Per-step learning signals: policy entropy, flat groups, success rate.

They answer "is this run still learning?": entropy falling to ~0 means the policy has
collapsed onto one answer; a share of flat groups near 1 means GRPO/RLOO see no
gradient (every sample of a prompt scored the same); success separates solving the
task from earning its format reward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from skyrl_train.algorithms._common import check_tensor
from skyrl_train.algorithms.advantages import flat_groups, group_index
from skyrl_train.algorithms.policy_loss import token_mean_entropy


def token_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each distribution over the last dim, from log-softmax output
    ``[..., V]``: -sum p log p. Tokens with p == 0 (log p = -inf) add 0, not NaN."""
    finite = torch.where(torch.isfinite(log_probs), log_probs, torch.zeros_like(log_probs))
    return -(log_probs.exp() * finite).sum(dim=-1)


def mean_token_entropy(entropy: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """Mean of per-token ``entropy`` ``[B, R]`` over loss-active tokens only: the
    policy's own tokens, not prompt or observation tokens (0.0 when there are none)."""
    entropy = check_tensor(entropy, "entropy", ndim=2)
    return float(token_mean_entropy(entropy.detach().float(), loss_mask))


ENTROPY_BOOST_CAP = 10.0
"""The most ``entropy_target`` raises the bonus coefficient: near a one-hot policy the
entropy, and with it the ratio, goes to 0."""


def scheduled_entropy_coef(coef: float, *, end: float | None, step: int, num_steps: int) -> float:
    """The bonus coefficient before ``entropy_target``/``entropy_ceiling`` act: ``coef``
    at step 1 falling (or rising) linearly to ``end`` at step ``num_steps``
    (``trainer.algorithm.entropy_loss_coef_end``), ``end`` after it; ``coef`` for good
    with no end."""
    if end is None:
        return coef
    done = min(1.0, max(0, step - 1) / max(1, num_steps - 1))
    return coef + (end - coef) * done


def entropy_coefficient(
    coef: float, *, target: float | None, entropy: float, ceiling: float | None = None
) -> float:
    """The step's entropy-bonus coefficient: 0 at or above ``ceiling`` nats
    (``trainer.algorithm.entropy_ceiling``); otherwise ``coef`` at or above ``target``
    nats (``entropy_target``, or with no target), raised in proportion to how far
    ``entropy`` is below it, at most ``ENTROPY_BOOST_CAP`` times, below."""
    if ceiling is not None and entropy >= ceiling:
        return 0.0
    if target is None or entropy >= target:
        return coef
    return coef * min(ENTROPY_BOOST_CAP, target / max(entropy, 1e-12))


def zero_variance_group_fraction(
    rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor
) -> float:
    """Share of groups whose rewards are all equal (a group of one included): under
    GRPO and RLOO their advantages are exactly 0, so they add no gradient."""
    rewards = check_tensor(rewards, "rewards", ndim=1)
    group, num_groups = group_index(group_ids)
    if group.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"group_ids: expected {rewards.shape[0]} ids (one per reward), got {group.shape[0]}"
        )
    if num_groups == 0:
        return 0.0
    flat = flat_groups(rewards.to(torch.float64), group, num_groups)
    return float(flat.sum()) / num_groups


def success_rate(solved: Sequence[bool | None]) -> float | None:
    """Share of solved episodes among the trajectories whose environment reported
    ``solved``; None when none did (the environment has no notion of success)."""
    reported = [bool(s) for s in solved if s is not None]
    if not reported:
        return None
    return sum(reported) / len(reported)

"""Policy losses (PPO-clip and GSPO, token-mean, optional dual clip and off-policy
correction) and the k3 KL penalty.

Every log-ratio is clamped to +-20 before ``exp`` (``_common.LOG_RATIO_BOUND``) and
masked positions are selected away, never multiplied by 0, so neither an overflowing
ratio nor a NaN at a masked position can reach the loss or its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from skyrl_train.algorithms._common import (
    LOG_RATIO_BOUND,
    as_float_mask,
    check_same_shape,
    check_tensor,
    k3,
    masked_log_ratio,
    masked_mean,
)
from skyrl_train.algorithms.off_policy import (
    OffPolicyCorrection,
    OffPolicyStats,
    OffPolicyWeights,
    off_policy_weights,
)

PolicyLossType = Literal["regular", "gspo"]
POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)
"""``trainer.algorithm.policy_loss_type`` values, SkyRL's names."""


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar, differentiable w.r.t. ``logprobs``."""
    metrics: dict[str, float]
    """``policy_loss``, ``clip_fraction``, ``dual_clip_fraction``, ``approx_kl``,
    ``ratio_mean``, ``num_tokens``, and with an off-policy correction
    ``tis_weight_mean``, ``tis_clip_fraction`` (over the tokens it left in the loss);
    the other means are over loss-active tokens (0.0 when there are none)."""
    off_policy: OffPolicyStats | None = None
    """The correction's counts, None without one; sums, so a caller can combine
    microbatches and ranks into the whole batch's means (``OffPolicyStats.to_metrics``)."""


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float,
    eps_clip_high: float,
    clip_ratio_c: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_imp_ratio_cap: float | None = None,
    off_policy_correction: OffPolicyCorrection | None = None,
    denominator: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss (``policy_loss_type: regular``), token-mean over
    ``loss_mask``; all tensors ``[B, R]``.

    ratio = exp(clamp(logprobs - old_logprobs, -20, 20)); per token the loss is
    max(-A * ratio, -A * clamp(ratio, 1 - eps_clip_low, 1 + eps_clip_high)). With
    ``clip_ratio_c`` (> 1) tokens with A < 0 are further capped at -A * c (dual clip),
    so a huge ratio on a bad token cannot dominate the step.

    Off-policy correction (``rollout_logprobs`` with ``off_policy_correction``): the
    rollout came from the inference engine, not from the trainer's old policy, so each
    token's loss is multiplied by a detached weight from exp(old_logprobs -
    rollout_logprobs), 0 on sequences a mask drops (``off_policy.off_policy_weights``).
    ``tis_imp_ratio_cap`` is the older spelling of token TIS: the same as
    ``OffPolicyCorrection(tis_ratio_type="token", token_tis_ratio_clip_high=cap)``.
    A dropped sequence still counts in the token-mean denominator (see
    ``_clipped_surrogate``).

    ``denominator`` replaces the token count of this call, so micro-batches of one
    mini-batch can all divide by the mini-batch's token count (a true token mean).
    """
    mask = _check_inputs(
        logprobs, old_logprobs, advantages, loss_mask, eps_clip_low, eps_clip_high, denominator
    )
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: expected None or > 1, got {clip_ratio_c}")
    log_ratio = masked_log_ratio(logprobs, old_logprobs.detach(), mask)
    return _clipped_surrogate(
        log_ratio,
        log_ratio.detach(),
        advantages.detach(),
        mask,
        eps_clip_low=eps_clip_low,
        eps_clip_high=eps_clip_high,
        clip_ratio_c=clip_ratio_c,
        off_policy=_off_policy(
            old_logprobs, rollout_logprobs, tis_imp_ratio_cap, off_policy_correction, mask
        ),
        denominator=denominator,
    )


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float,
    eps_clip_high: float,
    rollout_logprobs: torch.Tensor | None = None,
    tis_imp_ratio_cap: float | None = None,
    off_policy_correction: OffPolicyCorrection | None = None,
    denominator: float | None = None,
) -> PolicyLossOutput:
    """GSPO (``policy_loss_type: gspo``): one importance ratio per sequence.

    s_i = exp(clamp(mean over sequence i's loss-active tokens of (logprobs - old), +-20));
    each token uses r = s_i * exp(logp - sg(logp)): the value is the sequence's ratio,
    the gradient flows through the token's own logprob (d r / d logp_t = s_i). Per token
    the loss is -min(r * A, clamp(r, 1 - eps_clip_low, 1 + eps_clip_high) * A), and
    the loss is the token mean over ``loss_mask`` like the regular loss (the paper
    averages per sequence first; here long sequences weigh by their token count).

    GSPO's ratios sit near 1 (a mean of log-ratios), so the paper clips far tighter
    than PPO, e.g. eps_clip_low=3e-4, eps_clip_high=4e-4; with PPO's 0.2 almost
    nothing clips. No dual clip; the off-policy correction and ``denominator`` as in
    ``ppo_policy_loss`` (sequence TIS and the masks see whole rows, which is what a
    microbatch holds).
    """
    mask = _check_inputs(
        logprobs, old_logprobs, advantages, loss_mask, eps_clip_low, eps_clip_high, denominator
    )
    active = mask > 0
    current = torch.where(active, logprobs, torch.zeros_like(logprobs))
    old = torch.where(active, old_logprobs.detach(), torch.zeros_like(current))
    sequence = ((current - old).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).detach()
    sequence = sequence.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_ratio = sequence[:, None] + current - current.detach()
    return _clipped_surrogate(
        log_ratio,
        masked_log_ratio(logprobs.detach(), old_logprobs.detach(), mask),
        advantages.detach(),
        mask,
        eps_clip_low=eps_clip_low,
        eps_clip_high=eps_clip_high,
        clip_ratio_c=None,
        off_policy=_off_policy(
            old_logprobs, rollout_logprobs, tis_imp_ratio_cap, off_policy_correction, mask
        ),
        denominator=denominator,
    )


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    denominator: float | None = None,
) -> torch.Tensor:
    """Token-mean k3 estimate of KL(policy || ref) on the policy's own samples, ``[B, R]``.

    Per token exp(r) - 1 - r with r = clamp(ref_logprobs - logprobs, -20, 20) (>= 0,
    low variance); masked positions are selected away, so a NaN there stays out.
    """
    logprobs = check_tensor(logprobs, "logprobs", ndim=2)
    ref = check_tensor(ref_logprobs, "ref_logprobs", ndim=2)
    check_same_shape(ref, "ref_logprobs", logprobs.shape, "logprobs")
    mask = as_float_mask(loss_mask, "loss_mask", shape=logprobs.shape, ref_name="logprobs")
    log_ratio = masked_log_ratio(ref.detach(), logprobs, mask)
    return masked_mean(k3(log_ratio), mask, denominator=denominator)


def token_mean_entropy(
    entropy: torch.Tensor, loss_mask: torch.Tensor, *, denominator: float | None = None
) -> torch.Tensor:
    """Differentiable token mean of per-token ``entropy`` ``[B, R]`` over ``loss_mask``,
    for an entropy bonus (``use_entropy_loss``: loss - coef x this); ``denominator`` as in
    ``ppo_policy_loss``."""
    entropy = check_tensor(entropy, "entropy", ndim=2)
    mask = as_float_mask(loss_mask, "loss_mask", shape=entropy.shape, ref_name="entropy")
    return masked_mean(entropy, mask, denominator=denominator)


# ------------------------------------------------------------------------------ shared


def _check_inputs(
    logprobs: object,
    old_logprobs: object,
    advantages: object,
    loss_mask: object,
    eps_clip_low: float,
    eps_clip_high: float,
    denominator: float | None,
) -> torch.Tensor:
    """Shape and range checks shared by the losses; returns the 0/1 float mask."""
    logprobs = check_tensor(logprobs, "logprobs", ndim=2)
    shape = logprobs.shape
    for name, value in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_same_shape(check_tensor(value, name, ndim=2), name, shape, "logprobs")
    mask = as_float_mask(loss_mask, "loss_mask", shape=shape, ref_name="logprobs")
    if not (0.0 <= eps_clip_low < 1.0):
        raise ValueError(f"eps_clip_low: expected 0 <= eps_clip_low < 1, got {eps_clip_low}")
    if not eps_clip_high >= 0.0:
        raise ValueError(f"eps_clip_high: expected >= 0, got {eps_clip_high}")
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator: expected > 0, got {denominator}")
    return mask


def _off_policy(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    cap: float | None,
    correction: OffPolicyCorrection | None,
    mask: torch.Tensor,
) -> OffPolicyWeights | None:
    """The correction's weights, or None when none applies; ``cap`` (the older
    ``tis_imp_ratio_cap`` argument) stands for token TIS with that clip."""
    if cap is not None and correction is not None:
        raise ValueError(
            f"tis_imp_ratio_cap: expected None with off_policy_correction (it is the "
            f"older spelling of token TIS), got {cap}"
        )
    wanted = cap is not None or (correction is not None and correction.enabled)
    if (rollout_logprobs is None) == wanted:
        raise ValueError(
            "tis_imp_ratio_cap: expected it (or an enabled off_policy_correction) together "
            f"with rollout_logprobs (both or neither), got cap={cap}, off_policy_correction "
            f"{'enabled' if correction is not None and correction.enabled else 'off'} and "
            f"rollout_logprobs {'set' if rollout_logprobs is not None else 'None'}"
        )
    if rollout_logprobs is None:
        return None
    if cap is not None:
        if not cap > 0:
            raise ValueError(f"tis_imp_ratio_cap: expected > 0, got {cap}")
        correction = OffPolicyCorrection(tis_ratio_type="token", token_tis_ratio_clip_high=cap)
    assert correction is not None
    rollout = check_tensor(rollout_logprobs, "rollout_logprobs", ndim=2)
    check_same_shape(rollout, "rollout_logprobs", old_logprobs.shape, "logprobs")
    return off_policy_weights(old_logprobs, rollout, mask, correction)


def _clipped_surrogate(
    log_ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip_low: float,
    eps_clip_high: float,
    clip_ratio_c: float | None,
    off_policy: OffPolicyWeights | None,
    denominator: float | None,
) -> PolicyLossOutput:
    """The clipped objective on a (bounded) ``log_ratio``; ``token_log_ratio`` (detached)
    is each token's own log(new/old), for the KL estimate."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clipped_tokens = clipped > unclipped
    dual_clipped = torch.zeros_like(clipped_tokens)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_clipped = negative & (per_token > cap)
        per_token = torch.where(negative, torch.minimum(per_token, cap), per_token)

    metrics: dict[str, float] = {}
    if off_policy is not None:
        # A masked sequence's tokens get weight 0 but stay in the token count the mean
        # divides by (``mask``, not the kept tokens), as SkyRL does (it scales the
        # advantages by the mini-batch's token count before correcting). Dropping them
        # from the count would scale the surviving tokens' gradient up by how much was
        # masked, so an off-policy batch would take a larger step than an on-policy
        # one; and microbatches of one mini-batch share ``denominator`` anyway.
        per_token = per_token * off_policy.weights
        stats = off_policy.stats
        kept = max(stats.kept_tokens, 1.0)
        metrics["tis_weight_mean"] = stats.weight_sum / kept
        metrics["tis_clip_fraction"] = stats.clipped_tokens / kept

    loss = masked_mean(per_token, mask, denominator=denominator)
    with torch.no_grad():
        metrics.update(
            policy_loss=loss.item(),
            clip_fraction=masked_mean(clipped_tokens.float(), mask).item(),
            dual_clip_fraction=masked_mean(dual_clipped.float(), mask).item(),
            # k3 of ratio = new/old estimates KL(old || new) on tokens sampled from old.
            approx_kl=masked_mean(k3(token_log_ratio), mask).item(),
            ratio_mean=masked_mean(ratio, mask).item(),
            num_tokens=mask.sum().item(),
        )
    return PolicyLossOutput(
        loss=loss, metrics=metrics, off_policy=None if off_policy is None else off_policy.stats
    )

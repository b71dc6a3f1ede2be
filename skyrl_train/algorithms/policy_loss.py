"""PPO-clip policy loss (token-mean, optional dual clip and TIS) and the k3 KL penalty."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_train.algorithms._common import (
    as_float_mask,
    check_same_shape,
    check_tensor,
    k3,
    masked_mean,
)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar, differentiable w.r.t. ``logprobs``."""
    metrics: dict[str, float]
    """``policy_loss``, ``clip_fraction``, ``dual_clip_fraction``, ``approx_kl``,
    ``ratio_mean``, ``num_tokens``, and with TIS ``tis_weight_mean``, ``tis_clip_fraction``;
    all means are over loss-active tokens (0.0 when there are none)."""


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
    denominator: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss, token-mean over ``loss_mask``; all tensors ``[B, R]``.

    ratio = exp(logprobs - old_logprobs); per token the loss is
    max(-A * ratio, -A * clamp(ratio, 1 - eps_clip_low, 1 + eps_clip_high)). With
    ``clip_ratio_c`` (> 1) tokens with A < 0 are further capped at -A * c (dual clip),
    so a huge ratio on a bad token cannot dominate the step.

    Truncated importance sampling (``rollout_logprobs`` with ``tis_imp_ratio_cap``):
    the rollout came from the inference engine, not from the trainer's old policy, so
    each token is weighted by min(exp(old_logprobs - rollout_logprobs), cap), detached.

    ``denominator`` replaces the token count of this call, so micro-batches of one
    mini-batch can all divide by the mini-batch's token count (a true token mean).
    """
    logprobs = check_tensor(logprobs, "logprobs", ndim=2)
    shape = logprobs.shape
    for name, value in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_same_shape(check_tensor(value, name, ndim=2), name, shape, "logprobs")
    mask = as_float_mask(loss_mask, "loss_mask", shape=shape, ref_name="logprobs")
    if not (0.0 <= eps_clip_low < 1.0):
        raise ValueError(f"eps_clip_low: expected 0 <= eps_clip_low < 1, got {eps_clip_low}")
    if not eps_clip_high >= 0.0:
        raise ValueError(f"eps_clip_high: expected >= 0, got {eps_clip_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: expected None or > 1, got {clip_ratio_c}")
    if (rollout_logprobs is None) != (tis_imp_ratio_cap is None):
        raise ValueError(
            "tis_imp_ratio_cap: expected it together with rollout_logprobs (both or neither), "
            f"got cap={tis_imp_ratio_cap} and rollout_logprobs "
            f"{'set' if rollout_logprobs is not None else 'None'}"
        )
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator: expected > 0, got {denominator}")

    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs
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
    if rollout_logprobs is not None and tis_imp_ratio_cap is not None:
        rollout = check_tensor(rollout_logprobs, "rollout_logprobs", ndim=2)
        check_same_shape(rollout, "rollout_logprobs", shape, "logprobs")
        if not tis_imp_ratio_cap > 0:
            raise ValueError(f"tis_imp_ratio_cap: expected > 0, got {tis_imp_ratio_cap}")
        raw = torch.exp(old_logprobs - rollout.detach())
        weight = raw.clamp(max=tis_imp_ratio_cap)
        per_token = per_token * weight
        with torch.no_grad():
            metrics["tis_weight_mean"] = masked_mean(weight, mask).item()
            metrics["tis_clip_fraction"] = masked_mean(
                (raw > tis_imp_ratio_cap).float(), mask
            ).item()

    loss = masked_mean(per_token, mask, denominator=denominator)
    with torch.no_grad():
        metrics.update(
            policy_loss=loss.item(),
            clip_fraction=masked_mean(clipped_tokens.float(), mask).item(),
            dual_clip_fraction=masked_mean(dual_clipped.float(), mask).item(),
            # k3 of ratio = new/old estimates KL(old || new) on tokens sampled from old.
            approx_kl=masked_mean(k3(log_ratio), mask).item(),
            ratio_mean=masked_mean(ratio, mask).item(),
            num_tokens=mask.sum().item(),
        )
    return PolicyLossOutput(loss=loss, metrics=metrics)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    denominator: float | None = None,
) -> torch.Tensor:
    """Token-mean k3 estimate of KL(policy || ref) on the policy's own samples, ``[B, R]``.

    Per token exp(r) - 1 - r with r = ref_logprobs - logprobs (>= 0, low variance).
    """
    logprobs = check_tensor(logprobs, "logprobs", ndim=2)
    ref = check_tensor(ref_logprobs, "ref_logprobs", ndim=2)
    check_same_shape(ref, "ref_logprobs", logprobs.shape, "logprobs")
    mask = as_float_mask(loss_mask, "loss_mask", shape=logprobs.shape, ref_name="logprobs")
    return masked_mean(k3(ref.detach() - logprobs), mask, denominator=denominator)

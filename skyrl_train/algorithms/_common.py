"""Shape checks and masked reductions shared by the algorithm functions."""

from __future__ import annotations

import torch

from inference.wire import LOGPROB_FLOOR

MISSING_LOGPROB = LOGPROB_FLOOR
"""The engine's stand-in for a missing or non-finite sampled logprob (-9999.0, the
wire's ``LOGPROB_FLOOR``, so the two sides cannot drift): a rollout logprob at or
below it is a placeholder, not a value."""


def check_tensor(value: object, name: str, *, ndim: int) -> torch.Tensor:
    """``value`` as a tensor of ``ndim`` dims, else ``ValueError`` naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(value.shape)}")
    return value


def check_same_shape(value: torch.Tensor, name: str, shape: torch.Size, ref_name: str) -> None:
    if value.shape != shape:
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} (that of {ref_name}), got {tuple(value.shape)}"
        )


def as_float_mask(mask: object, name: str, *, shape: torch.Size, ref_name: str) -> torch.Tensor:
    """A 0/1 float mask of ``shape`` (bool, int or float input)."""
    mask = check_tensor(mask, name, ndim=len(shape))
    check_same_shape(mask, name, shape, ref_name)
    if mask.is_floating_point():
        return (mask != 0).to(torch.float32)
    return mask.ne(0).to(torch.float32)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, *, denominator: float | None = None
) -> torch.Tensor:
    """Sum of ``values`` over the mask divided by the mask's count (or ``denominator``).

    An all-masked input gives 0.0, not NaN: the count is clamped to 1. Masked
    positions are selected away, not multiplied by 0, so a NaN/inf there cannot leak.
    """
    total = torch.where(mask > 0, values, torch.zeros_like(values)).sum()
    count = mask.sum().clamp(min=1.0) if denominator is None else float(denominator)
    return total / count


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-sample k3 estimator ``exp(r) - 1 - r`` (>= 0) with ``r = log p - log q``.

    With samples drawn from q it estimates KL(q || p) without bias and low variance.
    """
    return torch.expm1(log_ratio) - log_ratio


LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` (SkyRL's bound): exp(88.7) already
overflows fp32, and one token at ratio e^20 (4.9e8) is more than any step should see."""


def masked_log_ratio(
    logprobs: torch.Tensor, base: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``logprobs - base`` clamped to +-``LOG_RATIO_BOUND``, exactly 0 where ``mask`` is 0.

    Selecting (``torch.where``) rather than multiplying by the mask keeps a NaN/inf at a
    masked position out of the value *and* the gradient: the backward of ``where``
    routes a zero gradient to the unselected side without multiplying by it.
    """
    active = mask > 0
    diff = torch.where(active, logprobs, torch.zeros_like(logprobs)) - torch.where(
        active, base, torch.zeros_like(base)
    )
    return diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)

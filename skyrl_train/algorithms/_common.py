"""Shape checks and masked reductions shared by the algorithm functions."""

from __future__ import annotations

import torch


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

    An all-masked input gives 0.0, not NaN: the count is clamped to 1.
    """
    total = (values * mask).sum()
    count = mask.sum().clamp(min=1.0) if denominator is None else float(denominator)
    return total / count


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-sample k3 estimator ``exp(r) - 1 - r`` (>= 0) with ``r = log p - log q``.

    With samples drawn from q it estimates KL(q || p) without bias and low variance.
    """
    return torch.expm1(log_ratio) - log_ratio

"""Comparing one optimizer step across two workers (layouts or backends): the step's
clipped gradients under the HF names, and the elements whose first AdamW step a
weight comparison can read."""

from __future__ import annotations

from typing import Any

import torch


def clipped_grads(worker: Any) -> dict[str, torch.Tensor]:
    """The step's gradients (after clipping) under the HF names, whole: exported as if
    they were the weights, so shards are gathered as the weights are (a collective on a
    sharded worker)."""
    grads = {
        name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for name, p in worker.named_parameters()
    }
    with worker.swapped_weights(grads):
        return dict(worker.export_weights())


def steady(grad: torch.Tensor) -> torch.Tensor:
    """Elements whose first AdamW step does not hinge on fp32 rounding: that step moves
    a weight by lr * g / (|g| + 1e-8), which turns a gradient of 1e-9 into 0.1 lr, so a
    1e-10 difference in a near-zero gradient is a 1e-3 difference in the weight."""
    return grad.abs() >= 1e-6


def steady_worst(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> float:
    """The largest weight difference over the ``steady`` elements of ``grads``."""
    worst = 0.0
    for name, weight in want.items():
        diff = (got[name] - weight).abs()[steady(grads[name])]
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst

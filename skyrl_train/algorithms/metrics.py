"""Per-step metric aggregation: many metric dicts (micro-batches, ranks) in, one out.

A step's metrics come from several micro-batches and trainer ranks. How a key
combines is read from its last path component, so producers and the launch need
no side table: ``max_*`` takes the max, ``min_*`` the min, ``num_*`` the sum, and
everything else a weighted mean (weight = the update's ``weight``, e.g. its token
count, so a micro-batch of 3 tokens does not count as much as one of 300).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch

Reduction = Literal["mean", "max", "min", "sum"]


def reduction_of(key: str) -> Reduction:
    """How ``key`` combines across updates, from its last ``/``-separated component."""
    leaf = key.rsplit("/", 1)[-1]
    if leaf.startswith("max_"):
        return "max"
    if leaf.startswith("min_"):
        return "min"
    if leaf.startswith("num_"):
        return "sum"
    return "mean"


class StepMetrics:
    """Accumulates metric dicts for one step; ``result()`` gives plain floats."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._plain_sum: dict[str, float] = {}

    def update(
        self, metrics: Mapping[str, float | int | torch.Tensor], *, weight: float = 1.0
    ) -> None:
        """Add one dict. ``weight`` only affects mean-reduced keys; it may be 0."""
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight: expected a finite number >= 0, got {weight}")
        for key, raw in metrics.items():
            value = float(raw.item() if isinstance(raw, torch.Tensor) else raw)
            if not math.isfinite(value):
                raise ValueError(f"metrics[{key!r}]: expected a finite number, got {value}")
            kind = reduction_of(key)
            if kind == "mean":
                self._sum[key] = self._sum.get(key, 0.0) + weight * value
                self._weight[key] = self._weight.get(key, 0.0) + weight
                self._plain_sum[key] = self._plain_sum.get(key, 0.0) + value
            elif key not in self._sum:
                self._sum[key] = value
            elif kind == "max":
                self._sum[key] = max(self._sum[key], value)
            elif kind == "min":
                self._sum[key] = min(self._sum[key], value)
            else:
                self._sum[key] += value
            self._count[key] = self._count.get(key, 0) + 1

    def result(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, total in self._sum.items():
            if reduction_of(key) != "mean":
                out[key] = total
            elif self._weight[key] > 0:
                out[key] = total / self._weight[key]
            else:  # every update had weight 0 (say, no tokens): fall back to a plain mean
                out[key] = self._plain_sum[key] / self._count[key]
        return dict(sorted(out.items()))

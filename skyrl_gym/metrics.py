"""Per-environment episode metrics: ``BaseTextEnv.get_metrics`` of each episode,
combined by the environment class's ``aggregate_metrics`` (SkyRL's hooks)."""

from __future__ import annotations

import numbers
from typing import Any


def default_aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """The mean of every numeric (bools count as 0/1) field over the episodes that
    report it; other values are dropped. A numpy number (``np.int64`` from a count) is
    a number here, where SkyRL's check drops it silently."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for episode in metrics:
        for key, value in episode.items():
            if isinstance(value, numbers.Real):  # numpy scalars too, not only int/float
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def aggregate_for_environment(env_name: str, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """``metrics`` combined by ``env_name``'s class (its ``aggregate_metrics``, or the
    default mean when the factory has none)."""
    from skyrl_gym.envs.registration import creator

    factory = creator(env_name)
    aggregate = getattr(factory, "aggregate_metrics", default_aggregate_metrics)
    return dict(aggregate(metrics))

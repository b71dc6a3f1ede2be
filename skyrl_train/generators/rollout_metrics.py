"""The generator's per-call metrics: ``generate/*`` over its trajectories, and
``environment/<env_class>/*`` from the environments' own ``get_metrics`` hooks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import skyrl_gym
from skyrl_train.generators.trajectory import (
    STOP_BUDGET,
    STOP_DONE,
    STOP_MAX_TURNS,
    Trajectory,
)


def trajectory_metrics(trajs: list[Trajectory], *, wall_s: float) -> dict[str, float]:
    n = max(1, len(trajs))
    traces = [t.trace for t in trajs if t.trace is not None]
    metrics = {
        "generate/num_trajectories": float(len(trajs)),
        "generate/mean_turns": sum(t.turns for t in trajs) / n,
        "generate/mean_response_tokens": sum(len(t.response_ids) for t in trajs) / n,
        "generate/mean_generated_tokens": sum(sum(t.loss_mask) for t in trajs) / n,
        "generate/mean_reward": sum(t.reward for t in trajs) / n,
        "generate/length_finishes": float(sum(t.length_finishes for t in trajs)),
        "generate/wall_s": wall_s,
        "generate/postprocessed_turns": float(sum(t.postprocessed_turns for t in trajs)),
    }
    for reason in (STOP_DONE, STOP_MAX_TURNS, STOP_BUDGET):
        metrics[f"generate/stop_{reason}"] = sum(t.stop_reason == reason for t in trajs) / n
    if traces:
        metrics["generate/route_bytes"] = float(sum(t.bytes_received for t in traces))
        metrics["generate/route_rows"] = float(sum(t.rows for t in traces))
        metrics["generate/whole_prefix_replies"] = float(
            sum(t.whole_prefix_replies for t in traces)
        )
    return metrics


def environment_metrics(
    names: Sequence[str], episodes: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """``environment/<env_class>/<key>``: each environment class's ``aggregate_metrics``
    over its episodes' ``get_metrics`` (SkyRL's hooks); nothing when none reports."""
    by_env: dict[str, list[dict[str, Any]]] = {}
    for name, metrics in zip(names, episodes, strict=True):
        if metrics:
            by_env.setdefault(name, []).append(metrics)
    out: dict[str, float] = {}
    for name, episode_list in sorted(by_env.items()):
        aggregated = skyrl_gym.metrics.aggregate_for_environment(name, episode_list)
        for key, value in aggregated.items():
            if isinstance(value, (int, float)):
                out[f"environment/{name}/{key}"] = float(value)
    return out

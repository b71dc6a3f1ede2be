"""Metrics JSONL, the per-step line and the end-of-run plot."""

from __future__ import annotations

import math
from pathlib import Path

from skyrl_train.utils.tracking import (
    PLOT_PANELS,
    MetricsTracker,
    format_metrics_line,
    plot_metrics,
    read_metrics,
)


def test_tracker_appends_one_line_per_step_and_nulls_non_finite(tmp_path: Path) -> None:
    tracker = MetricsTracker(tmp_path, tensorboard=False)
    tracker.log(1, {"reward/mean": 0.25, "mismatch_trained/k3_kl": math.nan})
    tracker.log(2, {"reward/mean": 0.5, "r3/router_agreement_trained": 1.0})
    tracker.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [
        {"step": 1, "reward/mean": 0.25, "mismatch_trained/k3_kl": None},
        {"step": 2, "reward/mean": 0.5, "r3/router_agreement_trained": 1.0},
    ]


def test_metrics_line_shows_present_keys_with_labels() -> None:
    line = format_metrics_line(
        3, {"reward/mean": 0.4125, "timing/train_s": 1.5}, (("reward/mean", "reward"), ("x", "y"))
    )
    assert line == "step 3 reward=0.4125"


def test_plot_is_written_as_png(tmp_path: Path) -> None:
    tracker = MetricsTracker(tmp_path, tensorboard=False)
    for step in range(1, 4):
        tracker.log(
            step,
            {
                "reward/mean": step / 10,
                "r3/router_agreement_trained": 1.0,
                "r3/router_agreement_native": 0.99,
                "mismatch_trained/mean_abs_logp_diff": 1e-3,
                "reward/success_rate": step / 4,
                "policy/entropy": 3.0 - step / 2,
                "advantage/zero_variance_group_frac": 0.25,
                "policy/clip_fraction": 0.01,
            },
        )
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_learning_signal_has_a_plot_series_and_a_line_label() -> None:
    from skyrl_train.trainer.loop import LINE_KEYS

    plotted = {key for _, series in PLOT_PANELS for key, _ in series}
    labelled = {key for key, _ in LINE_KEYS}
    for key in (
        "reward/success_rate",
        "eval/success_rate",
        "policy/entropy",
        "advantage/zero_variance_group_frac",
        "policy/clip_fraction",
        "policy/kl_to_ref",
    ):
        assert key in plotted and key in labelled, key

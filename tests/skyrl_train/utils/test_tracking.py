"""The trackers of ``logging.trackers`` (JSONL; TensorBoard, wandb and mlflow through a
stand-in module, since they are optional extras), their validation, the per-step line
and the end-of-run plot."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from skyrl_train.config import load_config, validate_cfg
from skyrl_train.errors import ConfigValidationError
from skyrl_train.utils.tracking import (
    PLOT_PANELS,
    TRACKERS,
    MetricsTracker,
    check_trackers,
    format_metrics_line,
    plot_metrics,
    read_metrics,
)

OPTIONAL = ("tensorboard", "wandb", "mlflow")


def test_tracker_appends_one_line_per_step_and_nulls_non_finite(tmp_path: Path) -> None:
    tracker = MetricsTracker(tmp_path)
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
    tracker = MetricsTracker(tmp_path)
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


# ------------------------------------------------------------------ logging.trackers


def _refusal(trackers: str) -> ConfigValidationError:
    cfg = load_config([f"logging.trackers={trackers}"])
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    return info.value


def test_the_default_is_jsonl_alone() -> None:
    assert load_config().logging.trackers == ["jsonl"]
    assert list(TRACKERS) == ["jsonl", *OPTIONAL]


@pytest.mark.parametrize("name", OPTIONAL)
def test_a_tracker_that_is_not_installed_is_refused(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes the import fail whether or not the extra is installed.
    monkeypatch.setitem(sys.modules, TRACKERS[name].requires, None)
    err = _refusal(f"[jsonl,{name}]")
    assert str(err).startswith(
        f"logging.trackers[1]: expected an installed tracker (pip install 'skyrl-r3[{name}]'), "
        f"got '{name}'"
    )
    with pytest.raises(ConfigValidationError, match=r"logging\.trackers\[0\]: expected an inst"):
        MetricsTracker(Path("unused"), trackers=[name])


def test_an_unknown_tracker_is_refused() -> None:
    err = _refusal("[jsonl,neptune]")
    assert str(err) == (
        "logging.trackers[1]: expected one of jsonl, tensorboard, wandb, mlflow, got 'neptune'"
    )


def test_a_repeated_tracker_is_refused() -> None:
    err = _refusal("[jsonl,jsonl]")
    assert str(err) == (
        "logging.trackers[1]: expected each tracker once, got 'jsonl' again "
        "(also logging.trackers[0])"
    )


def test_no_tracker_at_all_is_allowed(tmp_path: Path) -> None:
    check_trackers([])
    tracker = MetricsTracker(tmp_path, trackers=[])
    tracker.log(1, {"reward/mean": 1.0})
    tracker.close()
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("key", ["logging.jsonl", "logging.tensorboard"])
def test_the_old_switches_are_unknown_keys(key: str) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config([f"{key}=true"])
    assert str(info.value).startswith(f"{key}: ")


STEP_METRICS = {"reward/mean": 0.5, "mismatch_trained/k3_kl": math.nan}
"""What the loop hands over for a step; the non-finite one is left out of the logs."""


def _fake(monkeypatch: pytest.MonkeyPatch, module: str, **attrs: Any) -> None:
    fake = types.ModuleType(module)
    for name, value in attrs.items():
        setattr(fake, name, value)
    monkeypatch.setitem(sys.modules, module, fake)


def _log_two_steps(run_dir: Path, name: str, *, start_step: int = 0) -> None:
    check_trackers([name])  # the stand-in counts as installed
    tracker = MetricsTracker(run_dir, trackers=[name], start_step=start_step)
    tracker.log(start_step + 1, STEP_METRICS)
    tracker.log(start_step + 2, {"reward/mean": 0.75})
    tracker.close()


def test_tensorboard_gets_each_finite_metric_at_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []

    class SummaryWriter:
        def __init__(self, log_dir: str, *, purge_step: int) -> None:
            calls.append(("init", log_dir, purge_step))

        def add_scalar(self, key: str, value: float, step: int) -> None:
            calls.append((key, value, step))

        def close(self) -> None:
            calls.append(("close",))

    _fake(monkeypatch, "torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    _log_two_steps(tmp_path / "run", "tensorboard", start_step=3)
    assert calls == [
        ("init", str(tmp_path / "run" / "tensorboard"), 4),
        ("reward/mean", 0.5, 4),
        ("reward/mean", 0.75, 5),
        ("close",),
    ]


def test_wandb_gets_the_step_metrics_in_a_run_named_after_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []

    class Run:
        def log(self, metrics: dict[str, float], *, step: int) -> None:
            calls.append(("log", metrics, step))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs: Any) -> Run:
        calls.append(("init", kwargs))
        return Run()

    _fake(monkeypatch, "wandb", init=init)
    _log_two_steps(tmp_path / "r3_grpo", "wandb")
    # No project, mode or key passed: wandb reads WANDB_PROJECT, WANDB_MODE (offline) itself.
    assert calls == [
        ("init", {"name": "r3_grpo", "dir": str(tmp_path / "r3_grpo")}),
        ("log", {"reward/mean": 0.5}, 1),
        ("log", {"reward/mean": 0.75}, 2),
        ("finish",),
    ]


def test_mlflow_gets_the_step_metrics_in_a_run_named_after_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []

    def start_run(**kwargs: Any) -> None:
        calls.append(("start_run", kwargs))

    def log_metrics(metrics: dict[str, float], *, step: int) -> None:
        calls.append(("log_metrics", metrics, step))

    def end_run() -> None:
        calls.append(("end_run",))

    _fake(monkeypatch, "mlflow", start_run=start_run, log_metrics=log_metrics, end_run=end_run)
    _log_two_steps(tmp_path / "r3_grpo", "mlflow")
    assert calls == [
        ("start_run", {"run_name": "r3_grpo"}),
        ("log_metrics", {"reward/mean": 0.5}, 1),
        ("log_metrics", {"reward/mean": 0.75}, 2),
        ("end_run",),
    ]


def test_every_tracker_gets_the_step_and_all_are_closed_when_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended: list[str] = []

    def end_run() -> None:
        ended.append("mlflow")
        raise RuntimeError("tracking server went away")

    class Run:
        def log(self, metrics: dict[str, float], *, step: int) -> None:
            pass

        def finish(self) -> None:
            ended.append("wandb")

    _fake(monkeypatch, "wandb", init=lambda **_: Run())
    _fake(
        monkeypatch,
        "mlflow",
        start_run=lambda **_: None,
        log_metrics=lambda *_, **__: None,
        end_run=end_run,
    )
    tracker = MetricsTracker(tmp_path, trackers=["mlflow", "jsonl", "wandb"])
    tracker.log(1, STEP_METRICS)
    with pytest.raises(RuntimeError, match="went away"):
        tracker.close()
    assert ended == ["mlflow", "wandb"]
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.5, "mismatch_trained/k3_kl": None}
    ]

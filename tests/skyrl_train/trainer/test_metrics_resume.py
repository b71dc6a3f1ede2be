"""A run owns the steps after the one it starts from: metrics.jsonl (and TensorBoard)
never hold a step twice after a resume into the same run_dir."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from skyrl_train.utils.tracking import MetricsTracker, drop_steps_after, read_metrics


def _run(run_dir: Path, steps: range, *, start_step: int = 0, **options: Any) -> None:
    tracker = MetricsTracker(run_dir, start_step=start_step, **options)
    for step in steps:
        tracker.log(step, {"reward/mean": step / 10, "run": float(start_step)})
    tracker.close()


def test_resuming_into_the_same_folder_logs_each_step_once(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 5))  # checkpoint at 2, crashed after logging step 4
    _run(tmp_path, range(3, 6), start_step=2)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row["run"] for row in rows] == [0.0, 0.0, 2.0, 2.0, 2.0]  # 3, 4 were replaced


def test_a_fresh_run_replaces_the_folders_metrics(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 3))
    _run(tmp_path, range(1, 3))
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_torn_last_line_is_dropped_and_the_file_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert drop_steps_after(path, 2) == 1
    assert path.read_bytes() == b'{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp left
    assert drop_steps_after(path, 2) == 0
    assert drop_steps_after(tmp_path / "absent.jsonl", 0) == 0


def test_jsonl_off_leaves_the_file_alone(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 4))
    _run(tmp_path, range(2, 4), start_step=1, trackers=[])
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_tensorboard_purges_the_steps_the_run_takes_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, Any]] = []

    class RecordingWriter:
        def __init__(self, log_dir: str, **kwargs: Any) -> None:
            made.append({"log_dir": log_dir, **kwargs})

        def add_scalar(self, *args: object) -> None:
            pass

        def close(self) -> None:
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = RecordingWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    MetricsTracker(tmp_path, trackers=["tensorboard"], start_step=4).close()
    assert made == [{"log_dir": str(tmp_path / "tensorboard"), "purge_step": 5}]

"""Run folders from the command line (issue 14): a ``-m`` sweep gives each job its own
folder and job log, and a launch the config check refuses creates nothing. A folder
belongs to one run whatever its trackers wrote (issue 25): a second fresh launch is
refused before Ray starts and leaves the first run's files byte for byte; of two
started together, exactly one runs (issue 38)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, begin_save, commit_save
from skyrl_train.runs.folder import run_artefacts
from skyrl_train.utils.durable import write_file
from skyrl_train.utils.tracking import read_metrics
from tests.folder_snapshot import snapshot

REPO = Path(__file__).resolve().parents[3]
TINY_RUN = [
    "trainer.num_steps=1",
    "trainer.eval_interval=0",
    "trainer.train_batch_size=1",
    "trainer.policy_mini_batch_size=1",
    "trainer.micro_train_batch_size_per_gpu=2",
    "trainer.micro_forward_batch_size_per_gpu=2",
    "generator.n_samples_per_prompt=2",
    "generator.max_turns=1",
    "logging.progress_bar=false",
    "logging.plot=false",
]


def _launch(*args: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyrl_train.entrypoints.main_base", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "skyrl_train.entrypoints.main_base", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called for a launch the run folder refuses")

    monkeypatch.setattr(ray, "init", refuse)


def test_a_launch_refused_for_its_run_dir_changes_nothing_and_starts_no_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_ray(monkeypatch)
    run_dir = tmp_path / "run"
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"first run")
    folder = begin_save(run_dir / "checkpoints", step=10)
    write_file(folder / "policy_rank0.pt", b"first run's weights")
    write_file(folder / DRIVER_FILE, json.dumps({"step": 10, "world_size": 1}).encode())
    commit_save(folder, step=10)
    before = snapshot(run_dir)
    with (
        pytest.raises(ConfigValidationError) as info,
        launch(load_config([f"trainer.run_dir={run_dir}"])),
    ):
        pytest.fail("launch must not yield into another run's folder")
    assert info.value.path == "trainer.run_dir"
    assert "checkpoints/step_000010 (" in info.value.reason
    assert "tensorboard (" in info.value.reason
    assert snapshot(run_dir) == before  # no run.json, no main_base.log

    # latest, in a folder a run wrote without saving a checkpoint: refused too.
    started = tmp_path / "started"
    started.mkdir()
    (started / "main_base.log").write_text("preempted\n")
    cfg = load_config([f"trainer.run_dir={started}", "trainer.resume_from=latest"])
    with pytest.raises(ConfigValidationError) as info, launch(cfg):
        pytest.fail("launch must not yield with nothing to resume in a used folder")
    assert info.value.path == "trainer.resume_from"
    assert [p.name for p in started.iterdir()] == ["main_base.log"]
    assert (started / "main_base.log").read_text() == "preempted\n"


def test_a_refused_launch_creates_no_folder_and_no_log(tmp_path: Path) -> None:
    proc = _launch("trainer.num_steps=0", "trainer.run_dir=runs/refused", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "trainer.num_steps: expected an int >= 1, got 0" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no runs/refused, no main_base.log, no outputs/


def test_a_misspelt_key_is_refused_with_the_closest_key_before_hydra_runs(tmp_path: Path) -> None:
    proc = _launch("trainer.num_stpes=1", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "did you mean 'trainer.num_steps'" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_two_job_sweep_writes_two_run_folders(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = _launch(
        "-m", *TINY_RUN, f"trainer.run_dir={sweep}", "trainer.seed=0,1", cwd=tmp_path, timeout=500
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {job: read_metrics(sweep / job / "metrics.jsonl") for job in ("0", "1")}
    assert [r["step"] for r in rows["0"]] == [1] and [r["step"] for r in rows["1"]] == [1]
    assert rows["0"][0] != rows["1"][0]  # different seeds, separate files
    for job in ("0", "1"):
        assert (
            "skyrl_train.trainer.loop][INFO] - step 1 "
            in (sweep / job / "main_base.log").read_text()
        )
    assert not (sweep / "metrics.jsonl").exists()


@pytest.mark.slow
def test_two_launches_together_one_runs_and_a_later_one_into_its_tensorboard_run_is_refused(
    tmp_path: Path,
) -> None:
    # Two fresh launches started together into one free folder (issue 38): exactly one
    # runs; the other is refused before Ray, naming it (or, had the first already
    # finished, its files).
    run_dir = tmp_path / "run"
    args = [
        *TINY_RUN,
        "trainer.ckpt_interval=1",
        "logging.trackers=[tensorboard]",
        f"trainer.run_dir={run_dir}",
    ]
    together = [_start(*args, cwd=tmp_path) for _ in range(2)]
    outputs = [proc.communicate(timeout=500) for proc in together]
    ran = [i for i, proc in enumerate(together) if proc.returncode == 0]
    assert len(ran) == 1, [err[-3000:] for _, err in outputs]
    first = subprocess.CompletedProcess(args, 0, *outputs[ran[0]])
    out, err = outputs[1 - ran[0]]
    held = f"held by the launch of pid {together[ran[0]].pid} on host " in err
    assert held or "trainer.run_dir: expected a folder no other run has written to" in err, err
    assert "Started a local Ray instance" not in out + err
    # No metrics.jsonl with this tracker: the refusal must key on the run's other files.
    assert first.returncode == 0, first.stderr[-4000:]
    assert (run_dir / "checkpoints" / "step_000001").is_dir()
    assert any((run_dir / "tensorboard").iterdir())
    assert not (run_dir / "metrics.jsonl").exists()
    # Every entry the run left is one the guard knows (runs.folder.RUN_ARTEFACTS).
    known = {path.relative_to(run_dir).parts[0] for path, _ in run_artefacts(run_dir)}
    assert known == {p.name for p in run_dir.iterdir()}
    before = snapshot(run_dir)

    second = _launch(*args, cwd=tmp_path, timeout=300)
    assert second.returncode != 0
    assert "trainer.run_dir: expected a folder no other run has written to" in second.stderr
    # The first few artefacts are named, the rest counted.
    assert "checkpoints/step_000001 (" in second.stderr
    assert "tensorboard (" in second.stderr  # a result, named before the run's logs
    assert "Started a local Ray instance" not in second.stdout + second.stderr
    assert snapshot(run_dir) == before

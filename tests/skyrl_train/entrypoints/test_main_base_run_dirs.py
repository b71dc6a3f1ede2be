"""Run folders from the command line (issue 14): a ``-m`` sweep gives each job its own
folder and job log, and a launch the config check refuses creates nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_train.utils.tracking import read_metrics

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

"""Checkpoints end to end: a damaged ``trainer.resume_from`` fails before Ray starts,
a resume below a later checkpoint needs ``trainer.overwrite_later_checkpoints``, and a
run resumed into its own run_dir (``trainer.resume_from=latest``) logs every step once
and keeps ``trainer.max_ckpts_to_keep`` verified checkpoints."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _e2e import SMALL, new_pids, ray_daemon_pids, with_overrides

from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch, run
from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.checkpoint import (
    DRIVER_FILE,
    begin_save,
    commit_save,
    verify_checkpoint,
    write_file,
)
from skyrl_train.utils.tracking import read_metrics

REPO = Path(__file__).resolve().parents[3]


def _corrupt_checkpoint(root: Path) -> Path:
    """A committed one-rank checkpoint whose rank file then lost 64 bytes to garbage."""
    folder = begin_save(root, step=1)
    state = {"world_size": 1, "model": {"w": torch.ones(256)}}
    write_file(folder / "policy_rank0.pt", lambda fh: torch.save(state, fh))
    write_file(folder / DRIVER_FILE, json.dumps({"step": 1, "world_size": 1}).encode())
    final = commit_save(folder, step=1)
    target = final / "policy_rank0.pt"
    data = bytearray(target.read_bytes())
    data[200:264] = b"\x00" * 64
    target.write_bytes(bytes(data))
    return final


def test_a_corrupt_resume_checkpoint_fails_before_ray_starts_in_the_cli(tmp_path: Path) -> None:
    checkpoint = _corrupt_checkpoint(tmp_path / "checkpoints")
    daemons_before = ray_daemon_pids()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_train.entrypoints.main_base",
            *SMALL,
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.resume_from={checkpoint}",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "CheckpointError" in output
    assert f"trainer.resume_from: {checkpoint / 'policy_rank0.pt'}: expected sha256 " in output
    assert "Started a local Ray instance" not in output
    assert "central directory" not in output  # torch never got to read it
    assert new_pids(ray_daemon_pids, daemons_before, timeout_s=0) == set()


def test_a_corrupt_resume_checkpoint_never_reaches_ray_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    calls: list[object] = []

    def no_ray(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise AssertionError("ray.init was called before the checkpoint was verified")

    monkeypatch.setattr(ray, "init", no_ray)
    checkpoint = _corrupt_checkpoint(tmp_path / "checkpoints")
    cfg = load_config(
        [*SMALL, f"trainer.run_dir={tmp_path / 'run'}", f"trainer.resume_from={checkpoint}"]
    )
    with pytest.raises(CheckpointError) as info, launch(cfg):
        pytest.fail("launch must not yield with a corrupt checkpoint")
    assert info.value.file == checkpoint / "policy_rank0.pt"
    assert calls == []


@pytest.mark.slow
def test_resume_into_the_same_run_dir_logs_each_step_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    args = with_overrides(
        SMALL,
        "trainer.num_steps=3",
        "trainer.eval_interval=0",
        "trainer.max_ckpts_to_keep=2",
        "logging.plot=false",
        f"trainer.run_dir={run_dir}",
    )
    first = run(load_config(args))
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    first_rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in first_rows] == [1, 2, 3]

    # Resuming from step 2 would re-take step 3 over the saved one: refused before Ray
    # unless the launch says so (trainer.overwrite_later_checkpoints).
    step3_bytes = (root / "step_000003" / "policy_rank0.pt").read_bytes()
    below = load_config([*args, f"trainer.resume_from={root / 'step_000002'}"])
    with pytest.raises(ConfigValidationError) as info, launch(below):
        pytest.fail("launch must not yield below a later checkpoint without the key")
    assert info.value.path == "trainer.overwrite_later_checkpoints"
    assert (root / "step_000003" / "policy_rank0.pt").read_bytes() == step3_bytes

    # As after a crash that cut step 3's save short of a valid manifest: latest skips
    # it, naming it, and resumes from step 2 into the same folder.
    (root / "step_000003" / "manifest.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="skyrl_train.runs.folder"):
        resumed = run(load_config([*args, "trainer.resume_from=latest"]))
    assert f"skipping {root / 'step_000003'}: " in caplog.text
    assert len(resumed) == 1  # started after step 2: the resolved folder was loaded
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[:2] == first_rows[:2]
    for key, value in rows[2].items():
        if key == "step" or key.startswith("timing/") or key.endswith("wall_s"):
            continue
        # Same tolerance as test_main_base's resume: request batching moves fp32 ~1e-6.
        assert value == pytest.approx(first[2][key], rel=1e-5, abs=1e-5), key
    # Step 3 was re-saved whole; the damaged one was renamed aside, not deleted.
    names = sorted(p.name for p in root.iterdir())
    assert names[:2] == ["step_000002", "step_000003"] and len(names) == 3
    assert names[2].startswith("step_000003.replaced-")
    assert [verify_checkpoint(root / n).step for n in names[:2]] == [2, 3]

"""Ctrl-C in the middle of a run: the launch exits and leaves no actor or server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _e2e import SMALL, new_pids, ray_actor_pids, ray_daemon_pids, with_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
ACTORS = ("PolicyTrainer", "InferenceServerActor")


def _ours() -> set[int]:
    return ray_daemon_pids().union(*(ray_actor_pids(name) for name in ACTORS))


@pytest.mark.parametrize(
    "mode",
    [
        [],
        # Generation running ahead of training when the signal lands (issue 13).
        ["trainer.fully_async.enabled=true", "trainer.algorithm.use_tis=true"],
    ],
    ids=["sync", "fully_async"],
)
def test_ctrl_c_mid_run_stops_every_actor_and_ray(tmp_path: Path, mode: list[str]) -> None:
    before = _ours()
    run_dir = tmp_path / "run"
    args = with_overrides(
        SMALL,
        "trainer.num_steps=200",
        "trainer.ckpt_interval=0",
        f"trainer.run_dir={run_dir}",
        *mode,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A suite started in the background by a non-interactive shell (`cmd &`) runs with
    # SIGINT ignored, and exec keeps an ignored signal: the launch would then train all
    # 200 steps and exit 0. A handled SIGINT reaches the child as the default, which is
    # what a terminal's Ctrl-C meets.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "skyrl_train.entrypoints.main_base", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        # Interrupt once a step has finished: every actor is up and training.
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no training step finished in 300 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, stderr[-4000:]
    assert "KeyboardInterrupt" in stderr
    assert new_pids(_ours, before) == set()
    steps = len(metrics.read_text().splitlines())
    assert 1 <= steps < 200

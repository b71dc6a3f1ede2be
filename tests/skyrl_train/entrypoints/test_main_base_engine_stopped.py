"""A builtin inference engine that dies mid-run ends the launch naming it, with the last
lines of its own log, which stays in ``<run_dir>/engines`` (the vLLM case:
``test_main_base_vllm.py``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _e2e import SMALL, new_pids, ray_actor_pids, ray_daemon_pids, with_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
STOPPED = "inference.errors.EngineStoppedError: "


def _ours() -> set[int]:
    return ray_daemon_pids().union(
        ray_actor_pids("PolicyTrainer"), ray_actor_pids("InferenceServerActor")
    )


def test_a_builtin_engine_killed_mid_run_ends_the_launch_with_its_log_tail(
    tmp_path: Path,
) -> None:
    before = _ours()
    before_servers = ray_actor_pids("InferenceServerActor")
    run_dir = tmp_path / "run"
    args = with_overrides(
        SMALL, "trainer.num_steps=200", "trainer.ckpt_interval=0", f"trainer.run_dir={run_dir}"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyrl_train.entrypoints.main_base", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no training step finished in 300 s"
            time.sleep(0.5)
        (server,) = ray_actor_pids("InferenceServerActor") - before_servers
        os.kill(server, signal.SIGKILL)  # the actor's process: its server thread with it
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    log = run_dir / "engines" / "engine-0.log"
    text = log.read_text()  # kept: nothing deletes it
    assert re.search(r"serving \S+ at http://127\.0\.0\.1:\d+", text), text
    lines = stderr.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(STOPPED)), None)
    assert at is not None, stderr[-4000:]
    print("\n" + "\n".join(lines[at : at + 5]))
    assert lines[at] == (
        f"{STOPPED}generator.inference_engine: expected every builtin engine to run until "
        "the end, got 1 that stopped mid-run:"
    )
    assert re.match(r"engine 0 \(http://127\.0\.0\.1:\d+\): its actor is gone \(", lines[at + 1])
    assert lines[at + 2] == f"--- last log lines ({log}) ---"
    assert lines[at + 3] == text.splitlines()[0]  # the log's own lines, from its start
    assert new_pids(_ours, before) == set()

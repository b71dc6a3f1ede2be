"""End to end: ``python -m skyrl_train.entrypoints.evaluate`` on a one-row dataset with
the built-in model, a real local Ray and a real inference server; ``eval.json`` holds
every documented key, and no process the command started outlives it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from _e2e import new_pids

from skyrl_train.runs.folder import run_artefacts

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
MARKER = "SKYRL_EVALUATE_E2E"
"""Set only in the command's environment: Ray's daemons and workers inherit it, so a
process still holding it after the command exited is one the command left behind."""

FIGURES = {
    "rows",
    "failed_rows",
    "samples",
    "reward_mean",
    "reward_std",
    "success_rate",
    "pass@1",
    "pass@2",
    "response_length_mean",
    "generated_tokens_mean",
    "correct_if",
}


def marked_pids(token: str) -> set[int]:
    needle = f"{MARKER}={token}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.add(int(entry))
            except OSError:
                continue
    return found


def test_one_row_end_to_end_leaves_eval_json_and_nothing_running(tmp_path: Path) -> None:
    data = tmp_path / "one.jsonl"
    row = {
        "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": "5"},
        "data_source": "arith",
    }
    data.write_text(json.dumps(row) + "\n")
    run_dir = tmp_path / "eval"
    token = secrets.token_hex(8)
    env = {**os.environ, MARKER: token, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_train.entrypoints.evaluate",
            f"data.val_data=[{data}]",
            "generator.eval_n_samples_per_prompt=2",
            "generator.eval_sampling_params.temperature=1.0",
            "generator.max_turns=1",
            "generator.max_tokens_per_turn=8",
            f"trainer.run_dir={run_dir}",
            "ray.num_cpus=2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Ray reaps its daemons and workers asynchronously; none may stay.
    assert new_pids(lambda: marked_pids(token), set()) == set()

    report = json.loads((run_dir / "eval.json").read_text())
    assert {
        "format",
        "version",
        "model",
        "val_data",
        "environment",
        "eval_sampling_params",
        "n_samples_per_prompt",
        "seed",
        "ks",
        "overall",
        "by_data_source",
        "failed_rows",
        "wall_s",
    } <= set(report)
    assert (report["format"], report["ks"], report["failed_rows"]) == ("skyrl-r3-eval", [1, 2], [])
    assert report["model"] is None and report["val_data"] == [str(data)]
    assert set(report["by_data_source"]) == {"arith"}
    for figures in (report["overall"], report["by_data_source"]["arith"]):
        assert set(figures) == FIGURES
        assert (figures["rows"], figures["samples"], figures["failed_rows"]) == (1, 2, 0)
        assert 0.0 <= figures["pass@1"] <= figures["pass@2"] <= 1.0
        assert figures["response_length_mean"] >= 1
    # Only eval.json and the logs: an evaluation does not claim the folder as a run's.
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "eval.json",
        "evaluate-engines",
        "evaluate.log",
    ]
    assert run_artefacts(run_dir) == []
    # The server's own log is kept, beside the evaluation's.
    assert "starting the engine on" in (run_dir / "evaluate-engines" / "engine-0.log").read_text()
    assert "eval.json: 1 rows x 2 samples, 0 failed" in (run_dir / "evaluate.log").read_text()
    assert "inference servers: http://127.0.0.1:" in done.stdout

"""End to end on dataset files: the README's command, for 2 steps, with validation rows.

A checkpoint from ``scripts/make_checkpoint.py``'s library function, the arithmetic
dataset from ``scripts/make_arith_dataset.py``, and the ``gsm8k`` environment grading
each row against its ``reward_spec``.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import ray
from _e2e import SMALL

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import run
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "make_arith_dataset.py"


def _make_dataset(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_arith_dataset", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(out), "--train", "16", "--val", "3", "--seed", "5"]) == 0


def test_two_steps_on_the_generated_dataset_with_validation_rows(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=0)
    _make_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            *[o for o in SMALL if not o.startswith(("environment.", "+environment."))],
            f"model.path={checkpoint}",
            f"data.train_data=[{tmp_path / 'data' / 'train.parquet'}]",
            f"data.val_data=[{tmp_path / 'data' / 'validation.parquet'}]",
            "environment.env_class=gsm8k",
            "generator.max_turns=1",
            "generator.max_tokens_per_turn=16",
            f"trainer.run_dir={run_dir}",
            "logging.plot=false",
        ]
    )
    history = run(cfg)
    assert len(history) == 2
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    final = rows[-1]
    # Evaluation ran on the validation rows, and is reported per data source.
    for key in ("eval/reward_mean", "eval/reward_mean/arith/gsm8k", "reward/mean"):
        assert math.isfinite(final[key]), key
    assert final["eval/reward_mean"] == final["eval/reward_mean/arith/gsm8k"]
    assert not ray.is_initialized()

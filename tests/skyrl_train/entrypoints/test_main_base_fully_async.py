"""A real fully async launch (issue 13): the servers report the policy version with
every reply, generation runs one step ahead, and routing replay still routes every
trained token as generation did (agreement 1.000 at staleness 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _e2e import SMALL, with_overrides

from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow


def test_a_fully_async_run_reports_versions_and_replays_exactly(tmp_path: Path) -> None:
    cfg = load_config(
        with_overrides(
            SMALL,
            "trainer.num_steps=4",
            "trainer.ckpt_interval=0",
            "trainer.eval_interval=0",
            "trainer.fully_async.enabled=true",
            "trainer.fully_async.max_staleness_steps=1",
            "trainer.algorithm.use_tis=true",
            f"trainer.run_dir={tmp_path / 'run'}",
        )
    )
    with launch(cfg) as job:
        history = job.train()
    assert [int(m["async/trained_version"]) for m in history] == [0, 1, 2, 3]
    for metrics in history:
        assert metrics["async/staleness_max"] <= 1
        assert metrics["r3/router_agreement_trained"] == 1.0
        assert metrics["train/tis_weight_mean"] > 0
    # With generation one step ahead, some step trained on an older policy's turns.
    assert max(m["async/staleness_max"] for m in history) == 1
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]

"""End to end, 8 steps of the embedded default with every remedy switched on (dynamic
sampling, KL loss, entropy bonus, the flat-step guard): the learning signals are
logged every step and finite. Whether the run learns is shown by scripts/compare_r3.py and the README
figure, not by a timed test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import run
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

EVERY_STEP = (
    "reward/mean",
    "reward/success_rate",
    "policy/entropy",
    "policy/kl_to_ref",
    "policy/clip_fraction",
    "advantage/zero_variance_group_frac",
    "dynamic_sampling/rounds",
    "dynamic_sampling/varying_group_frac",
    "train/policy_loss",
    "train/grad_norm",
    "train/optimizer_steps",
    "train/skipped_optimizer_steps",
    "mismatch_trained/k3_kl",
)


def test_eight_steps_log_finite_learning_signals(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            f"trainer.run_dir={run_dir}",
            "trainer.num_steps=8",
            "trainer.eval_interval=4",
            "trainer.algorithm.dynamic_sampling.type=filter",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=2",
            "trainer.algorithm.use_kl_loss=true",
            "trainer.algorithm.use_entropy_loss=true",
            "logging.progress_bar=false",
            "ray.num_cpus=2",
            "trainer.policy.optimizer_config.num_stable_steps=32",
        ]
    )
    updates = cfg.trainer.train_batch_size // cfg.trainer.policy_mini_batch_size
    assert updates == 8  # the default recipe's (docs/experiments.md)
    run(cfg)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 9))
    for row in rows:
        for key in EVERY_STEP:
            assert row.get(key) is not None and math.isfinite(row[key]), (row["step"], key)
        assert 1.0 <= row["dynamic_sampling/rounds"] <= 2.0
        assert 0.0 <= row["advantage/zero_variance_group_frac"] <= 1.0
        # One update per mini-batch (eight a step by default): each either steps the
        # optimizer or, on a step whose groups are all flat (skip_flat_steps), is skipped.
        assert row["train/optimizer_steps"] + row["train/skipped_optimizer_steps"] == updates
    # Before the first update the policy is its reference: the KL is exactly zero;
    # after eight updates it is not.
    assert rows[0]["policy/kl_to_ref"] == 0.0
    assert rows[-1]["policy/kl_to_ref"] > 0.0
    for step in (4, 8):
        row = rows[step - 1]
        assert math.isfinite(row["eval/reward_mean"]) and math.isfinite(row["eval/success_rate"])
    assert (run_dir / "metrics.png").is_file()
    # The rate holds for num_stable_steps updates (32 here), then falls linearly to 0
    # over the rest of the run (lr_decay_steps null, config/lr_schedule.py): each step
    # logs its last update's rate, so the worker was handed the run's length, not the
    # config's null. turn_grpo leaves the flat-step guard off, so every update steps.
    peak, total = cfg.trainer.policy.optimizer_config.lr, 8 * updates
    assert cfg.trainer.policy.optimizer_config.lr_decay_steps is None
    assert all(row["train/skipped_optimizer_steps"] == 0 for row in rows)
    last = [updates * s - 1 for s in range(1, 9)]
    expected = [peak if k < 32 else peak * (1 - (k - 32) / (total - 32)) for k in last]
    assert [row["train/lr"] for row in rows] == pytest.approx(expected, rel=1e-6)

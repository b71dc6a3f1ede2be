"""Launch rules of sampler replay (``config/sampler_replay.py``): each refusal names the
key to change, and comes before Ray or any model starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_train.config import load_config, validate_cfg
from skyrl_train.errors import ConfigValidationError

REPO = Path(__file__).resolve().parents[3]
SP = "generator.sampling_params"


def _refusal(overrides: list[str]) -> ConfigValidationError:
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config(overrides))
    assert str(info.value).startswith(info.value.path + ": ")
    return info.value


@pytest.mark.parametrize(
    "overrides",
    [
        [f"{SP}.temperature=1.5", f"{SP}.top_p=0.9"],  # top-p alone over the built-in vocab
        [f"{SP}.temperature=0.7", f"{SP}.top_k=5"],
        ["trainer.algorithm.temperature=1.0"],  # the rollout's, spelt out
        [
            f"{SP}.temperature=1.5",
            "trainer.algorithm.temperature=1.0",
            "trainer.algorithm.use_tis=true",
        ],
        [
            f"{SP}.temperature=1.5",
            "trainer.algorithm.temperature=1.0",
            "trainer.algorithm.off_policy_correction.tis_ratio_type=sequence",
        ],
        [f"{SP}.temperature=0.0", "trainer.num_steps=1", f"{SP}.temperature=0.5"],  # last wins
    ],
)
def test_replayable_sampling_is_accepted(overrides: list[str]) -> None:
    validate_cfg(load_config(overrides))


def test_training_at_temperature_zero_is_refused() -> None:
    err = _refusal([f"{SP}.temperature=0"])
    assert err.path == f"{SP}.temperature"
    assert "every advantage is 0" in str(err) and str(err).endswith("got 0.0")


def test_another_trainer_temperature_needs_an_off_policy_correction() -> None:
    err = _refusal([f"{SP}.temperature=1.5", "trainer.algorithm.temperature=1.0"])
    assert err.path == "trainer.algorithm.temperature"
    assert "expected null or 1.5" in str(err) and "got 1.0" in str(err)
    assert "off_policy_correction.tis_ratio_type" in str(err)  # says how to make it deliberate


def test_a_kept_set_wider_than_the_side_channel_is_refused() -> None:
    err = _refusal([f"{SP}.top_k=40", "generator.max_sample_support_k=32"])
    assert err.path == "generator.max_sample_support_k"
    assert "expected >= generator.sampling_params.top_k (40)" in str(err)
    err = _refusal([f"{SP}.top_p=0.9", "generator.max_sample_support_k=100"])
    assert err.path == f"{SP}.top_k"
    assert "model's 264 tokens" in str(err)


def test_temperature_zero_is_refused_by_the_launch_before_ray(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_train.entrypoints.main_base",
            f"trainer.run_dir={run_dir}",
            f"{SP}.temperature=0",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "generator.sampling_params.temperature: expected > 0 for training" in proc.stderr
    assert "ray" not in proc.stderr.lower().replace("array", "")
    assert not run_dir.exists()  # a refused launch leaves nothing

"""The learning-rate decay's length (``config/lr_schedule.py``): a null
``lr_decay_steps`` is the run's optimizer steps after the warm-up, worked out from
the keys that set them, so the decay ends with the run whatever its length; a number
is kept as given."""

from __future__ import annotations

import pytest

from skyrl_train.config.compose import load_config
from skyrl_train.config.lr_schedule import run_optimizer_config, run_optimizer_steps

OPT = "trainer.policy.optimizer_config"


@pytest.mark.parametrize(
    ("overrides", "steps"),
    [
        (["trainer.num_steps=150", "trainer.policy_mini_batch_size=1"], 150 * 8),
        (["trainer.num_steps=300", "trainer.policy_mini_batch_size=1"], 300 * 8),
        (["trainer.num_steps=150", "trainer.policy_mini_batch_size=4"], 150 * 2),
        (
            [
                "trainer.num_steps=10",
                "trainer.policy_mini_batch_size=2",
                "trainer.update_epochs_per_batch=3",
            ],
            10 * 4 * 3,
        ),
    ],
)
def test_a_null_decay_spans_the_runs_optimizer_steps(overrides: list[str], steps: int) -> None:
    flat = [f"{OPT}.lr_decay_steps=null", f"{OPT}.num_stable_steps=0"]
    cfg = load_config([*overrides, *flat, f"{OPT}.num_warmup_steps=0"])
    assert run_optimizer_steps(cfg) == steps
    assert run_optimizer_config(cfg).lr_decay_steps == steps
    warm = load_config([*overrides, *flat, f"{OPT}.num_warmup_steps=5"])
    assert run_optimizer_config(warm).lr_decay_steps == steps - 5
    stable = load_config([*overrides, f"{OPT}.lr_decay_steps=null", f"{OPT}.num_stable_steps=7"])
    assert run_optimizer_config(stable).lr_decay_steps == steps - 7
    # The config itself is left as it was: the resolved copy goes to the workers.
    assert warm.trainer.policy.optimizer_config.lr_decay_steps is None


def test_a_given_decay_and_no_decay_are_kept() -> None:
    for value in (0, 37):
        cfg = load_config([f"{OPT}.lr_decay_steps={value}"])
        assert run_optimizer_config(cfg).lr_decay_steps == value

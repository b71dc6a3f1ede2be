"""The learning-rate schedule's keys (``trainer.policy.optimizer_config``): the decay's
length, resolved from the run when it is null (what the warm-up and the stable steps
leave of it), and the floor it falls to.

A decay given in optimizer steps silently stops fitting the run when ``num_steps`` or
the mini-batch size changes (the rate reaches its floor halfway through a run twice as
long, or never in one half as long), so null, the default's value, means "over the
whole run" and is worked out here, where the workers are built
(``workers/factory.py``). The schedule itself is ``algorithms/optim.scheduled_lr``.
"""

from __future__ import annotations

import dataclasses

from skyrl_train.config.schema import OptimizerConfig, PPOConfig
from skyrl_train.errors import ConfigValidationError

OPTIMIZER = "trainer.policy.optimizer_config"


def run_optimizer_steps(cfg: PPOConfig) -> int:
    """The optimizer steps a whole run plans: each step's batch split into mini-batches,
    each trained ``update_epochs_per_batch`` times (a step the flat-step guard skips
    takes none, so a run may take fewer)."""
    t = cfg.trainer
    return (
        t.num_steps * (t.train_batch_size // t.policy_mini_batch_size) * t.update_epochs_per_batch
    )


def run_optimizer_config(cfg: PPOConfig) -> OptimizerConfig:
    """``trainer.policy.optimizer_config`` with a null ``lr_decay_steps`` replaced by the
    run's optimizer steps after the warm-up and the stable steps
    (``run_optimizer_steps``; at least 1)."""
    opt = cfg.trainer.policy.optimizer_config
    if opt.lr_decay_steps is not None:
        return opt
    steps = max(1, run_optimizer_steps(cfg) - opt.num_warmup_steps - opt.num_stable_steps)
    return dataclasses.replace(opt, lr_decay_steps=steps)


def check_lr_schedule(cfg: PPOConfig) -> None:
    """Refuse a ``min_lr`` above the peak rate, or one that no decay reaches."""
    opt = cfg.trainer.policy.optimizer_config
    if opt.min_lr > opt.lr:
        raise ConfigValidationError(
            f"{OPTIMIZER}.min_lr",
            expected=f"at most {OPTIMIZER}.lr ({opt.lr}): the decay falls from lr to it",
            got=str(opt.min_lr),
        )
    if opt.min_lr > 0 and opt.lr_decay_steps == 0:
        raise ConfigValidationError(
            f"{OPTIMIZER}.min_lr",
            expected=f"0 with {OPTIMIZER}.lr_decay_steps 0 (no decay reaches it)",
            got=str(opt.min_lr),
        )

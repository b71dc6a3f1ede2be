"""The policy's optimizer and learning-rate schedule, for every trainer backend.

``torch.optim.AdamW`` built from ``trainer.policy.optimizer_config``, its rate warmed
up linearly over ``num_warmup_steps`` optimizer steps, held for ``num_stable_steps`` and
decayed linearly to ``min_lr`` over ``lr_decay_steps`` after them (docs/configuration.md,
"Warmup, trackers, stopping"), and the step itself, skipped on a non-finite gradient
norm. A
backend reduces its gradients and computes their global norm its own way (Megatron's
parallel groups: ``workers/megatron/gradients.py``; FSDP's shards:
``workers/fsdp/state.py``), clips them with ``clip_to_norm_`` and then calls
``optimizer_step``.

Plain torch AdamW rather than Megatron's optimizer wrapper, which hard-codes CUDA; the
same optimizer on every backend keeps their steps comparable update for update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from skyrl_train.config.schema import OptimizerConfig

ADAM_EPS = 1e-8
"""AdamW's epsilon (torch's and megatron-core's default); no config key sets it."""


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimizerConfig
) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``config``'s peak rate, betas and weight decay; the
    rate each step uses is set by ``optimizer_step``."""
    beta1, beta2 = config.adam_betas
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(beta1, beta2),
        eps=ADAM_EPS,
    )


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far, read from AdamW's own per-parameter ``step``
    count: a resumed run loads it with the optimizer state, so the schedule continues
    where it stopped instead of starting over. 0 before the first step."""
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def scheduled_lr(config: OptimizerConfig, optimizer: torch.optim.Optimizer) -> float:
    """The learning rate ``optimizer``'s next step uses: ``lr * (n + 1) /
    num_warmup_steps`` for the step after the n-th during the warm-up; after it ``lr``
    for ``num_stable_steps`` steps, then falling linearly to ``min_lr`` over
    ``lr_decay_steps`` steps (``lr`` for good with no decay, or with a null one
    outside a launch), then ``min_lr``: the warm-up, stable, decay shape."""
    n = steps_taken(optimizer)
    warmup = config.num_warmup_steps
    if n < warmup:
        return config.lr * (n + 1) / warmup
    decaying = n - warmup - config.num_stable_steps
    # A null decay ends with the run; a launch resolves it to the run's remaining
    # updates (config/lr_schedule.py). A worker built outside a launch has no run to
    # end, so its rate stays at lr.
    if not config.lr_decay_steps or decaying < 0:
        return config.lr
    done = min(1.0, decaying / config.lr_decay_steps)
    return config.lr - (config.lr - config.min_lr) * done


def clip_to_norm_(grads: Iterable[torch.Tensor], *, norm: float, max_norm: float) -> None:
    """Scale ``grads`` (whose global L2 norm is ``norm``, however a backend reduced it)
    in place down to ``max_norm`` when the norm is above it. ``max_norm`` <= 0 disables
    clipping (tests only: the schema wants > 0); a NaN norm is never above it."""
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)


def optimizer_step(optimizer: torch.optim.Optimizer, *, lr: float, grad_norm: float) -> bool:
    """One step at ``lr`` over the gradients already reduced and clipped; whether it
    was taken.

    A NaN norm passes a clip (NaN > limit is False) and AdamW would write NaN into
    every parameter it touches; skipped, the weights stay as they were and the trainer
    stops the run on the reported norm (``trainer/finite.py``).
    """
    if not math.isfinite(grad_norm):
        return False
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return True

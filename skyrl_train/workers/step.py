"""One optimizer step's body as both backends run it (``workers/base.py``'s gradient and
route contracts): the replay decision with the whole batch's routes checked first, the
step's start, each microbatch's loss, and the step's end (the learning rate, the
optimizer step skipped on a non-finite norm, the result). Each worker keeps only what is
its own: how microbatches run forward and backward (Megatron's schedules, FSDP's replay
sessions) and how gradients are reduced and clipped. Importing this module loads no
backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from skyrl_train.algorithms import optim
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch, batch_to
from skyrl_train.workers import routes as route_checks
from skyrl_train.workers.base import EntropyLossFn, LossFn, TrainStepResult

ROUTING_REPLAY_KEY = "trainer.policy.routing_replay.enabled"
"""The key a replay requested of a worker built with ``routing_replay=False`` is
refused naming, whichever backend."""


def check_replay(
    batch: TrainingBatch,
    replay_routes: bool | None,
    routers: route_checks.RouteLayout,
    *,
    routing_replay: bool,
    trajectory_ids: Sequence[str] | None = None,
) -> bool:
    """Whether this forward or step replays the batch's routes, the whole batch's routes
    validated against ``routers`` before any microbatch runs (``workers/routes.py``);
    ``routing_replay``: the worker's ``trainer.policy.routing_replay.enabled``."""
    return route_checks.replay_requested(
        batch,
        replay_routes,
        routers,
        enabled=routing_replay,
        enabled_key=ROUTING_REPLAY_KEY,
        trajectory_ids=trajectory_ids,
    )


def begin_step(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """Training mode and zeroed gradients: one call is one optimizer step."""
    model.train()
    optimizer.zero_grad(set_to_none=True)


class MicrobatchLosses:
    """The step's loss head: ``loss_fn`` on each microbatch's response logprobs (and its
    entropy when the step asked for it), each value kept for ``TrainStepResult.loss``."""

    def __init__(self, loss_fn: LossFn | EntropyLossFn, count: int) -> None:
        self.loss_fn = loss_fn
        self.values = torch.zeros(count, dtype=torch.float64)
        """One loss per microbatch (zeros on a pipeline stage without a loss)."""

    def __call__(
        self,
        m: int,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        microbatch: TrainingBatch,
    ) -> torch.Tensor:
        """Microbatch ``m``'s loss, the microbatch moved to the logprobs' device."""
        extra = (entropy,) if entropy is not None else ()
        value = self.loss_fn(logprobs, batch_to(microbatch, logprobs.device), *extra)  # type: ignore[arg-type]
        self.values[m] = float(value.detach())
        return value


def finish_step(
    optimizer: torch.optim.Optimizer,
    config: OptimizerConfig,
    *,
    grad_norm: float,
    losses: torch.Tensor,
    replayed: bool,
    routes: torch.Tensor | None,
) -> TrainStepResult:
    """Step the optimizer at the scheduled learning rate (the warm-up from its own step
    count) and report the step; ``losses``: every microbatch's, as the loss stage holds
    them."""
    lr = optim.scheduled_lr(config, optimizer)
    # Skipped on a NaN/inf norm: the trainer stops the run on it (trainer/finite.py).
    optim.optimizer_step(optimizer, lr=lr, grad_norm=grad_norm)
    return TrainStepResult(
        loss=float(losses.mean()),
        grad_norm=grad_norm,
        num_microbatches=len(losses),
        replayed=replayed,
        lr=lr,
        routes=routes,
    )

"""A worker's route refusal names the trajectory in production, not only in the tests
that pass ``trajectory_ids`` by hand: the collated batch carries each row's trajectory
(``TrainingBatch.trajectory_rows``) through the driver's data-parallel reorder and the
trainer's mini-batch slices, and ``PolicyTrainer`` hands the names to every worker
call. Before, a bad route on rank 1 was reported as "batch row 2" of that rank's
shard, a row no log or rollout names."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _stand_in_worker import ARCHITECTURE, check_stand_in
from test_replay_plan import RecordingWorker

from skyrl_train.config.compose import load_config
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.errors import RouteReplayError
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.trainer.data_parallel import shard_mini_batches
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers import routes as route_checks
from skyrl_train.workers.base import ForwardResult, TrainStepResult

TRAJECTORIES, PROMPT, RESPONSE = 8, 2, 3


class Routers:
    """The stand-in model's routers as the route check sees them."""

    num_layers = len(ARCHITECTURE.moe_layers)
    num_experts = ARCHITECTURE.num_experts
    top_k = ARCHITECTURE.num_experts_per_tok

    def describe_layer(self, route_layer: int) -> str:
        return route_checks.describe_route_layer(ARCHITECTURE.moe_layers, route_layer)


class RouteCheckingWorker(RecordingWorker):
    """Checks routes with the workers' own check (``routes.replay_requested``, what both
    backends' ``check_replay`` runs) and records the names each call was given."""

    def __init__(self) -> None:
        super().__init__(native=torch.ones(4, PROMPT + RESPONSE, 1, 1, dtype=torch.int64))
        self.names: list[tuple[str, list[str] | None]] = []

    def _check(self, kind: str, batch: TrainingBatch, replay: bool | None, names: Any) -> None:
        self.names.append((kind, None if names is None else list(names)))
        route_checks.replay_requested(
            batch, replay, Routers(), enabled=True, enabled_key="replay", trajectory_ids=names
        )

    def forward(
        self,
        batch: TrainingBatch,
        *,
        replay_routes: bool | None = None,
        trajectory_ids: Sequence[str] | None = None,
        **options: Any,
    ) -> ForwardResult:
        self._check("forward", batch, replay_routes, trajectory_ids)
        return super().forward(batch, replay_routes=replay_routes, **options)

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        replay_routes: bool | None = None,
        trajectory_ids: Sequence[str] | None = None,
        **options: Any,
    ) -> TrainStepResult:
        self._check("train_step", batch, replay_routes, trajectory_ids)
        return super().train_step(batch, replay_routes=replay_routes, **options)


def _rollout(bad: int | None = None) -> GeneratorOutput:
    """Eight one-turn trajectories, every token routed to expert 1 of the stand-in's
    two; trajectory ``bad`` routes its second token to expert 7."""
    routes = [np.ones((PROMPT + RESPONSE - 1, 1, 1), dtype=np.int32) for _ in range(8)]
    if bad is not None:
        routes[bad][1, 0, 0] = 7
    return GeneratorOutput(
        prompt_token_ids=[[1, 2]] * TRAJECTORIES,
        response_ids=[[3, 4, 5]] * TRAJECTORIES,
        loss_masks=[[1, 1, 1]] * TRAJECTORIES,
        rewards=[float(i % 2) for i in range(TRAJECTORIES)],
        token_rewards=[[0.0, 0.0, float(i % 2)] for i in range(TRAJECTORIES)],
        stop_reasons=["done"] * TRAJECTORIES,
        rollout_metrics={},
        rollout_logprobs=[[-1.0, -1.0, -1.0]] * TRAJECTORIES,
        routed_experts=routes,
    )


def _rank_one_shard(output: GeneratorOutput) -> TrainingBatch:
    """What the driver sends data-parallel rank 1 of 2 (``PolicyGroup.train``): mini-
    batches of four, so rank 1 holds trajectories 2, 3, 6 and 7 in that order."""
    batch = convert_to_training_batch(output, pad_token_id=0, workers=1)
    advantages = torch.linspace(-1, 1, TRAJECTORIES)[:, None].expand(-1, RESPONSE).clone()
    full = dataclasses.replace(batch, advantages=advantages)
    return shard_mini_batches(full, mini_batch_size=4, dp_size=2)[1]


def _trainer(tmp_path: Path) -> tuple[PolicyTrainer, RouteCheckingWorker]:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=1",  # two rows a mini-batch on this rank
            "generator.n_samples_per_prompt=2",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=4",
            "trainer.policy.routing_replay.enabled=true",
            "trainer.policy.routing_replay.source=rollout",
            "trainer.algorithm.use_entropy_loss=false",
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    worker = RouteCheckingWorker()
    trainer.worker = check_stand_in(worker)
    return trainer, worker


def test_every_worker_call_gets_the_names_of_its_rows(tmp_path: Path) -> None:
    trainer, worker = _trainer(tmp_path)

    trainer.train(_rank_one_shard(_rollout()), step=1)

    rows = ["#2", "#3", "#6", "#7"]
    assert (
        worker.names
        == [
            ("forward", rows),  # old log-probs, rollout routes replayed
            ("forward", rows),  # the native forward, for the r3/* metrics
            ("train_step", rows[:2]),
            ("train_step", rows[2:]),
        ]
    )


def test_a_bad_route_on_another_rank_is_refused_naming_its_trajectory(tmp_path: Path) -> None:
    trainer, _worker = _trainer(tmp_path)
    shard = _rank_one_shard(_rollout(bad=6))
    routes_before = shard.routed_experts.rectangle()  # type: ignore[union-attr]

    with pytest.raises(RouteReplayError) as info:
        trainer.train(shard, step=1)

    # Trajectory 6 is row 2 of rank 1's shard: the message names both.
    assert str(info.value).startswith("trajectory '#6' (batch row 2), layer 0, token 1: ")
    assert "got 7" in str(info.value)
    assert torch.equal(shard.routed_experts.rectangle(), routes_before)  # type: ignore[union-attr]


@pytest.mark.parametrize("method", ["forward", "train_step"])
def test_both_backends_take_the_names_the_trainer_passes(method: str) -> None:
    # The trainer passes them on every call: a backend without the keyword would
    # fail every production step with a TypeError.
    from skyrl_train.workers.fsdp.worker import FSDPPolicyWorker
    from skyrl_train.workers.megatron.worker import MegatronPolicyWorker

    for worker in (MegatronPolicyWorker, FSDPPolicyWorker):
        params = inspect.signature(getattr(worker, method)).parameters
        assert params["trajectory_ids"].kind is inspect.Parameter.KEYWORD_ONLY, worker

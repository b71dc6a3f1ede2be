"""The base of the trainer tests' stand-in workers: every ``workers.base.PolicyWorker``
member, each doing the least a trainer test needs, so a stand-in overrides only the
calls its test is about and still is a ``PolicyWorker`` (``check_stand_in``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms.mismatch import RouterAgreement, router_agreement, routes_differ
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.workers.base import (
    EntropyLossFn,
    ForwardResult,
    LossFn,
    PolicyWorker,
    RankInfo,
    TrainStepResult,
)
from skyrl_train.workers.microbatches import MicrobatchPlan

ARCHITECTURE = MoEArchitecture(
    family="qwen3_moe",
    vocab_size=8,
    hidden_size=4,
    num_layers=1,
    num_attention_heads=1,
    num_kv_heads=1,
    head_dim=4,
    num_experts=2,
    num_experts_per_tok=1,
    moe_ffn_hidden_size=4,
    moe_layers=(0,),
)


class StandInWorker:
    """One rank of one, weights in ``self.model`` (what ``named_parameters`` reports to
    the trainer's finiteness check); forward and train step are the subclass's."""

    def __init__(self) -> None:
        self.model: torch.nn.Module = torch.nn.Linear(1, 1)

    @property
    def architecture(self) -> MoEArchitecture:
        return ARCHITECTURE

    def rank_info(self) -> RankInfo:
        return RankInfo(rank=0, world_size=1, dp_rank=0, dp_size=1, ep_size=1)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return len(list(named_tensors))

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.model.named_parameters()

    def parameter_snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def swapped_weights(self, weights: Mapping[str, torch.Tensor]) -> AbstractContextManager[None]:
        return nullcontext()

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())

    def forward(
        self,
        batch: TrainingBatch,
        *,
        micro_batch_size: int | MicrobatchPlan | None = None,
        replay_routes: bool | None = None,
        capture_routes: bool = False,
        entropy: bool = False,
        temperature: float | None = None,
        drop_tokens: bool = True,
        trajectory_ids: Sequence[str] | None = None,
    ) -> ForwardResult:
        raise NotImplementedError("the stand-in's test defines forward")

    def rollout_router_agreement(
        self, batch: TrainingBatch, routes: torch.Tensor
    ) -> RouterAgreement:
        rollout = batch.routed_experts
        assert rollout is not None
        if isinstance(rollout, PackedRouteRows):  # as collated
            rollout = rollout.rectangle()
        return router_agreement(routes, rollout, ~batch.attention_mask.bool())

    def rollout_router_flips(self, batch: TrainingBatch, routes: torch.Tensor) -> torch.Tensor:
        rollout = batch.routed_experts
        assert rollout is not None
        if isinstance(rollout, PackedRouteRows):
            rollout = rollout.rectangle()
        return routes_differ(routes, rollout) & batch.attention_mask.bool()[:, :, None]

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: LossFn | EntropyLossFn,
        micro_batch_size: int | MicrobatchPlan,
        replay_routes: bool | None = None,
        entropy: bool = False,
        capture_routes: bool = False,
        trajectory_ids: Sequence[str] | None = None,
    ) -> TrainStepResult:
        raise NotImplementedError("the stand-in's test defines train_step")

    def scheduled_lr(self) -> float:
        return 1e-3

    def checkpoint_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": {}, "placement": []}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])


def check_stand_in(worker: object) -> PolicyWorker:
    """``worker``, once it has every ``PolicyWorker`` member (a stand-in that lacks
    one would only fail when a test first reaches it)."""
    assert isinstance(worker, PolicyWorker), type(worker).__name__
    return worker

"""One step's routing-replay plan: R3, R2 or none, decided once from the run's
``trainer.policy.routing_replay`` node and whether the batch carries the rollout's
routes, then read by every pass of ``PolicyTrainer.train`` (old log-probs, reference,
update) instead of flags that change between them.

- R3 (``source=rollout``, the batch has routes): the old-logprob forward and every
  update replay the rollout's routes; a second, native forward measures what R3
  removes.
- R2 (``source=old_policy``): the old-logprob forward runs the trainer's native routing
  and records it; the reference forward and every update replay that record, and the
  updates capture their own dispatch to prove it (``r2/router_agreement_update``).
- none: replay off, or R3 asked of a batch without routes; nothing is replayed.

Whatever the mode, a batch with the rollout's routes gets the ``r3/*`` agreement
metrics of the old-logprob forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from skyrl_train.config.schema import RoutingReplayConfig
from skyrl_train.dataset.batch import TrainingBatch

ReplayMode = Literal["r3", "r2", "none"]


@dataclass(frozen=True)
class PassRoutes:
    """What one forward does with routes: replay the batch's, capture its own."""

    replay: bool
    capture: bool


@dataclass(frozen=True)
class ReplayPlan:
    """The step's replay decisions (module docstring); build with ``decide``."""

    mode: ReplayMode
    rollout_routes: bool
    """The batch carries the rollout's routes: the ``r3/*`` agreement metrics (and the
    native log-prob mismatch) are measured, whatever the mode."""

    @classmethod
    def decide(cls, node: RoutingReplayConfig, *, rollout_routes: bool) -> ReplayPlan:
        """The plan for a batch with (``rollout_routes``) or without the rollout's routes
        under the ``trainer.policy.routing_replay`` node ``node``."""
        mode: ReplayMode = "none"
        if node.enabled and node.source == "old_policy":
            mode = "r2"
        elif node.enabled and rollout_routes:
            mode = "r3"
        return cls(mode=mode, rollout_routes=rollout_routes)

    @property
    def old_logprobs(self) -> PassRoutes:
        """The old-logprob forward: replays the rollout's routes under R3; captures its
        routes for the agreement metrics, and under R2 as the record to replay."""
        return PassRoutes(
            replay=self.mode == "r3", capture=self.rollout_routes or self.mode == "r2"
        )

    @property
    def native_forward(self) -> bool:
        """A second forward without replay, for the native-routing metrics: only when the
        old-logprob forward replayed."""
        return self.mode == "r3"

    @property
    def update(self) -> PassRoutes:
        """The reference forward and every update: replay the routes the update batch
        carries (``update_routes``); capture them under R2 for its agreement metric."""
        return PassRoutes(replay=self.mode != "none", capture=self.mode == "r2")

    @property
    def update_routes(self) -> Literal["rollout", "old_policy"] | None:
        """Whose routes the updates replay."""
        return {"r3": "rollout", "r2": "old_policy", "none": None}[self.mode]  # type: ignore[return-value]

    def update_batch(
        self, batch: TrainingBatch, *, old_logprobs: torch.Tensor, routes: torch.Tensor | None
    ) -> TrainingBatch:
        """A copy of ``batch`` for the reference and update passes (the caller's batch
        unchanged): the old log-probs set and, under R2, the old-logprob forward's
        ``routes`` in place of the rollout's (only needed for the metrics by then), with
        only the padding columns masked."""
        if self.mode != "r2":
            return dataclasses.replace(batch, old_logprobs=old_logprobs)
        if routes is None:
            raise ValueError(
                "routes: expected the old-logprob forward's captured routes to replay "
                "under trainer.policy.routing_replay.source=old_policy, got None"
            )
        return dataclasses.replace(
            batch,
            old_logprobs=old_logprobs,
            routed_experts=routes,
            router_padding_mask=~batch.attention_mask.bool(),
        )

"""The step's replay plan (``trainer/replay_plan.py``) and how ``PolicyTrainer.train``
follows it: each pass (old log-probs, native metrics, reference, update) replays and
captures what the plan says, R2 replays the old-logprob forward's own routes, and the
caller's batch comes back as it went in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _stand_in_worker import StandInWorker, check_stand_in

from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import RoutingReplayConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.trainer.replay_plan import PassRoutes, ReplayPlan
from skyrl_train.workers.base import ForwardResult, TrainStepResult
from skyrl_train.workers.microbatches import MicrobatchPlan

ROWS, PROMPT, RESPONSE = 4, 2, 3


@pytest.mark.parametrize(
    ("enabled", "source", "routes", "mode", "old", "native", "update", "whose"),
    [
        (True, "rollout", True, "r3", (True, True), True, (True, False), "rollout"),
        # R3 asked of a batch without routes: nothing to replay.
        (True, "rollout", False, "none", (False, False), False, (False, False), None),
        (True, "old_policy", True, "r2", (False, True), False, (True, True), "old_policy"),
        (True, "old_policy", False, "r2", (False, True), False, (True, True), "old_policy"),
        # Replay off: a batch with routes still gets the r3/* metrics.
        (False, "rollout", True, "none", (False, True), False, (False, False), None),
        (False, "old_policy", False, "none", (False, False), False, (False, False), None),
    ],
)
def test_the_plan_is_decided_once_from_the_mode_and_the_batch(
    enabled: bool,
    source: str,
    routes: bool,
    mode: str,
    old: tuple[bool, bool],
    native: bool,
    update: tuple[bool, bool],
    whose: str | None,
) -> None:
    node = RoutingReplayConfig(enabled=enabled, source=source)
    plan = ReplayPlan.decide(node, rollout_routes=routes)
    assert (plan.mode, plan.rollout_routes) == (mode, routes)
    assert plan.old_logprobs == PassRoutes(*old)
    assert plan.native_forward is native
    assert plan.update == PassRoutes(*update)
    assert plan.update_routes == whose
    with pytest.raises(AttributeError):
        plan.mode = "none"  # type: ignore[misc]  # frozen: no pass changes it


class RecordingWorker(StandInWorker):
    """Records what every forward and train step was asked to do with routes, and the
    routes each one's batch carried; a capture returns ``native`` (the routers' own)."""

    def __init__(self, native: torch.Tensor) -> None:
        super().__init__()
        self.native = native
        self.calls: list[tuple[str, bool | None, bool, torch.Tensor | None]] = []

    def forward(
        self,
        batch: TrainingBatch,
        *,
        replay_routes: bool | None = None,
        capture_routes: bool = False,
        entropy: bool = False,
        **options: Any,
    ) -> ForwardResult:
        self.calls.append(("forward", replay_routes, capture_routes, batch.routed_experts))
        shape = batch.response_mask.shape
        return ForwardResult(
            logprobs=torch.full(shape, -1.0) * batch.response_mask,
            routes=self.native.clone() if capture_routes else None,
            entropy=torch.ones(shape) * batch.response_mask if entropy else None,
        )

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: Any,
        micro_batch_size: int | MicrobatchPlan,
        replay_routes: bool | None = None,
        entropy: bool = False,
        capture_routes: bool = False,
        **options: Any,
    ) -> TrainStepResult:
        self.calls.append(("train_step", replay_routes, capture_routes, batch.routed_experts))
        assert batch.old_logprobs is not None
        logprobs = batch.old_logprobs.clone().requires_grad_()
        loss = loss_fn(logprobs, batch)
        return TrainStepResult(
            loss=float(loss.detach()),
            grad_norm=0.0,
            num_microbatches=1,
            replayed=bool(replay_routes),
            lr=1e-3,
            routes=batch.routed_experts if capture_routes else None,
        )


def _batch() -> TrainingBatch:
    seq = PROMPT + RESPONSE
    return TrainingBatch(
        sequences=torch.ones(ROWS, seq, dtype=torch.int64),
        attention_mask=torch.ones(ROWS, seq, dtype=torch.int64),
        response_mask=torch.ones(ROWS, RESPONSE, dtype=torch.int64),
        loss_mask=torch.ones(ROWS, RESPONSE, dtype=torch.int64),
        rewards=torch.zeros(ROWS),
        token_rewards=torch.zeros(ROWS, RESPONSE),
        rollout_logprobs=torch.full((ROWS, RESPONSE), -1.0),
        # The stand-in's one MoE layer, top-1 of two experts: the rollout chose 1.
        routed_experts=torch.ones(ROWS, seq, 1, 1, dtype=torch.int64),
        router_padding_mask=torch.zeros(ROWS, seq, dtype=torch.bool),
        advantages=torch.linspace(-1, 1, ROWS)[:, None].expand(ROWS, RESPONSE).clone(),
    )


@pytest.mark.parametrize("source", ["rollout", "old_policy"])
def test_each_pass_follows_the_plan_and_the_callers_batch_is_left_as_it_came(
    tmp_path: Path, source: str
) -> None:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            f"trainer.micro_train_batch_size_per_gpu={ROWS}",
            "generator.n_samples_per_prompt=2",
            f"trainer.policy.routing_replay.source={source}",
            "trainer.algorithm.use_entropy_loss=false",
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    native = torch.zeros(ROWS, PROMPT + RESPONSE, 1, 1, dtype=torch.int64)  # expert 0
    worker = RecordingWorker(native)
    trainer.worker = check_stand_in(worker)
    trainer.reference = worker.parameter_snapshot()
    batch = _batch()
    fields = {name: getattr(batch, name) for name in vars(batch)}

    metrics = trainer.train(batch, step=1)

    # Every field the same object as before: nothing set, nothing swapped.
    assert all(getattr(batch, name) is value for name, value in fields.items())
    assert batch.old_logprobs is None and batch.ref_logprobs is None
    rollout = batch.routed_experts
    kinds = [(kind, replay, capture) for kind, replay, capture, _ in worker.calls]
    seen = [routes for *_, routes in worker.calls]
    if source == "rollout":
        # R3: replayed old-logprob forward, the native one, the reference, the update.
        assert kinds == [
            ("forward", True, True),
            ("forward", False, True),
            ("forward", True, False),
            ("train_step", True, False),
        ]
        # The update sees its mini-batch's slice of the same routes.
        assert all(torch.equal(routes, rollout) for routes in seen)
        assert metrics["r3/router_agreement_trained"] == 0.0  # the stand-in's own routes
        assert "r2/router_agreement_update" not in metrics
    else:
        # R2: native old-logprob forward recorded, then replayed by reference and update.
        assert kinds == [
            ("forward", False, True),
            ("forward", True, False),
            ("train_step", True, True),
        ]
        assert seen[0] is rollout
        assert all(torch.equal(routes, native) for routes in seen[1:])
        assert metrics["r2/router_agreement_update"] == 1.0
        assert metrics["r3/router_agreement_native"] == 0.0

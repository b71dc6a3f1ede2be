"""R2 (``routing_replay_source=old_policy``) on the real Megatron worker through
PolicyTrainer: the routes the trainer's own routers chose in the old-logprob forward are
replayed in every update, 2 epochs x 2 mini-batches, with or without rollout routes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch, random_routes

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.megatron import MegatronPolicyWorker

CFG = TinyMoEConfig()
L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok
PROMPTS, SAMPLES = 4, 2


def _trainer(tmp_path: Path) -> PolicyTrainer:
    torch.set_num_threads(1)
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            "trainer.policy_mini_batch_size=2",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.update_epochs_per_batch=2",
            f"generator.n_samples_per_prompt={SAMPLES}",
            "trainer.policy.megatron_config.routing_replay_source=old_policy",
            "trainer.ref.log_kl=false",
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=PAD_ID)
    # A large step so the native routing drifts within the four updates.
    trainer.worker = MegatronPolicyWorker(
        CFG.architecture(),
        cfg.trainer.policy.megatron_config,
        optimizer=OptimizerConfig(lr=3e-2),
        pad_token_id=PAD_ID,
    ).setup()
    return trainer


def _batch(*, with_rollout_routes: bool) -> object:
    rows = PROMPTS * SAMPLES
    prompts = [[72 + b, 105, 33, 40 + b % 3][: 2 + b % 3] for b in range(rows)]
    responses = [[50 + b, 51, 52, 53, 54][: 1 + b % 5] for b in range(rows)]
    routes = None
    if with_rollout_routes:
        routes = [
            random_routes(1, len(p) + len(r), L, E, K, seed=b)[0, : len(p) + len(r) - 1]
            for b, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
    batch = make_batch(prompts, responses, num_layers=L, top_k=K, routes=routes)
    batch.advantages = torch.randn(
        batch.response_mask.shape, generator=torch.Generator().manual_seed(0)
    )  # type: ignore[attr-defined]
    return batch


@pytest.mark.parametrize("with_rollout_routes", [False, True])
def test_r2_replays_the_recorded_routes_in_every_update(tmp_path, with_rollout_routes) -> None:
    trainer = _trainer(tmp_path)
    batch = _batch(with_rollout_routes=with_rollout_routes)
    rollout_routes = batch.routed_experts  # type: ignore[attr-defined]
    # train leaves the caller's batch as it came: the recorded routes are the first
    # (old-logprob) forward's capture, replayed on a copy with only padding masked.
    captured: list[torch.Tensor | None] = []
    forward = trainer.worker.forward

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        result = forward(*args, **kwargs)
        captured.append(result.routes)
        return result

    trainer.worker.forward = recording_forward  # type: ignore[method-assign]

    metrics = trainer.train(batch, step=1)  # type: ignore[arg-type]

    trainer.worker.forward = forward  # type: ignore[method-assign]
    assert captured[0] is not None
    batch = dataclasses.replace(
        batch,  # type: ignore[type-var]
        routed_experts=captured[0],
        router_padding_mask=~batch.attention_mask.bool(),  # type: ignore[attr-defined]
    )

    assert metrics["train/optimizer_steps"] == 4.0
    real_tokens = float(batch.attention_mask.sum())  # type: ignore[attr-defined]
    # Every update forward (2 epochs x 2 mini-batches) dispatched exactly the recorded
    # routes, on every real token of every layer.
    assert metrics["r2/num_token_layers"] == 2 * real_tokens * L
    assert metrics["r2/router_agreement_update"] == 1.0
    recorded = batch.routed_experts  # type: ignore[attr-defined]
    worker = trainer.worker
    # The replay mattered: after four updates the routers' own choice has moved away.
    native = worker.forward(batch, replay_routes=False, capture_routes=True).routes  # type: ignore[arg-type]
    assert native is not None
    assert worker.rollout_router_agreement(batch, native).agreement < 1.0  # type: ignore[arg-type]
    if with_rollout_routes:
        # R2 replays the trainer's own choice, not the rollout's (random here), and
        # still reports how the two compare.
        assert not torch.equal(recorded, rollout_routes)
        assert metrics["r3/router_agreement_native"] < 0.5
        assert metrics["r3/router_agreement_native"] == metrics["r3/router_agreement_trained"]
    else:
        assert "r3/router_agreement_native" not in metrics

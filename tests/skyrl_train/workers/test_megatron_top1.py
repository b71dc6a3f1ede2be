"""Top-1 routing on the real Megatron worker (world size 1, gloo, CPU shim): a layer
that sent every real token of a trajectory to expert 0 is a legitimate route, replayed
and trained on like any other (an uncaptured layer is refused by the engine's
``RouteCapture.end()``, not guessed from zeros here)."""

from __future__ import annotations

import math

import torch
from _megatron_batches import PAD_ID, make_batch, random_routes

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.workers.megatron import MegatronPolicyWorker

# Megatron builds top-1 only with its pre-softmax router, i.e. norm_topk_prob=False.
CFG = TinyMoEConfig(num_experts_per_tok=1, norm_topk_prob=False)
L, E = CFG.num_layers, CFG.num_experts
ZERO_LAYER = 2


def test_a_top1_layer_routing_every_token_to_expert_0_trains_a_step() -> None:
    torch.set_num_threads(1)
    worker = MegatronPolicyWorker(
        CFG.architecture(),
        MegatronConfig(moe_enable_routing_replay=True),
        optimizer=OptimizerConfig(lr=1e-3),
        pad_token_id=PAD_ID,
    ).setup()
    prompts, responses = [[72, 105], [40, 41, 42]], [[50, 51], [70, 71, 72]]
    routes = [
        random_routes(1, len(p) + len(r), L, E, 1, seed=b)[0]
        for b, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]
    routes[0][:, ZERO_LAYER] = 0  # a short trajectory, all on expert 0 in one layer
    batch = make_batch(prompts, responses, num_layers=L, top_k=1, routes=routes)
    router = worker.model.decoder.layers[ZERO_LAYER].mlp.router.weight
    before = router.detach().clone()

    step = worker.train_step(
        batch,
        loss_fn=lambda lp, mb: -lp.sum(),
        micro_batch_size=2,
        trajectory_ids=["short", "other"],
        capture_routes=True,
    )

    assert step.replayed and math.isfinite(step.loss)
    assert math.isfinite(step.grad_norm) and step.grad_norm > 0
    real = ~batch.router_padding_mask
    assert step.routes is not None
    assert torch.equal(step.routes[real], batch.routed_experts[real])  # every route replayed
    assert step.routes[0, real[0], ZERO_LAYER].eq(0).all()
    assert not torch.equal(router.detach(), before)  # the optimizer stepped

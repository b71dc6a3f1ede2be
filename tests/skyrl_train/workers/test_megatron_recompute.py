"""Activation recompute under replay: the recomputed forward is given the same routes
again (keyed replay re-arms the routers when the gradient reaches the model's output)
instead of re-routing, so gradients equal those without recompute."""

from __future__ import annotations

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch, random_routes

from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.megatron import MegatronPolicyWorker

CFG = TinyMoEConfig()
ARCH = CFG.architecture()
L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok
RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


def _grads(batch, kwargs: dict) -> tuple[MegatronPolicyWorker, dict[str, torch.Tensor]]:
    worker = MegatronPolicyWorker(
        ARCH,
        MegatronConfig(moe_enable_routing_replay=True, transformer_config_kwargs=kwargs),
        optimizer=OptimizerConfig(lr=0.0, max_grad_norm=0.0),
        pad_token_id=PAD_ID,
    ).setup()
    worker.load_weights(build_hf_model(CFG, seed=1).state_dict().items())
    worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=2)
    return worker, {n: p.grad.clone() for n, p in worker.model.named_parameters()}


def test_recompute_replays_the_same_routes() -> None:
    torch.set_num_threads(1)
    prompts = [[72, 105, 33], [1, 2, 3, 4, 5, 6], [40, 41]]
    responses = [[50, 51, 52, 53], [60, 61], [70, 71, 72, 73, 74]]
    plain = make_batch(prompts, responses, num_layers=L, top_k=K)
    forced = random_routes(3, plain.sequences.shape[1], L, E, K, seed=3)
    routes = [forced[b, plain.attention_mask[b].bool()] for b in range(3)]
    batch = make_batch(prompts, responses, num_layers=L, top_k=K, routes=routes)
    first, without = _grads(batch, {})
    _second, with_recompute = _grads(batch, RECOMPUTE)
    for name, grad in without.items():
        assert torch.allclose(grad, with_recompute[name], atol=1e-6), name
    # Building the second model replaced the global router registry: the first
    # worker must refuse to replay rather than feed another model's routers.
    with pytest.raises(RouteReplayError, match="registry"):
        first.forward(batch)

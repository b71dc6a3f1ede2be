"""A server over a checkpoint folder: /health's route shape is the MoE layers' shape.

Qwen2-MoE's tiny checkpoint has a dense first layer, so a route row has 2 layers of
its 3; the client sizes its reply cap from /health, so the two must agree.
"""

from __future__ import annotations

import asyncio

import numpy as np

from inference.client import RemoteGenerateClient
from inference.client.limits import RouteShape
from inference.models.checkpoint import inspect_checkpoint
from inference.server import EngineSpec, ServerConfig, ServerThread


def test_checkpoint_server_reports_and_returns_moe_layer_routes(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen2_moe"]
    arch = inspect_checkpoint(folder).architecture
    spec = EngineSpec(checkpoint=str(folder), model_name="qwen2-moe-tiny")
    thread = ServerThread(spec.build, ServerConfig(api_key="ckpt-token"))
    url = thread.start()
    try:

        async def main():
            async with RemoteGenerateClient(url, api_key="ckpt-token") as client:
                health = await client.health()
                result = await client.generate(
                    prompt_token_ids=[5, 6, 7, 8, 9],
                    sampling_params={"max_tokens": 4, "temperature": 0.0},
                    return_routed_experts=True,
                )
                return health, result, client.route_shape

        health, result, learned = asyncio.run(main())
    finally:
        thread.stop()
    engine = health["engine"]
    assert (engine["num_layers"], engine["top_k"], engine["num_experts"]) == (2, 3, 6)
    assert engine["num_layers"] == arch.num_moe_layers < arch.num_layers
    assert engine["vocab_size"] == 512 and engine["model_name"] == "qwen2-moe-tiny"
    assert learned == RouteShape(num_layers=2, top_k=3, num_experts=6)
    g = len(result.response_ids)
    assert 1 <= g <= 4 and result.routed_experts.shape == (5 + g - 1, 2, 3)
    assert result.routed_experts.dtype == np.uint8

"""One left-padded prefill plus a decode step through a transformers model, with the
routes each MoE layer's gate chose: the stock-vs-invariant comparisons' common probe."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


@torch.inference_mode()
def prefill_and_step(
    model, moe_layers: Sequence[int], ids, mask, positions, *, next_token: int
) -> tuple:
    """Left-padded prefill + one decode step: real-token logits, step logits, routes."""
    routes: list[torch.Tensor] = []
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda _m, _i, o: routes.append(o[2]))
        for i in moe_layers
    ]
    cache = DynamicCache(config=model.config)
    prefill = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)
    step = model(
        input_ids=torch.full((len(ids), 1), next_token),
        attention_mask=torch.cat([mask, mask.new_ones(len(ids), 1)], dim=1),
        position_ids=mask.sum(-1, keepdim=True),
        cache=cache,
    )
    for hook in hooks:
        hook.remove()
    real = mask.bool().flatten()
    prefill_routes = torch.stack([r[real] for r in routes[: len(moe_layers)]])
    return prefill.logits[mask.bool()], step.logits, prefill_routes, routes[len(moe_layers) :]

"""Captured routes equal an independent fp32 forward's top-k, row for row.

The reference never touches the engine's capture hooks: it is a separate model
built from the engine's exported weights, run once over prompt + response with
``output_router_logits=True``, and its top-k is recomputed from those logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference.engine.base import EngineRequest, SamplingParams
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model


def _reference_routes(engine, tokens: list[int]) -> np.ndarray:
    cfg = TinyMoEConfig()
    ref = build_hf_model(cfg, seed=123, dtype=torch.float32)
    ref.load_state_dict(engine.state_dict(), strict=False)
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([tokens]), output_router_logits=True)
    per_layer = []
    for logits in out.router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        per_layer.append(torch.topk(probs, cfg.num_experts_per_tok, dim=-1).indices)
    return torch.stack(per_layer, dim=1).numpy()  # [S, L, K]


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 256 for i in range(n)]


def test_rows_match_independent_fp32_forward(fp32_engine) -> None:
    prompts = [_prompt(5), _prompt(17, 3), _prompt(11, 9)]
    starts = [0, 6, 11]
    reqs = [
        EngineRequest(
            p,
            SamplingParams(max_tokens=9, seed=i, ignore_eos=True),
            return_routed_experts=True,
            routed_experts_prompt_start=s,
        )
        for i, (p, s) in enumerate(zip(prompts, starts, strict=True))
    ]
    outs = fp32_engine.generate_sync(reqs)
    for req, out in zip(reqs, outs, strict=True):
        p, s, g = len(req.prompt_token_ids), req.routed_experts_prompt_start, len(out.token_ids)
        assert g == 9 and out.finish_reason == "length"
        assert out.routed_experts is not None
        assert out.routed_experts.shape == (p - s + g - 1, 4, 2)
        assert out.routed_experts.dtype == np.uint8
        full = list(req.prompt_token_ids) + out.token_ids
        expected = _reference_routes(fp32_engine, full)
        # Row i is token s+i as fed; the last sampled token was never fed.
        np.testing.assert_array_equal(out.routed_experts, expected[s : p + g - 1])


def test_routes_absent_unless_requested(fp32_engine) -> None:
    out = fp32_engine.generate_sync([EngineRequest(_prompt(4), SamplingParams(max_tokens=3))])[0]
    assert out.routed_experts is None and out.sample_support_ids is None


def test_single_token_generation_has_prompt_rows_only(fp32_engine) -> None:
    req = EngineRequest(
        _prompt(6),
        SamplingParams(max_tokens=1, seed=1),
        return_routed_experts=True,
        routed_experts_prompt_start=6,
    )
    out = fp32_engine.generate_sync([req])[0]
    assert len(out.token_ids) == 1
    assert out.routed_experts is not None and out.routed_experts.shape == (0, 4, 2)


def test_a_layer_whose_hook_did_not_fire_is_refused_by_name() -> None:
    # The trainer cannot tell an uncaptured layer from its ids (top-1 may really send
    # every token to expert 0; replay.validate_routes relies on this check instead).
    from inference.engine.capture import RouteCapture

    cfg = TinyMoEConfig()
    model = build_hf_model(cfg, seed=0, dtype=torch.float32)
    capture = RouteCapture(model, num_experts=cfg.num_experts, moe_layers=range(cfg.num_layers))
    capture.active = True
    capture.begin(1, 3)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    routes = capture.end()
    assert routes is not None and routes.shape == (1, 3, cfg.num_layers, 2)
    capture.begin(1, 3)
    hidden = torch.randn(3, cfg.hidden_size)
    for layer in (0, 1, 3):  # layer 2's router never runs
        capture.gates[layer](hidden)
    with pytest.raises(RuntimeError, match=r"decoder layers \[2\] produced no routes"):
        capture.end()
    capture.remove()

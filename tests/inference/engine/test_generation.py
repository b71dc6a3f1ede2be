"""Sampling, batching invariance, stops, sample support and request validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from inference.engine.base import EngineRequest, InferenceEngine, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import RequestValidationError


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(5 * i + offset) % 256 for i in range(n)]


def _req(n: int, **sampling) -> EngineRequest:
    return EngineRequest(_prompt(n, n), SamplingParams(**sampling))


def test_engine_satisfies_protocol_and_defaults_to_bf16() -> None:
    engine = HFMoEEngine.from_config()
    assert isinstance(engine, InferenceEngine)
    assert engine.info.dtype == "bfloat16"
    assert (engine.info.num_layers, engine.info.num_experts, engine.info.top_k) == (4, 8, 2)
    out = engine.generate_sync(
        [dataclasses.replace(_req(8, max_tokens=5, seed=0), return_routed_experts=True)]
    )[0]
    assert out.routed_experts is not None and out.routed_experts.shape[0] == 8 + 5 - 1


def test_batched_equals_unbatched_fp32(fp32_engine) -> None:
    reqs = [
        EngineRequest(
            _prompt(n, n),
            SamplingParams(max_tokens=m, seed=i, temperature=t, top_p=0.9, ignore_eos=True),
            return_routed_experts=capture,
            routed_experts_prompt_start=n // 2,
            sample_support_k=3,
        )
        for i, (n, m, t, capture) in enumerate(
            [(3, 7, 1.0, True), (12, 2, 0.0, True), (7, 5, 0.7, False), (20, 9, 1.3, True)]
        )
    ]
    batched = fp32_engine.generate_sync(reqs)
    for req, got in zip(reqs, batched, strict=True):
        alone = fp32_engine.generate_sync([req])[0]
        assert got.token_ids == alone.token_ids
        assert len(got.token_ids) == req.sampling.max_tokens
        np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-5)
        if req.return_routed_experts:
            np.testing.assert_array_equal(got.routed_experts, alone.routed_experts)
        else:
            assert got.routed_experts is None
        np.testing.assert_array_equal(got.sample_support_ids, alone.sample_support_ids)


def test_seeded_sampling_is_reproducible(fp32_engine) -> None:
    a = fp32_engine.generate_sync([_req(6, max_tokens=12, seed=7, ignore_eos=True)])[0]
    b = fp32_engine.generate_sync([_req(6, max_tokens=12, seed=7, ignore_eos=True)])[0]
    c = fp32_engine.generate_sync([_req(6, max_tokens=12, seed=8, ignore_eos=True)])[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_greedy_picks_the_most_likely_token(fp32_engine) -> None:
    out = fp32_engine.generate_sync(
        [dataclasses.replace(_req(9, max_tokens=6, temperature=0.0), sample_support_k=4)]
    )[0]
    ids, lps = out.sample_support_ids, out.sample_support_logprobs
    assert ids is not None and lps is not None and ids.shape == (6, 4)
    # Greedy support is the argmax alone; the rest is padding.
    assert (ids[:, 0] == np.array(out.token_ids)).all()
    assert (ids[:, 1:] == -1).all() and np.isneginf(lps[:, 1:]).all()
    np.testing.assert_allclose(lps[:, 0], out.logprobs, atol=1e-6)


def test_sample_support_respects_top_k_and_matches_logprobs(fp32_engine) -> None:
    req = dataclasses.replace(
        _req(5, max_tokens=10, seed=3, top_k=3, ignore_eos=True), sample_support_k=5
    )
    out = fp32_engine.generate_sync([req])[0]
    ids, lps = out.sample_support_ids, out.sample_support_logprobs
    assert ids is not None and lps is not None
    assert ids.shape == (10, 5) and ids.dtype == np.int32 and lps.dtype == np.float32
    assert (ids[:, 3:] == -1).all() and (ids[:, :3] >= 0).all()
    assert (np.diff(lps[:, :3], axis=1) <= 0).all()  # highest probability first
    for g, tok in enumerate(out.token_ids):
        row = list(ids[g])
        assert tok in row[:3]
        assert lps[g, row.index(tok)] == pytest.approx(out.logprobs[g], abs=1e-6)


def test_stop_token_ends_generation_and_is_included(fp32_engine) -> None:
    free = fp32_engine.generate_sync([_req(4, max_tokens=8, temperature=0.0)])[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    out = fp32_engine.generate_sync(
        [_req(4, max_tokens=8, temperature=0.0, stop_token_ids=(stop,))]
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_by_default_unless_ignored(fp32_engine) -> None:
    free = fp32_engine.generate_sync([_req(4, max_tokens=8, temperature=0.0, ignore_eos=True)])[0]
    eos = free.token_ids[2]
    engine = HFMoEEngine(fp32_engine.model, eos_token_ids=(eos,), num_threads=None)
    try:
        out = engine.generate_sync([_req(4, max_tokens=8, temperature=0.0)])[0]
        assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
        assert out.finish_reason == "stop"
        kept = engine.generate_sync([_req(4, max_tokens=8, temperature=0.0, ignore_eos=True)])[0]
        assert kept.token_ids == free.token_ids and kept.finish_reason == "length"
    finally:
        engine.capture.remove()


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (EngineRequest([]), "requests[0].prompt_token_ids"),
        (EngineRequest([1, 264]), "requests[0].prompt_token_ids[1]"),
        (EngineRequest([1, 2], routed_experts_prompt_start=3), "routed_experts_prompt_start"),
        (EngineRequest([1], sample_support_k=-1), "requests[0].sample_support_k"),
        (EngineRequest([1], SamplingParams(top_p=0.0)), "requests[0].sampling.top_p"),
        (EngineRequest([1], SamplingParams(top_k=0)), "requests[0].sampling.top_k"),
        (EngineRequest([1], SamplingParams(max_tokens=0)), "requests[0].sampling.max_tokens"),
        (EngineRequest([1], SamplingParams(temperature=-1)), "requests[0].sampling.temperature"),
        (EngineRequest([1], SamplingParams(stop_token_ids=(999,))), "stop_token_ids[0]"),
        (EngineRequest([1], SamplingParams(max_tokens=5000)), "requests[0].sampling.max_tokens"),
    ],
)
def test_bad_requests_fail_loudly(fp32_engine, request_, field) -> None:
    with pytest.raises(RequestValidationError, match=r"expected") as info:
        fp32_engine.generate_sync([request_])
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)

"""bf16 generation is batch-invariant: a request's output depends on its prompt and seed.

The same seeded requests run each alone, all in one batch, in reverse order, split in
two batches, and scattered among other random requests whose ``max_tokens`` differ (so
rows leave the KV cache mid-decode); tokens, logprobs, sample support and routed
experts must be bit-identical in every arrangement, greedy and sampled. On the stock
transformers forward (``batch_invariant=False``, the code before this test) 9 of 10
requests differed in one batch (greedy: logprobs; sampled: tokens, logprobs, routes).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from _prefill_probe import prefill_and_step
from transformers import DynamicCache

from inference.engine.base import EngineOutput, EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.engine.prefill import left_pad, packed_prefill
from inference.models import batch_invariant as bi
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model

LENGTHS = (1, 3, 9, 17, 30, 44, 61, 80, 97, 120)


@pytest.fixture(scope="module")
def bf16_engine():
    engine = HFMoEEngine.from_config(seed=0)
    yield engine
    engine._executor.shutdown(wait=True)
    engine.capture.remove()


def _requests(temperature: float) -> list[EngineRequest]:
    rng = np.random.default_rng(7)
    reqs = []
    for i, n in enumerate(LENGTHS):
        reqs.append(
            EngineRequest(
                rng.integers(0, 256, n).tolist(),
                SamplingParams(
                    max_tokens=int(rng.integers(4, 13)),
                    temperature=temperature,
                    seed=1000 + i,
                    ignore_eos=i % 3 != 0,  # some rows may stop on eos, the rest on length
                ),
                return_routed_experts=True,
                routed_experts_prompt_start=n // 3,
                sample_support_k=4 if i % 2 else 0,
            )
        )
    return reqs


def _others(count: int) -> list[EngineRequest]:
    """Random company of other lengths and max_tokens, half without routes."""
    rng = np.random.default_rng(11)
    return [
        EngineRequest(
            rng.integers(0, 256, int(rng.integers(2, 128))).tolist(),
            SamplingParams(
                max_tokens=int(rng.integers(1, 20)), temperature=1.0, seed=int(rng.integers(99))
            ),
            return_routed_experts=bool(i % 2),
        )
        for i in range(count)
    ]


def _differences(a: EngineOutput, b: EngineOutput) -> list[str]:
    diffs = []
    if a.token_ids != b.token_ids:
        diffs.append("tokens")
    if a.logprobs != b.logprobs:
        diffs.append("logprobs")
    if a.finish_reason != b.finish_reason:
        diffs.append("finish_reason")
    for name in ("routed_experts", "sample_support_ids", "sample_support_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            diffs.append(name)
    return diffs


def _mismatches(reference: list[EngineOutput], got: list[EngineOutput]) -> dict[int, list[str]]:
    diffs = [_differences(a, b) for a, b in zip(reference, got, strict=True)]
    return {i: d for i, d in enumerate(diffs) if d}


def _assert_same(
    reference: list[EngineOutput], arrangements: dict[str, list[EngineOutput]]
) -> None:
    bad = {label: _mismatches(reference, outs) for label, outs in arrangements.items()}
    counts = {label: f"{len(b)}/{len(reference)}" for label, b in bad.items()}
    assert not any(bad.values()), f"requests differing from alone: {counts}; details {bad}"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_bf16_outputs_do_not_depend_on_the_batch(bf16_engine, temperature) -> None:
    reqs = _requests(temperature)
    alone = [bf16_engine.generate_sync([r])[0] for r in reqs]
    assert all(o.routed_experts is not None for o in alone)
    arrangements = {
        "one batch": bf16_engine.generate_sync(reqs),
        "reversed": bf16_engine.generate_sync(reqs[::-1])[::-1],
    }
    split: list[EngineOutput] = [alone[0]] * len(reqs)
    split[1::2] = bf16_engine.generate_sync(reqs[1::2])
    split[::2] = bf16_engine.generate_sync(reqs[::2])
    arrangements["two batches"] = split
    # Scattered among 22 others whose max_tokens differ, so rows leave mid-decode.
    mixed = _others(22)
    slots = np.random.default_rng(3).choice(len(mixed) + len(reqs), len(reqs), replace=False)
    for slot, req in sorted(zip(slots.tolist(), reqs, strict=True)):
        mixed.insert(slot, req)
    by_id = {id(r): o for r, o in zip(mixed, bf16_engine.generate_sync(mixed), strict=True)}
    arrangements["mixed with others"] = [by_id[id(r)] for r in reqs]
    _assert_same(alone, arrangements)


def test_bf16_invariant_with_max_batch_size_chunks(bf16_engine) -> None:
    """generate_sync splits long request lists by max_batch_size: chunk sizes vary too."""
    reqs = _requests(1.0)
    small = HFMoEEngine.from_config(seed=0, max_batch_size=3, num_threads=None)
    try:
        alone = [bf16_engine.generate_sync([r])[0] for r in reqs]
        _assert_same(alone, {"chunks of 3": small.generate_sync(reqs)})
    finally:
        small._executor.shutdown(wait=True)
        small.capture.remove()


def test_engine_reports_batch_invariance(bf16_engine) -> None:
    assert bf16_engine.info.batch_invariant is True
    stock = HFMoEEngine.from_config(seed=0, batch_invariant=False, num_threads=None)
    try:
        assert stock.info.batch_invariant is False
        # Same weights either way; only the forward differs.
        a, b = stock.state_dict(), bf16_engine.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        req = dataclasses.replace(_requests(0.0)[5], return_routed_experts=False)
        assert len(stock.generate_sync([req])[0].token_ids) == req.sampling.max_tokens
    finally:
        stock._executor.shutdown(wait=True)
        stock.capture.remove()


def test_concurrent_callers_get_their_alone_outputs(bf16_engine) -> None:
    """The server's path: whatever the 5 ms window gathers, each caller gets its own."""
    engine = HFMoEEngine.from_config(seed=0, batch_window_ms=20.0, num_threads=None)
    reqs = _requests(1.0) + _others(6)
    alone = [bf16_engine.generate_sync([r])[0] for r in reqs]

    async def main() -> list[EngineOutput]:
        outs = await asyncio.gather(*(engine.generate([r]) for r in reqs))
        await engine.close()
        return [o[0] for o in outs]

    _assert_same(alone, {"concurrent callers": asyncio.run(main())})


def test_loaded_weights_reach_the_fp64_copies() -> None:
    """The fp64 weight copies are remade after ``load_weights`` (in-place copy)."""
    engine = HFMoEEngine.from_config(seed=0, num_threads=None)
    donor = HFMoEEngine.from_config(seed=1, num_threads=None)
    try:
        req = _requests(1.0)[6]
        before = engine.generate_sync([req])[0]
        engine.load_weights(donor.state_dict().items())
        after, expected = engine.generate_sync([req])[0], donor.generate_sync([req])[0]
        assert after.token_ids != before.token_ids
        assert not _differences(after, expected)
    finally:
        for e in (engine, donor):
            e._executor.shutdown(wait=True)
            e.capture.remove()


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    ids = torch.full((len(prompts), longest), 256)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :] = torch.tensor(p)
        mask[b, longest - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 70, count)]


def test_same_model_as_the_stock_forward_in_fp64() -> None:
    """The rewritten router, norms, rotary, experts and attention compute what
    transformers does: in fp64 the logits agree to 1e-5 (the norms, rotary and router
    softmax run in fp32 either way) and the routes are the same."""
    stock = build_hf_model(TinyMoEConfig(), seed=0, dtype=torch.float64)
    stock.config._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    invariant = build_hf_model(TinyMoEConfig(), seed=0, dtype=torch.float64)
    bi.enable_batch_invariance(invariant)
    ids, mask, positions = _padded(_prompts(6, 0))
    results = []
    for model in (stock, invariant):
        results.append(prefill_and_step(model, range(4), ids, mask, positions, next_token=65))
    (a_pre, a_step, a_routes, a_steps), (b_pre, b_step, b_routes, b_steps) = results
    torch.testing.assert_close(a_pre, b_pre, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_step, b_step, rtol=0, atol=1e-5)
    assert torch.equal(a_routes, b_routes)
    assert all(torch.equal(x, y) for x, y in zip(a_steps, b_steps, strict=True))


def test_packed_prefill_equals_the_left_padded_prefill() -> None:
    """Packing prompts back to back (no padding rows) changes no bit of the logits or
    of the cache the decode continues from."""
    model = build_hf_model(TinyMoEConfig(), seed=0, dtype=torch.bfloat16)
    bi.enable_batch_invariance(model)
    prompts = _prompts(9, 1)
    ids, mask, positions = _padded(prompts)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        padded = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            logits_to_keep=1,
        )
        packed = packed_prefill(model, prompts)
    assert torch.equal(padded.logits[:, -1], packed.logits)
    real = mask.bool()[:, None, :, None]
    for layer in range(4):
        for name in ("keys", "values"):
            a = getattr(cache.layers[layer], name)
            b = getattr(packed.cache.layers[layer], name)
            assert a.shape == b.shape
            assert torch.equal(a.masked_select(real), b.masked_select(real))


def test_left_pad_places_rows_at_the_end() -> None:
    packed = torch.arange(1, 7)[:, None].repeat(1, 2)  # rows of requests [1], [2,3,4], [5,6]
    out = left_pad(packed, [1, 3, 2])
    assert out[..., 0].tolist() == [[0, 0, 1], [2, 3, 4], [0, 5, 6]]


def test_batch_dependent_rope_is_refused() -> None:
    model = build_hf_model(TinyMoEConfig(), seed=0)
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type"):
        bi.enable_batch_invariance(model)
    assert not bi.is_batch_invariant(model)
    assert type(model.lm_head) is torch.nn.Linear

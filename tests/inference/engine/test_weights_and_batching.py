"""Weight loading/export, checkpoints, and the async batching front."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference.engine.base import EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import CheckpointFormatError
from inference.models.tokenizer import load_tokenizer


def _req(n: int, seed: int, **kw) -> EngineRequest:
    sampling = SamplingParams(max_tokens=6, seed=seed, ignore_eos=True)
    return EngineRequest([(3 * i + n) % 256 for i in range(n)], sampling, **kw)


def test_load_weights_changes_outputs_and_casts() -> None:
    engine = HFMoEEngine.from_config(seed=0)
    donor = HFMoEEngine.from_config(seed=1, dtype="float32")
    before = engine.generate_sync([_req(8, 0)])[0]
    weights = donor.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in weights
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 64)
    assert engine.load_weights(weights.items()) == len(weights)
    assert engine.state_dict()["lm_head.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(
        engine.state_dict()["lm_head.weight"], weights["lm_head.weight"].bfloat16()
    )
    after = engine.generate_sync([_req(8, 0)])[0]
    assert after.token_ids != before.token_ids


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (("model.layers.9.mlp.gate.weight", torch.zeros(8, 64)), "model.layers.9.mlp.gate.weight"),
        (("model.layers.0.mlp.gate.weight", torch.zeros(8, 65)), r"gate.weight: expected shape"),
        (("model.layers.0.mlp.gate.weight", torch.zeros(8, 64, dtype=torch.long)), "floating"),
    ],
)
def test_load_weights_rejects_bad_tensors_before_copying(fp32_engine, bad, match) -> None:
    before = fp32_engine.state_dict()
    good = ("lm_head.weight", torch.ones_like(before["lm_head.weight"]))
    with pytest.raises(ValueError, match=match):
        fp32_engine.load_weights([good, bad])
    # The valid tensor listed first was not applied: validation precedes any copy.
    torch.testing.assert_close(fp32_engine.state_dict()["lm_head.weight"], before["lm_head.weight"])


def test_save_and_load_checkpoint_roundtrip(fp32_engine, tmp_path) -> None:
    folder = fp32_engine.save_pretrained(tmp_path / "ckpt")
    loaded = HFMoEEngine.from_pretrained(folder, dtype="float32", num_threads=None)
    try:
        reqs = [_req(7, 2, return_routed_experts=True)]
        a, b = fp32_engine.generate_sync(reqs)[0], loaded.generate_sync(reqs)[0]
        assert a.token_ids == b.token_ids
        assert (a.routed_experts == b.routed_experts).all()
        # The architecture is read back from config.json alone: no side file.
        assert loaded.architecture == fp32_engine.architecture
        assert not (folder / "tiny_moe_config.json").exists()
        assert load_tokenizer(folder).eos_token_id == 256
        assert loaded.eos_token_ids == (256,) and loaded.pad_token_id == 256
    finally:
        loaded.capture.remove()
    with pytest.raises(CheckpointFormatError, match="folder"):
        HFMoEEngine.from_pretrained(tmp_path / "nothing")


def _record_batches(engine: HFMoEEngine) -> list[int]:
    """The size of every forward batch ``engine`` runs from now on."""
    sizes: list[int] = []
    run = engine._run

    def recording_run(requests):
        sizes.append(len(requests))
        return run(requests)

    engine._run = recording_run  # type: ignore[method-assign]
    return sizes


def test_concurrent_callers_share_batches_with_unchanged_results() -> None:
    engine = HFMoEEngine.from_config(seed=0, dtype="float32", batch_window_ms=20.0)
    batch_sizes = _record_batches(engine)
    reqs = [_req(4 + i, i, return_routed_experts=True) for i in range(6)]
    expected = [engine.generate_sync([r])[0] for r in reqs]
    batch_sizes.clear()

    async def main():
        outs = await asyncio.gather(*(engine.generate([r]) for r in reqs))
        many = await engine.generate(reqs)
        await engine.close()
        return [o[0] for o in outs], many

    singles, many = asyncio.run(main())
    assert batch_sizes[0] > 1  # concurrent callers were batched together
    for exp, got_a, got_b in zip(expected, singles, many, strict=True):
        assert exp.token_ids == got_a.token_ids == got_b.token_ids
        assert (exp.routed_experts == got_a.routed_experts).all()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.generate(reqs))


@pytest.mark.timeout(120)
def test_a_full_batch_does_not_wait_out_the_window() -> None:
    # An hour-long window: only closing early at max_batch_size lets this finish (the
    # timeout marker turns a wait into a failure rather than a hung suite).
    engine = HFMoEEngine.from_config(seed=0, max_batch_size=3, batch_window_ms=3_600_000.0)
    batch_sizes = _record_batches(engine)

    async def main():
        first = asyncio.ensure_future(engine.generate([_req(4, 0)]))
        await asyncio.sleep(0.05)  # the batcher is now inside its window with one request
        rest = [engine.generate([_req(4 + i, i)]) for i in (1, 2)]
        outs = await asyncio.gather(first, *rest)
        await engine.close()
        return outs

    assert len(asyncio.run(main())) == 3
    assert batch_sizes == [3]


def test_batch_failure_reaches_every_caller() -> None:
    engine = HFMoEEngine.from_config(seed=0, num_threads=None)

    def broken(_requests):
        raise RuntimeError("forward exploded")

    engine._run = broken  # type: ignore[method-assign]

    async def main():
        results = await asyncio.gather(
            engine.generate([_req(3, 0)]), engine.generate([_req(4, 1)]), return_exceptions=True
        )
        await engine.close()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "exploded" in str(r) for r in results)

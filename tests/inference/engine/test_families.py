"""The engine serves every family from a checkpoint folder, batch-invariantly.

Checkpoints come from ``write_tiny_checkpoint`` (tests/inference/conftest.py): Qwen3-MoE
and Qwen2-MoE with a dense first layer (Qwen2-MoE also a gated shared expert), OLMoE
with full-width q/k norms, Mixtral always renormalising its top-k.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from _prefill_probe import prefill_and_step
from transformers import AutoModelForCausalLM

from inference.engine.base import EngineOutput, EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import CheckpointFormatError
from inference.models import batch_invariant as bi
from inference.models.checkpoint import inspect_checkpoint
from inference.models.families import FAMILIES

FAMILY_NAMES = tuple(FAMILIES)
LENGTHS = (1, 4, 9, 23, 40, 71)


def _close(engine: HFMoEEngine) -> None:
    engine._executor.shutdown(wait=True)
    engine.capture.remove()


def _requests(temperature: float, vocab: int = 512) -> list[EngineRequest]:
    rng = np.random.default_rng(5)
    return [
        EngineRequest(
            rng.integers(0, vocab, n).tolist(),
            SamplingParams(
                max_tokens=int(rng.integers(3, 9)),
                temperature=temperature,
                seed=100 + i,
                ignore_eos=True,
            ),
            return_routed_experts=True,
            routed_experts_prompt_start=n // 2,
        )
        for i, n in enumerate(LENGTHS)
    ]


def _differences(a: EngineOutput, b: EngineOutput) -> list[str]:
    diffs = [
        name
        for name in ("token_ids", "logprobs", "finish_reason")
        if getattr(a, name) != getattr(b, name)
    ]
    x, y = a.routed_experts, b.routed_experts
    if x is None or y is None or not np.array_equal(x, y):
        diffs.append("routed_experts")
    return diffs


def _mismatches(reference: list[EngineOutput], got: list[EngineOutput]) -> dict[int, list[str]]:
    diffs = [_differences(a, b) for a, b in zip(reference, got, strict=True)]
    return {i: d for i, d in enumerate(diffs) if d}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generates_with_routes_for_moe_layers_only(tiny_checkpoints, family) -> None:
    info = inspect_checkpoint(tiny_checkpoints[family])
    arch = info.architecture
    engine = HFMoEEngine.from_pretrained(tiny_checkpoints[family], dtype="bfloat16")
    try:
        assert engine.info.dtype == "bfloat16" and engine.info.batch_invariant
        # /health reports this: the route tensor's layer axis, MoE layers only.
        assert engine.info.num_layers == arch.num_moe_layers == len(engine.capture.gates)
        assert (engine.info.num_experts, engine.info.top_k) == (
            arch.num_experts,
            arch.num_experts_per_tok,
        )
        assert engine.eos_token_ids == (2, 0) and engine.pad_token_id == 0
        req = EngineRequest(
            list(range(10, 22)),
            SamplingParams(max_tokens=5, seed=0, ignore_eos=True),
            return_routed_experts=True,
            routed_experts_prompt_start=2,
        )
        out = engine.generate_sync([req])[0]
        g = len(out.token_ids)
        assert g == 5 and out.finish_reason == "length"
        routes = out.routed_experts
        assert routes is not None and routes.dtype == np.uint8
        assert routes.shape == (12 - 2 + g - 1, arch.num_moe_layers, arch.num_experts_per_tok)
        assert int(routes.max()) < arch.num_experts
        assert all(
            len(set(row)) == arch.num_experts_per_tok
            for row in routes.reshape(-1, arch.num_experts_per_tok).tolist()
        )
    finally:
        _close(engine)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_routes_match_the_stock_model_routers(tiny_checkpoints, family) -> None:
    """Captured rows are the stock fp32 model's router choices on the MoE layers."""
    folder = tiny_checkpoints[family]
    arch = inspect_checkpoint(folder).architecture
    engine = HFMoEEngine.from_pretrained(folder, dtype="float32")
    stock = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    try:
        req = EngineRequest(
            list(range(40, 53)),
            SamplingParams(max_tokens=6, seed=1, ignore_eos=True),
            return_routed_experts=True,
        )
        out = engine.generate_sync([req])[0]
        fed = list(req.prompt_token_ids) + out.token_ids[:-1]
        seen: dict[int, torch.Tensor] = {}
        hooks = [
            stock.model.layers[i].mlp.gate.register_forward_hook(
                lambda _m, _i, o, i=i: seen.__setitem__(i, o[2])
            )
            for i in arch.moe_layers
        ]
        with torch.inference_mode():
            stock(input_ids=torch.tensor([fed]))
        for hook in hooks:
            hook.remove()
        expected = torch.stack([seen[i] for i in arch.moe_layers], dim=1).numpy()
        # top-k order is by probability in both, so rows compare as they are.
        np.testing.assert_array_equal(out.routed_experts, expected)
    finally:
        _close(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_outputs_do_not_depend_on_the_batch(tiny_checkpoints, family, dtype) -> None:
    """Alone vs one batch of different-length prompts vs reversed: bit-identical tokens,
    logprobs and routes. fp32 is where the dense MLP's silu and Qwen2-MoE's shared-expert
    sigmoid matter: evaluated in the model dtype, each made this test fail."""
    engine = HFMoEEngine.from_pretrained(tiny_checkpoints[family], dtype=dtype)
    try:
        for temperature in (0.0, 1.0):
            reqs = _requests(temperature)
            alone = [engine.generate_sync([r])[0] for r in reqs]
            arrangements = {
                "one batch": engine.generate_sync(reqs),
                "reversed": engine.generate_sync(reqs[::-1])[::-1],
            }
            bad = {label: _mismatches(alone, outs) for label, outs in arrangements.items()}
            assert not any(bad.values()), f"{family} T={temperature}: {bad}"
    finally:
        _close(engine)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_same_model_as_the_stock_forward_in_fp64(tiny_checkpoints, family) -> None:
    """The swapped routers, MLPs, shared-expert gate, norms, rotary and attention compute
    what transformers does: fp64 logits agree to 1e-5 and the routes are the same."""
    folder = str(tiny_checkpoints[family])
    moe_layers = inspect_checkpoint(folder).architecture.moe_layers
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    stock.config._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    invariant = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    bi.enable_batch_invariance(invariant)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 512, int(n)).tolist() for n in (3, 17, 40, 9)]
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :] = torch.tensor(p)
        mask[b, longest - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    results = [
        prefill_and_step(m, moe_layers, ids, mask, positions, next_token=7)
        for m in (stock, invariant)
    ]
    (a_pre, a_step, a_routes, a_steps), (b_pre, b_step, b_routes, b_steps) = results
    torch.testing.assert_close(a_pre, b_pre, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_step, b_step, rtol=0, atol=1e-5)
    assert torch.equal(a_routes, b_routes)
    assert all(torch.equal(x, y) for x, y in zip(a_steps, b_steps, strict=True))


def test_either_eos_id_stops_a_request(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen2_moe"]
    free_engine = HFMoEEngine.from_pretrained(folder, dtype="float32", eos_token_ids=())
    try:
        req = EngineRequest(list(range(30, 38)), SamplingParams(max_tokens=10, temperature=0.0))
        free = free_engine.generate_sync([req])[0]
        assert free.finish_reason == "length"
    finally:
        _close(free_engine)
    first, second = free.token_ids[4], free.token_ids[2]
    engine = HFMoEEngine.from_pretrained(folder, dtype="float32", eos_token_ids=(first, second))
    try:
        out = engine.generate_sync([req])[0]
        stop = min(free.token_ids.index(first), free.token_ids.index(second))
        assert out.token_ids == free.token_ids[: stop + 1] and out.finish_reason == "stop"
    finally:
        _close(engine)
    for bad in (2, (2, 512)):  # one int; an id past the embedding
        with pytest.raises(ValueError, match=r"eos_token_ids: expected a sequence of token ids"):
            HFMoEEngine(engine.model, eos_token_ids=bad, num_threads=None)


def test_from_pretrained_propagates_checkpoint_errors(tiny_checkpoints, tmp_path) -> None:
    with pytest.raises(CheckpointFormatError, match="folder"):
        HFMoEEngine.from_pretrained(tmp_path / "nothing")
    llama = shutil.copytree(tiny_checkpoints["mixtral"], tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match="architectures") as info:
        HFMoEEngine.from_pretrained(llama)
    assert "MixtralForCausalLM" in str(info.value)  # the message lists what is supported


class _OddRouter(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _OddMLP(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize(
    ("where", "replacement", "match"),
    [
        ("model.layers.1.mlp.gate", _OddRouter, r"model\.layers\.1\.mlp\.gate: expected a top-k"),
        ("model.layers.0.mlp", _OddMLP, r"model\.layers\.0\.mlp: expected an MoE block"),
        ("model.layers.1.mlp.shared_expert", _OddMLP, r"shared_expert: expected an MoE block"),
    ],
)
def test_unknown_parts_are_refused_by_name(tiny_checkpoints, where, replacement, match) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["qwen2_moe"]))
    parent, _, child = where.rpartition(".")
    setattr(model.get_submodule(parent), child, replacement())
    with pytest.raises(ValueError, match=match):
        bi.enable_batch_invariance(model)
    assert not bi.is_batch_invariant(model)
    assert type(model.lm_head) is torch.nn.Linear  # nothing was swapped


def test_sliding_window_is_refused(tiny_checkpoints) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["mixtral"]))
    model.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding_window"):
        bi.enable_batch_invariance(model)
    assert not bi.is_batch_invariant(model)


def test_save_pretrained_keeps_the_checkpoint_tokenizer(tiny_checkpoints, tmp_path) -> None:
    engine = HFMoEEngine.from_pretrained(tiny_checkpoints["olmoe"], dtype="float32")
    try:
        saved = engine.save_pretrained(tmp_path / "copy")
        again = inspect_checkpoint(saved)
        assert again.architecture == engine.architecture
        assert (again.eos_token_ids, again.pad_token_id) == ((2, 0), 0)
        original = (tiny_checkpoints["olmoe"] / "tokenizer.json").read_text()
        assert (saved / "tokenizer.json").read_text() == original  # the BPE, not bytes
    finally:
        _close(engine)

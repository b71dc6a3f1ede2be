"""``to_vllm_layout`` against transformers' own reverse conversion (what its
``save_pretrained`` writes, the names vLLM loads): Mixtral's fused experts become the
checkpoint's per-expert tensors exactly, other families pass through untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.engine.weights import export_weights
from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.vllm.layouts import to_vllm_layout
from tests.inference.vllm_engine.harness import VLLM_WIDTH_SIZES


def test_mixtral_becomes_the_checkpoints_own_names_and_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    folder = write_tiny_checkpoint("mixtral", tmp_path / "m", seed=0, sizes=VLLM_WIDTH_SIZES)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    engine = export_weights(model)
    converted = dict(to_vllm_layout("mixtral", engine.items()))
    on_disk = load_file(str(folder / "model.safetensors"))
    oracle = revert_weight_conversion(model, dict(model.state_dict()))
    assert sorted(converted) == sorted(on_disk) == sorted(oracle)
    for name, tensor in converted.items():
        assert torch.equal(tensor, on_disk[name]), name
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in converted


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen2_moe", None])
def test_other_families_pass_through(family: str | None) -> None:
    tensors = [("model.layers.1.mlp.experts.gate_up_proj", torch.ones(2, 4, 3))]
    assert list(to_vllm_layout(family, tensors)) == tensors

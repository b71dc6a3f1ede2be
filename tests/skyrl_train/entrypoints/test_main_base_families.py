"""End to end with ``model.path``: a 2-step GRPO run with R3 on a checkpoint of each family,
written by ``scripts/make_checkpoint.py``'s library function (BPE tokenizer, chat template).

A run takes about 15 s on 2 cores here. Two families run on the Megatron backend:
Qwen2-MoE (dense first layer, shared expert, q/k/v bias) and OLMoE (full-width q/k
norm, no top-k renormalisation), the two whose weights take the most converting. All
four run end to end on the FSDP backend (``test_main_base_fsdp.py``), whose weights are
the ones the engine serves, and every family's Megatron conversion is checked bit for
bit, with logits against transformers, in ``tests/skyrl_train/workers/
test_megatron_families.py``; Qwen3-MoE also runs on Megatron in the vLLM launches.
Each run's end-of-run Hugging Face export is checked against the trainer's checkpoint
of the same step (``_export_checks.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
from _e2e import SMALL
from _export_checks import check_export

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch, run
from skyrl_train.errors import ConfigValidationError

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_two_steps_on_a_checkpoint_of_each_family(tmp_path: Path, family: str) -> None:
    folder = write_tiny_checkpoint(family, tmp_path / family, seed=0)
    cfg = load_config(
        [
            *SMALL,
            f"model.path={folder}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "logging.plot=false",
        ]
    )
    history = run(cfg)
    assert len(history) == 2
    for metrics in history:
        for key in (
            "reward/mean",
            "train/policy_loss",
            "train/grad_norm",
            "r3/router_agreement_trained",
        ):
            assert math.isfinite(metrics[key]), (key, metrics[key])
        # Replay took on every MoE layer of every token, dense first layer or not.
        assert metrics["r3/router_agreement_trained"] == 1.0
    assert not ray.is_initialized()
    run_dir = tmp_path / "run"
    delta = check_export(
        run_dir / "exports" / "global_step_2",
        folder,
        run_dir / "checkpoints" / "step_000002",
        tmp_path,
    )
    print(f"{family}: export vs trainer max |logits delta| {delta:.3g}")


def test_an_unsupported_architecture_is_refused_before_ray_starts(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inference.models.tokenizer import save_byte_tokenizer

    folder = tmp_path / "llama"
    dense = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=264,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    AutoModelForCausalLM.from_config(dense).save_pretrained(str(folder))
    save_byte_tokenizer(folder)
    cfg = load_config([f"model.path={folder}", f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigValidationError) as info:
        with launch(cfg):
            pass
    assert info.value.path == "model.path"
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3MoeForCausalLM" in str(info.value)
    assert not ray.is_initialized()

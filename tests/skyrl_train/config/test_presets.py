"""The real-model presets (``configs/preset/``) and ``entrypoints.check_config``: each
preset's layout passes the launch's whole validation against the model's real
``config.json`` (written here from the published Hugging Face configs; no weights, no
tokenizer, nothing downloaded), the per-rank layout is megatron-core's, the memory
estimate adds up to the model, and a layout that breaks a rule is refused by key.

A fake interpreter (a shell script answering the vLLM build probe, as in
``test_validate_vllm.py``) stands in for the cluster's GPU vLLM, which R3 needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skyrl_train.config.compose import group_options
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.config.validate import validate_cfg
from skyrl_train.entrypoints.check_config import check_config, main
from skyrl_train.errors import ConfigValidationError

MC = "trainer.policy.megatron_config"

# config.json of each model, as published on the Hugging Face hub.
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
OLMOE_1B_7B = {  # allenai/OLMoE-1B-7B-0924
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}
QWEN2_57B_A14B = {  # Qwen/Qwen2-57B-A14B
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 2560,
    "norm_topk_prob": False,
    "num_attention_heads": 28,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 20480,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MODELS = {
    "qwen3_30b_a3b": (QWEN3_30B_A3B, 30.5e9),
    "olmoe_1b_7b": (OLMOE_1B_7B, 6.92e9),
    "mixtral_8x7b": (MIXTRAL_8X7B, 46.7e9),
    "qwen2_57b_a14b": (QWEN2_57B_A14B, 57.4e9),
}
"""Preset prefix -> (config.json, the total parameter count its publisher states)."""
PRESETS = [f"{model}_{gpus}gpu" for model in MODELS for gpus in (8, 64)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folder per model holding only its config.json, and a GPU vLLM stand-in."""
    root = tmp_path_factory.mktemp("presets")
    found = {}
    for name, (config, _) in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        found[name] = root / name
    python = root / "gpu_vllm_python"
    python.write_text('#!/bin/sh\necho \'{"vllm": "0.11.0"}\'\n')
    python.chmod(0o755)
    found["python"] = python
    return found


def overrides(folders: dict[str, Path], preset: str, *more: str) -> list[str]:
    model = preset.rsplit("_", 1)[0]
    return [
        f"model.path={folders[model]}",
        f"preset={preset}",
        f"generator.inference_engine.vllm.python={folders['python']}",
        f"trainer.run_dir={folders[model].parent / 'runs' / preset}",
        *more,
    ]


def hf_parameters(c: dict[str, Any]) -> int:
    """The parameter count of a config.json, by the Hugging Face modules' shapes
    (written apart from ``layout_report`` so each checks the other)."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or h // heads
    experts = c.get("num_experts") or c["num_local_experts"]
    width = c.get("moe_intermediate_size") or c["intermediate_size"]
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    if c["model_type"] == "qwen2_moe":  # q/k/v biases
        attention += (heads + 2 * kv) * head_dim
    norms = 2 * h + {"qwen3_moe": 2 * head_dim, "olmoe": (heads + kv) * head_dim}.get(
        c["model_type"], 0
    )
    mlp = experts * h + experts * 3 * h * width
    if c.get("shared_expert_intermediate_size"):
        mlp += 3 * h * c["shared_expert_intermediate_size"] + h
    return c["num_hidden_layers"] * (attention + norms + mlp) + 2 * c["vocab_size"] * h + h


def test_every_preset_is_listed() -> None:
    assert group_options("preset") == sorted(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_passes_the_launch_check_against_the_real_config(
    preset: str, folders: dict[str, Path]
) -> None:
    report = check_config(overrides(folders, preset))
    gpus = int(preset.rsplit("_", 1)[1].removesuffix("gpu"))
    assert report.world == len(report.ranks) == gpus
    config, published = MODELS[preset.rsplit("_", 1)[0]]
    # The test's own count is the published one, and the report's is the test's.
    assert report.total_params == hf_parameters(config)
    assert abs(report.total_params - published) / published < 0.01
    # Each rank's pieces, divided by the ranks holding the same piece, add up to the
    # model: TP-split parts repeat over DP x CP, whole ones over TP x DP x CP, experts
    # over expert-DP (no preset pads its vocabulary or ties its embeddings).
    dense_copies, expert_copies = report.dp * report.cp, report.edp
    whole = sum(
        r.sharded_params / dense_copies
        + r.replicated_params / (dense_copies * report.tp)
        + r.expert_params / expert_copies
        for r in report.ranks
    )
    assert whole == report.total_params
    for r in report.ranks:
        assert r.state_bytes == r.params * (4 + 4 + 8 + 4)  # weights, grads, AdamW, reference
        assert r.route_bytes > 0
    text = report.render()
    assert f"{report.world} ranks = TP={report.tp}" in text
    assert len(text.splitlines()) > report.world


def test_the_slime_layout_puts_each_rank_where_megatron_core_does(
    folders: dict[str, Path],
) -> None:
    report = check_config(overrides(folders, "qwen3_30b_a3b_8gpu"))
    assert (report.tp, report.dp, report.ep, report.etp, report.edp) == (4, 2, 8, 1, 1)
    for r in report.ranks:
        # attention: TP 4 x DP 2; experts: EP 8 over the same ranks (parallel folding)
        assert (r.tp, r.dp, r.pp, r.cp) == (r.rank % 4, r.rank // 4, 0, 0)
        assert (r.ep, r.etp, r.edp) == (r.rank, 0, 0)
        assert r.experts == range(16 * r.rank, 16 * r.rank + 16)
        assert r.heads == range(8 * (r.rank % 4), 8 * (r.rank % 4) + 8)
        assert r.kv_heads == range(r.rank % 4, r.rank % 4 + 1)
        assert r.layers == tuple(range(48))
        assert r.vocab_rows == range(37984 * (r.rank % 4), 37984 * (r.rank % 4 + 1))
        # 8 prompts x 4 samples over DP 2, 8192 tokens, 48 MoE layers, top-8, uint8
        assert r.route_bytes == 16 * 8192 * 48 * 8
    text = report.render()
    assert "   5  1  0  1  0   0  5   0  0-47         80-95     8-15" in text


def test_interleaved_stages_hold_megatrons_chunks(folders: dict[str, Path]) -> None:
    report = check_config(overrides(folders, "mixtral_8x7b_64gpu"))
    stage1 = next(r for r in report.ranks if r.pp == 1)
    assert stage1.layers == (1, 5, 9, 13, 17, 21, 25, 29)  # chunk c holds block 4c + 1
    assert stage1.vocab_rows is None and stage1.experts == range(stage1.ep, stage1.ep + 1)


@pytest.mark.parametrize("preset", PRESETS)
def test_rank_coordinates_are_megatron_cores_own(preset: str, folders: dict[str, Path]) -> None:
    from megatron.core.parallel_state import RankGenerator

    report = check_config(overrides(folders, preset))
    dense = RankGenerator(
        tp=report.tp, ep=1, dp=report.dp, pp=report.pp, cp=report.cp, order="tp-cp-ep-dp-pp"
    )
    experts = RankGenerator(
        tp=report.etp, ep=report.ep, dp=report.edp, pp=report.pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    for generator, axes in (
        (dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
        (experts, {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}),
    ):
        for token, field in axes.items():
            for group in generator.get_ranks(token):
                coords = [getattr(report.ranks[r], field) for r in group]
                assert coords == list(range(len(group))), (token, group, coords)


def test_vocabulary_padding_is_the_workers(folders: dict[str, Path]) -> None:
    from skyrl_train.workers.megatron.model import padded_vocab_size

    report = check_config(
        overrides(folders, "qwen3_30b_a3b_8gpu", f"{MC}.make_vocab_size_divisible_by=128")
    )
    mc = MegatronConfig(tensor_model_parallel_size=4, make_vocab_size_divisible_by=128)
    assert report.padded_vocab == padded_vocab_size(151936, mc) == 152064
    assert report.ranks[3].vocab_rows == range(3 * 38016, 4 * 38016)


def test_without_a_reference_the_estimate_drops_its_copy(folders: dict[str, Path]) -> None:
    report = check_config(overrides(folders, "olmoe_1b_7b_8gpu", "trainer.ref.log_kl=false"))
    assert not report.keeps_reference
    assert all(r.state_bytes == r.params * 16 for r in report.ranks)


@pytest.mark.parametrize(
    ("preset", "more", "key"),
    [
        # 24 ranks take TP=3 and EP=8, but 32 heads do not split in 3
        (
            "qwen3_30b_a3b_8gpu",
            [f"{MC}.tensor_model_parallel_size=3", "trainer.placement.num_trainers=24"],
            f"{MC}.tensor_model_parallel_size",
        ),
        # 40 ranks take EP=5, but 128 experts do not split in 5
        (
            "qwen3_30b_a3b_8gpu",
            [f"{MC}.expert_model_parallel_size=5", "trainer.placement.num_trainers=40"],
            f"{MC}.expert_model_parallel_size",
        ),
        # OLMoE's q/k norm spans every head: no TP
        (
            "olmoe_1b_7b_8gpu",
            [f"{MC}.tensor_model_parallel_size=2", f"{MC}.expert_tensor_parallel_size=1"],
            f"{MC}.tensor_model_parallel_size",
        ),
        # NeMo-RL's CP 2 needs Transformer Engine's attention
        ("qwen3_30b_a3b_64gpu", [f"{MC}.context_parallel_size=2"], f"{MC}.context_parallel_size"),
        # the 64-GPU Mixtral pipeline (PP 4 x VPP 8 = 32 blocks) on Qwen2's 28 layers
        (
            "qwen2_57b_a14b_64gpu",
            [
                f"{MC}.virtual_pipeline_model_parallel_size=8",
                f"{MC}.pipeline_model_parallel_size=4",
                f"{MC}.expert_tensor_parallel_size=1",
            ],
            f"{MC}.virtual_pipeline_model_parallel_size",
        ),
    ],
)
def test_a_layout_breaking_a_rule_is_refused_by_key(
    preset: str, more: list[str], key: str, folders: dict[str, Path]
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        check_config(overrides(folders, preset, *more))
    assert info.value.path == key


def test_the_command_prints_the_refusal_and_exits_1(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = overrides(
        folders,
        "olmoe_1b_7b_8gpu",
        f"{MC}.tensor_model_parallel_size=2",
        f"{MC}.expert_tensor_parallel_size=1",
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"refused: {MC}.tensor_model_parallel_size") and "Traceback" not in err
    assert main(["--prompt-tokens", "many", *argv]) == 2


def test_an_unknown_preset_names_the_group_and_its_options(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigValidationError) as info:
        check_config(overrides(folders, "qwen3_30b_a3b_16gpu"))
    assert info.value.path == "preset" and "qwen3_30b_a3b_8gpu" in str(info.value)


def test_the_launch_itself_still_wants_the_weights_and_tokenizer(
    folders: dict[str, Path],
) -> None:
    from skyrl_train.config.compose import load_config

    cfg = load_config(overrides(folders, "olmoe_1b_7b_8gpu"))
    validate_cfg(cfg, config_only=True)
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)  # main_base's check: the folder holds no safetensors
    assert info.value.path == "model.path" and "safetensors" in str(info.value)


def test_check_config_runs_end_to_end_without_megatron_core(folders: dict[str, Path]) -> None:
    # -X importtime lists every module imported (on stderr): megatron-core takes seconds
    # to import, and validation needs none of it for a preset.
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "skyrl_train.entrypoints.check_config",
            "--prompt-tokens",
            "1024",
            *overrides(folders, "qwen2_57b_a14b_64gpu"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "64 ranks = TP=4 x CP=1 x DP=8 x PP=2" in done.stdout
    assert "routes: 8 trajectories a rank x 5120 tokens" in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert not [m for m in imported if m.startswith("megatron")]


def test_the_built_in_model_under_fsdp_gets_a_report_too(tmp_path: Path) -> None:
    argv = [f"trainer.run_dir={tmp_path / 'run'}", "trainer.strategy=fsdp"]
    report = check_config([*argv, "trainer.placement.num_trainers=2"])
    assert (report.strategy, report.dp, len(report.ranks)) == ("fsdp", 2, 2)
    # each rank a half of every parameter, rounded up
    assert all(r.params == -(-report.total_params // 2) for r in report.ranks)
    assert "FSDP, 2 ranks each a 1/2 of every parameter" in report.render()

"""model.path and the built-in model: one loading path, refused early when unusable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.models.architecture import TinySizes
from inference.models.families import FAMILIES, SUPPORTED_ARCHITECTURES
from inference.models.tiny_moe import TinyMoEConfig
from inference.models.tokenizer import save_byte_tokenizer
from skyrl_train.config.compose import load_config
from skyrl_train.config.model_source import (
    model_architecture,
    model_checkpoint,
    model_checkpoint_info,
)
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import ConfigValidationError


def _save(config: Any, folder: Path, *, weights: bool = True) -> Path:
    """A folder as save_pretrained writes it, with the byte tokenizer (264 tokens)."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    else:
        config.save_pretrained(str(folder))
    save_byte_tokenizer(folder)
    return folder


def _qwen3(**overrides: Any) -> Any:
    sizes = TinySizes(vocab_size=264, **overrides)
    return FAMILIES["qwen3_moe"].tiny_config(sizes)


def _refusal(folder: Path, *extra: str) -> ConfigValidationError:
    cfg = load_config([f"model.path={folder}", *extra])
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    return info.value


def test_a_checkpoint_folder_gives_the_architecture_from_its_config(tmp_path: Path) -> None:
    folder = _save(_qwen3(), tmp_path / "ckpt")
    cfg = load_config([f"model.path={folder}"])
    validate_cfg(cfg)
    arch = model_architecture(cfg.model)
    assert (arch.family, arch.hidden_size, arch.num_experts, arch.num_experts_per_tok) == (
        "qwen3_moe",
        48,
        6,
        3,
    )
    assert arch.moe_layers == (1, 2) and arch.num_moe_layers == 2  # layer 0 is dense
    info = model_checkpoint_info(cfg.model)
    assert info is not None and info.eos_token_ids == (256,) and info.tokenizer_size == 264
    assert model_checkpoint(cfg.model) == folder


def test_an_unsupported_architecture_is_refused_naming_it_and_the_supported(
    tmp_path: Path,
) -> None:
    from transformers import LlamaConfig

    dense = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=264,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    err = _refusal(_save(dense, tmp_path / "llama"))
    assert err.path == "model.path"
    assert "config.json:architectures" in err.reason and "LlamaForCausalLM" in err.reason
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in err.reason


@pytest.mark.parametrize(
    ("missing", "fragment"),
    [("model.safetensors", "*.safetensors"), ("config.json", "config.json"), ("tokenizer", "tokenizer")],
)  # fmt: skip
def test_a_missing_file_is_refused_naming_it(tmp_path: Path, missing: str, fragment: str) -> None:
    folder = _save(_qwen3(), tmp_path / "ckpt")
    if missing == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    else:
        (folder / missing).unlink()
    err = _refusal(folder)
    assert err.path == "model.path" and fragment in err.reason and str(folder) in err.reason


def test_a_folder_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    err = _refusal(tmp_path / "nowhere")
    assert err.path == "model.path" and "existing checkpoint folder" in err.reason


def test_a_vocab_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    small = FAMILIES["qwen3_moe"].tiny_config(TinySizes(vocab_size=200))
    err = _refusal(_save(small, tmp_path / "ckpt"))
    assert "config.json:vocab_size" in err.reason
    assert "264 tokens" in err.reason and "got 200" in err.reason


def test_more_experts_than_the_route_dtype_holds_is_refused(tmp_path: Path) -> None:
    huge = _qwen3(num_experts=2**31 + 1, num_experts_per_tok=2)
    folder = _save(huge, tmp_path / "ckpt", weights=False)
    (folder / "model.safetensors").write_bytes(b"")  # never read: refused before weights
    err = _refusal(folder)
    assert "config.json:num_experts" in err.reason and "int32" in err.reason
    assert str(2**31 + 1) in err.reason


def test_a_config_the_family_cannot_map_is_refused_naming_the_field(tmp_path: Path) -> None:
    folder = _save(_qwen3(), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    err = _refusal(folder)
    assert "config.json:hidden_act" in err.reason and "'gelu'" in err.reason


def test_builtin_architecture_keys_with_a_path_are_refused(tmp_path: Path) -> None:
    folder = _save(_qwen3(), tmp_path / "ckpt")
    err = _refusal(folder, "model.builtin.hidden_size=96")
    assert err.path == "model.builtin.hidden_size"
    assert "built-in model only" in err.reason and "got 96" in err.reason


def test_the_builtin_model_is_written_once_as_a_checkpoint_keyed_by_config_and_seed(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cfg = load_config([f"model.cache_dir={cache}"])
    first = model_checkpoint(cfg.model)
    assert first.parent.parent == cache
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in first.iterdir()
    }
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert model_checkpoint(cfg.model) == first  # reused, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    reseeded = model_checkpoint(load_config([f"model.cache_dir={cache}", "model.seed=1"]).model)
    resized = model_checkpoint(
        load_config([f"model.cache_dir={cache}", "model.builtin.num_experts_per_tok=3"]).model
    )
    assert len({first, reseeded, resized}) == 3
    # Loaded back like any checkpoint, it describes exactly the built-in config.
    loaded = model_architecture(load_config([f"model.path={first}"]).model)
    assert loaded == TinyMoEConfig().architecture()


def test_builtin_vocab_smaller_than_the_byte_tokenizer_is_refused() -> None:
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config(["model.builtin.vocab_size=200"]))
    assert info.value.path == "model.builtin.vocab_size" and "264" in info.value.reason

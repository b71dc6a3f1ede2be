"""The YAML, the typed schema and the strict loader agree, and bad keys fail at load."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config import (
    CONFIG_DIR,
    CONFIG_NAME,
    ModelConfig,
    PPOConfig,
    config_to_dict,
    from_mapping,
    load_config,
    parse_config,
)
from skyrl_train.errors import ConfigValidationError


def _schema_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key the schema declares (free-form dict fields count as leaves)."""
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= _schema_keys(hints[f.name], key + ".")
    return keys


def _yaml_keys(node: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, value in node.items():
        key = f"{prefix}{name}"
        keys.add(key)
        if isinstance(value, dict) and not key.endswith(("kwargs", "runtime_env")):
            keys |= _yaml_keys(value, key + ".")
    return keys


def test_yaml_declares_every_schema_key_and_nothing_else() -> None:
    # Every key in the YAML means every key is overridable without "+".
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml"))
    raw.pop("hydra")
    assert _yaml_keys(raw) == _schema_keys(PPOConfig)


def test_yaml_defaults_equal_dataclass_defaults() -> None:
    cfg = load_config()
    assert cfg == PPOConfig()
    assert cfg.generator.inference_engine.enable_return_routed_experts is True
    assert cfg.trainer.policy.megatron_config.moe_enable_routing_replay is True
    assert cfg.trainer.policy.megatron_config.virtual_pipeline_model_parallel_size is None
    assert cfg.trainer.policy.optimizer_config.adam_betas == (0.9, 0.999)


def test_model_section_mirrors_tiny_moe_config() -> None:
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    arch_fields = {f.name for f in dataclasses.fields(TinyMoEConfig)}
    assert model_fields == arch_fields | {"seed", "path", "cache_dir"}
    assert ModelConfig().tiny_moe() == TinyMoEConfig()
    assert load_config(["model.num_layers=2"]).model.tiny_moe().num_layers == 2


def test_overrides_reach_nested_keys_with_types() -> None:
    cfg = load_config(
        [
            "trainer.num_steps=3",
            "trainer.policy.optimizer_config.lr=1",  # an int where a float is declared
            "generator.inference_engine.host=127.0.0.1",
            "trainer.policy.megatron_config.virtual_pipeline_model_parallel_size=2",
            "+trainer.policy.megatron_config.transformer_config_kwargs.moe_router_fusion=true",
            "+environment.kwargs.digits=2",  # free-form dicts take new keys with "+"
        ]
    )
    assert cfg.trainer.num_steps == 3
    lr = cfg.trainer.policy.optimizer_config.lr
    assert lr == 1.0 and isinstance(lr, float)
    assert cfg.generator.inference_engine.host == "127.0.0.1"
    mc = cfg.trainer.policy.megatron_config
    assert mc.virtual_pipeline_model_parallel_size == 2
    assert mc.transformer_config_kwargs == {"moe_router_fusion": True}
    assert cfg.environment.kwargs == {"digits": 2}


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("trainer.no_such_key=1", "trainer.no_such_key", "override"),
        ("+trainer.no_such_key=1", "trainer.no_such_key", "unknown key"),
        ("+trainer.policy.megatron_config.tp=2", "trainer.policy.megatron_config.tp", "unknown key"),
        ("+bogus=1", "bogus", "unknown key"),
        # Keys that did nothing, removed (issue 14): a config that still sets them fails.
        ("+trainer.placement.colocate=true", "trainer.placement.colocate", "unknown key"),
        ("+generator.inference_engine.backend=hf_cpu", "generator.inference_engine.backend", "unknown key"),
        ("+trainer.algorithm.loss_reduction=token_mean", "trainer.algorithm.loss_reduction", "unknown key"),
        ("trainer.num_steps=abc", "trainer.num_steps", "expected an int"),
        ("trainer.num_steps=1.5", "trainer.num_steps", "expected an int"),
        ("trainer.num_steps=true", "trainer.num_steps", "expected an int"),
        ("generator.inference_engine.enable_return_routed_experts=1", "generator.inference_engine.enable_return_routed_experts", "true or false"),
        ("generator.inference_engine.dtype=fp8", "generator.inference_engine.dtype", "expected one of"),
        ("trainer.algorithm.advantage_estimator=gae", "trainer.algorithm.advantage_estimator", "expected one of"),
        ("trainer.policy.megatron_config.routing_replay_source=engine", "trainer.policy.megatron_config.routing_replay_source", "expected one of"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9]", "trainer.policy.optimizer_config.adam_betas", "list of 2"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9,x]", "trainer.policy.optimizer_config.adam_betas[1]", "expected a number"),
        ("trainer.policy.megatron_config.transformer_config_kwargs=5", "trainer.policy.megatron_config.transformer_config_kwargs", "mapping"),
        ("trainer.placement=3", "trainer.placement", "mapping"),
        ("environment.env_class=5", "environment.env_class", "expected a string"),
    ],
)  # fmt: skip
def test_bad_override_fails_at_load_naming_the_key(override: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config([override])
    assert info.value.key == key
    assert fragment in str(info.value)
    assert str(info.value).startswith(key + ":")


def test_parse_config_accepts_a_dictconfig_and_round_trips() -> None:
    cfg = load_config(["trainer.seed=7"])
    plain = config_to_dict(cfg)
    assert plain["trainer"]["policy"]["optimizer_config"]["adam_betas"] == [0.9, 0.999]
    assert parse_config(OmegaConf.create(plain)) == cfg
    assert parse_config(plain) == cfg


def test_missing_keys_take_dataclass_defaults() -> None:
    assert parse_config({"trainer": {"num_steps": 2}}) == dataclasses.replace(
        PPOConfig(), trainer=dataclasses.replace(PPOConfig().trainer, num_steps=2)
    )


def test_from_mapping_rejects_non_mapping_root() -> None:
    with pytest.raises(ConfigValidationError) as info:
        from_mapping(PPOConfig, [1, 2])
    assert info.value.key == "<root>"

"""The YAML, its config groups and the structured schema agree; composition refuses
unknown keys (naming the closest real one) and wrong types, naming the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config import (
    CONFIG_DIR,
    CONFIG_NAME,
    PPOConfig,
    config_to_dict,
    load_config,
    parse_config,
    validate_cfg,
)
from skyrl_train.config.compose import GROUPS, group_options
from skyrl_train.errors import ConfigValidationError

REPO = Path(__file__).resolve().parents[3]


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


def test_yaml_and_default_groups_declare_every_schema_key() -> None:
    # Every key written out means every key is overridable without "+".
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml"))
    raw.pop("hydra")
    defaults = raw.pop("defaults")
    assert defaults[:2] == ["ppo_schema", "_self_"]
    for entry in defaults[2:]:
        ((group, option),) = entry.items()
        if group.startswith("override hydra/") or option is None:  # preset: none by default
            continue
        raw[group] = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml"))
    assert _yaml_keys(raw) == _schema_keys(PPOConfig)


def test_yaml_defaults_equal_dataclass_defaults() -> None:
    cfg = load_config()
    assert cfg == PPOConfig()
    assert cfg.generator.inference_engine.enable_return_routed_experts is True
    assert cfg.trainer.policy.routing_replay.enabled is True
    assert cfg.trainer.policy.routing_replay.source == "rollout"
    # The deprecated aliases default to null: not set (config.routing_replay).
    assert cfg.trainer.policy.megatron_config.moe_enable_routing_replay is None
    assert cfg.trainer.policy.megatron_config.virtual_pipeline_model_parallel_size is None
    assert cfg.trainer.policy.optimizer_config.adam_betas == [0.9, 0.999]


def test_model_node_holds_the_builtin_architecture_whole() -> None:
    cfg = load_config(["model.builtin.num_layers=2"])
    assert isinstance(cfg.model.builtin, TinyMoEConfig)
    assert cfg.model.builtin == dataclasses.replace(TinyMoEConfig(), num_layers=2)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_preset_composes(group: str) -> None:
    options = group_options(group)
    assert len(options) >= 2, options
    for option in options:
        load_config([f"{group}={option}"])  # types and keys checked by the schema


def test_presets_set_what_they_say() -> None:
    qwen = load_config(["model=qwen3_moe_tiny"]).model
    assert qwen.path == "checkpoints/qwen3_moe-tiny" and qwen.builtin == TinyMoEConfig()
    guess = load_config(["environment=guess_number"])
    assert guess.environment.env_class == "guess_number" and guess.trainer.num_steps == 60
    # A command-line override still wins over the preset it follows.
    assert load_config(["environment=guess_number", "trainer.num_steps=5"]).trainer.num_steps == 5
    arith = load_config(["data=arith"]).data
    assert arith.train_data == ["data/arith/train.parquet"]


def test_unknown_group_option_names_the_options() -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config(["model=nope"])
    assert info.value.path == "model"
    assert "qwen3_moe_tiny" in info.value.reason and "'nope'" in info.value.reason


def test_overrides_reach_nested_keys_with_types() -> None:
    cfg = load_config(
        [
            "trainer.num_steps=3",
            "trainer.policy.optimizer_config.lr=1",  # an int where a float is declared
            "generator.inference_engine.host=127.0.0.1",
            "trainer.policy.megatron_config.virtual_pipeline_model_parallel_size=2",
            "+trainer.policy.megatron_config.transformer_config_kwargs.moe_router_fusion=true",
            "+environment.skyrl_gym.gsm8k.strict=true",  # free-form dicts take new keys: "+"
        ]
    )
    assert cfg.trainer.num_steps == 3
    lr = cfg.trainer.policy.optimizer_config.lr
    assert lr == 1.0 and isinstance(lr, float)
    assert cfg.generator.inference_engine.host == "127.0.0.1"
    mc = cfg.trainer.policy.megatron_config
    assert mc.virtual_pipeline_model_parallel_size == 2
    assert mc.transformer_config_kwargs == {"moe_router_fusion": True}
    assert cfg.environment.skyrl_gym == {"gsm8k": {"strict": True}}


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("trainer.num_stpes=3", "trainer.num_stpes", "trainer.num_steps"),
        ("+trainer.num_stpes=3", "trainer.num_stpes", "trainer.num_steps"),
        ("trainer.algorithm.eps_clip_hgh=0.3", "trainer.algorithm.eps_clip_hgh", "trainer.algorithm.eps_clip_high"),
        ("+trainer.policy.megatron_config.tp=2", "trainer.policy.megatron_config.tp", "trainer.policy.megatron_config"),
        # The architecture moved under model.builtin and the router's top_k is
        # num_experts_per_tok, sampling keeps top_k (issue 14): old keys point there.
        ("model.top_k=2", "model.top_k", "model.builtin.num_experts_per_tok"),
        ("model.builtin.top_k=2", "model.builtin.top_k", "model.builtin.num_experts_per_tok"),
        ("model.hidden_size=32", "model.hidden_size", "model.builtin.hidden_size"),
        ("generator.max_trajectory_tokens=64", "generator.max_trajectory_tokens", "generator.max_response_tokens"),
        ("+logging.tensorboard=true", "logging.tensorboard", "logging.trackers"),
        # Keys that did nothing, removed (issue 14): a config that still sets them fails.
        ("+trainer.placement.colocate=true", "trainer.placement.colocate", None),
        ("+generator.inference_engine.backend=hf_cpu", "generator.inference_engine.backend", None),
        ("+trainer.algorithm.loss_reduction=token_mean", "trainer.algorithm.loss_reduction", None),
        ("+bogus=1", "bogus", None),
    ],
)  # fmt: skip
def test_unknown_key_fails_naming_the_closest_real_key(
    override: str, key: str, suggestion: str | None
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config([override])
    assert info.value.path == key
    assert str(info.value).startswith(f"{key}: expected a key the schema declares")
    if suggestion is not None:
        assert f"did you mean '{suggestion}" in info.value.reason


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("trainer.num_steps=abc", "trainer.num_steps", "expected integer, got 'abc'"),
        ("trainer.num_steps=1.5", "trainer.num_steps", "expected integer"),
        ("trainer.num_steps=true", "trainer.num_steps", "expected integer"),
        ("generator.inference_engine.enable_return_routed_experts=maybe", "generator.inference_engine.enable_return_routed_experts", "expected bool"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9,x]", "trainer.policy.optimizer_config.adam_betas[1]", "expected float"),
        ("trainer.policy.optimizer_config.lr=fast", "trainer.policy.optimizer_config.lr", "expected float"),
        ("trainer.placement=3", "trainer.placement", ""),
        ("trainer.policy.megatron_config.transformer_config_kwargs=5", "trainer.policy.megatron_config.transformer_config_kwargs", ""),
        ("model.builtin.num_experts_per_tok=9", "model.builtin.num_experts_per_tok", "expected <= num_experts (8), got 9"),
        ("model.builtin.num_kv_heads=3", "model.builtin.num_kv_heads", "expected a divisor of num_attention_heads (4), got 3"),
    ],
)  # fmt: skip
def test_wrong_type_fails_at_composition_naming_the_key(
    override: str, key: str, fragment: str
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config([override])
    assert info.value.path == key
    assert fragment in str(info.value)
    assert str(info.value).startswith(key + ":")


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("generator.inference_engine.dtype=fp8", "generator.inference_engine.dtype", "expected one of ['bfloat16', 'float16', 'float32'], got 'fp8'"),
        ("trainer.algorithm.advantage_estimator=gae", "trainer.algorithm.advantage_estimator", "expected one of"),
        ("trainer.policy.megatron_config.routing_replay_source=engine", "trainer.policy.megatron_config.routing_replay_source", "expected one of"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9]", "trainer.policy.optimizer_config.adam_betas", "expected a list of 2"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9,1.0]", "trainer.policy.optimizer_config.adam_betas[1]", "< 1.0, got 1.0"),
        ("trainer.num_steps=0", "trainer.num_steps", "expected an int >= 1, got 0"),
        ("generator.sampling_params.top_k=0", "generator.sampling_params.top_k", "expected -1 (no cut) or an int >= 1, got 0"),
        ("trainer.max_ckpts_to_keep=0", "trainer.max_ckpts_to_keep", "expected -1 or an int >= 1"),
        ("generator.inference_engine.port=70000", "generator.inference_engine.port", "<= 65535"),
        ("trainer.policy.optimizer_config.lr=inf", "trainer.policy.optimizer_config.lr", "expected a finite number > 0.0, got inf"),
        ("trainer.algorithm.dynamic_sampling.type=drop", "trainer.algorithm.dynamic_sampling.type", "expected one of ['filter', 'filter_flat_steps', 'replace']"),
    ],
)  # fmt: skip
def test_declared_rules_fail_at_validation_naming_the_key(
    override: str, key: str, fragment: str
) -> None:
    cfg = load_config([override])  # a well-typed value: composition accepts it
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert info.value.path == key
    assert fragment in info.value.reason, info.value.reason


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyrl_train.entrypoints.main_base", "--cfg", "job", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cfg_job_refuses_a_wrong_type_naming_the_key() -> None:
    bad = _launch("trainer.num_steps=abc")
    assert bad.returncode != 0
    assert "trainer.num_steps" in bad.stderr and "abc" in bad.stderr
    good = _launch("trainer.num_steps=7")
    assert good.returncode == 0, good.stderr
    assert "num_steps: 7" in good.stdout


def test_cfg_job_suggests_the_key_a_misspelt_one_meant() -> None:
    bad = _launch("trainer.num_stpes=7")
    assert bad.returncode != 0
    assert "did you mean 'trainer.num_steps'" in bad.stderr


def test_parse_config_accepts_a_dictconfig_and_round_trips() -> None:
    cfg = load_config(["trainer.seed=7"])
    plain = config_to_dict(cfg)
    assert plain["trainer"]["policy"]["optimizer_config"]["adam_betas"] == [0.9, 0.999]
    assert plain["model"]["builtin"]["num_experts_per_tok"] == 2
    assert parse_config(OmegaConf.create(plain)) == cfg
    assert parse_config(plain) == cfg


def test_missing_keys_take_dataclass_defaults() -> None:
    expected = PPOConfig()
    expected.trainer.num_steps = 2
    assert parse_config({"trainer": {"num_steps": 2}}) == expected


def test_parse_config_refuses_unknown_keys_and_non_mappings() -> None:
    with pytest.raises(ConfigValidationError) as info:
        parse_config({"trainer": {"num_stpes": 2}})
    assert info.value.path == "trainer.num_stpes"
    assert "did you mean 'trainer.num_steps'" in info.value.reason
    with pytest.raises(ConfigValidationError):
        parse_config([1, 2])  # type: ignore[arg-type]


def test_the_readme_preset_command_validates_once_its_files_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README, "Bring your own checkpoint and data": make_checkpoint + make_arith_dataset, then
    # model=qwen3_moe_tiny data=arith environment=gsm8k from the same folder.
    monkeypatch.chdir(tmp_path)
    for script, args in (
        ("make_checkpoint.py", ["--family", "qwen3_moe", "--out", "checkpoints/qwen3_moe-tiny"]),
        ("make_arith_dataset.py", ["--out", "data/arith", "--train", "8", "--val", "4"]),
    ):
        done = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
    cfg = load_config(["model=qwen3_moe_tiny", "data=arith", "environment=gsm8k"])
    validate_cfg(cfg)
    assert (cfg.generator.max_turns, cfg.generator.max_tokens_per_turn) == (1, 32)

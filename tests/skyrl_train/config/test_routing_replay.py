"""``trainer.policy.routing_replay`` and its deprecated aliases in ``megatron_config``:
an alias a launch script sets reaches the node (with a warning naming the new key), the
node reaches the Megatron worker's keys, and two that disagree are refused naming both."""

from __future__ import annotations

import copy
import warnings

import pytest

from skyrl_train.config import (
    MegatronConfig,
    PPOConfig,
    load_config,
    megatron_rules,
    routing_replay,
    validate_cfg,
)
from skyrl_train.config.routing_replay import (
    megatron_replay_enabled,
    megatron_worker_config,
    resolve_routing_replay,
)
from skyrl_train.config.schema import RoutingReplayConfig
from skyrl_train.errors import ConfigValidationError

NODE = "trainer.policy.routing_replay"
MC = "trainer.policy.megatron_config"


def _composed(overrides: list[str]) -> tuple[PPOConfig, list[str]]:
    """The composed config and the FutureWarnings composition gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_config(overrides)
    return cfg, [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize(
    ("alias", "value", "field", "expected"),
    [
        ("moe_enable_routing_replay", "false", "enabled", False),
        ("routing_replay_source", "old_policy", "source", "old_policy"),
        # The old default written out: still the deprecated key, still told.
        ("moe_enable_routing_replay", "true", "enabled", True),
    ],
)
def test_an_alias_is_copied_into_the_node_with_a_warning_naming_the_new_key(
    alias: str, value: str, field: str, expected: object
) -> None:
    cfg, warned = _composed([f"{MC}.{alias}={value}"])
    assert getattr(cfg.trainer.policy.routing_replay, field) == expected
    assert getattr(cfg.trainer.policy.megatron_config, alias) is None  # read once, cleared
    assert len(warned) == 1
    assert f"{MC}.{alias} is deprecated: set {NODE}.{field} instead" in warned[0]
    validate_cfg(cfg)  # resolved already: validation leaves it as it is


def test_the_new_node_alone_gives_no_warning() -> None:
    cfg, warned = _composed([f"{NODE}.source=old_policy"])
    assert cfg.trainer.policy.routing_replay.source == "old_policy"
    assert warned == []


@pytest.mark.parametrize(
    ("overrides", "alias", "field", "got"),
    [
        ([f"{NODE}.enabled=false", f"{MC}.moe_enable_routing_replay=true"], "moe_enable_routing_replay", "enabled", "got true"),
        ([f"{NODE}.source=old_policy", f"{MC}.routing_replay_source=rollout"], "routing_replay_source", "source", "got 'rollout'"),
    ],
)  # fmt: skip
def test_an_alias_disagreeing_with_the_node_is_refused_naming_both_keys(
    overrides: list[str], alias: str, field: str, got: str
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config(overrides)
    assert info.value.path == f"{MC}.{alias}"
    assert f"{NODE}.{field}" in info.value.reason
    assert str(info.value).endswith(got)


def test_an_alias_agreeing_with_the_node_is_accepted() -> None:
    cfg, warned = _composed([f"{NODE}.enabled=false", f"{MC}.moe_enable_routing_replay=false"])
    assert cfg.trainer.policy.routing_replay.enabled is False and len(warned) == 1


def test_a_config_built_in_python_is_resolved_by_validation() -> None:
    # Never composed: validate_cfg moves the alias in place, so the trainer, which reads
    # only the node, trains R2 as the alias asked.
    cfg = PPOConfig()
    cfg.trainer.policy.megatron_config.routing_replay_source = "old_policy"
    with pytest.warns(FutureWarning, match=f"set {NODE}.source instead"):
        validate_cfg(cfg)
    assert cfg.trainer.policy.routing_replay.source == "old_policy"
    assert cfg.trainer.policy.megatron_config.routing_replay_source is None


def test_resolving_twice_changes_nothing_and_warns_once() -> None:
    cfg = PPOConfig()
    cfg.trainer.policy.megatron_config.moe_enable_routing_replay = False
    with pytest.warns(FutureWarning):
        resolve_routing_replay(cfg)
    resolved = copy.deepcopy(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_routing_replay(cfg)
    assert cfg == resolved and cfg.trainer.policy.routing_replay.enabled is False


def test_the_node_reaches_the_megatron_workers_keys() -> None:
    # The factory's copy: the run's mode in the keys the worker reads, the config's own
    # node untouched.
    mc = MegatronConfig(tensor_model_parallel_size=2)
    off = megatron_worker_config(mc, RoutingReplayConfig(enabled=False, source="old_policy"))
    assert off.moe_enable_routing_replay is False and off.routing_replay_source == "old_policy"
    assert off.tensor_model_parallel_size == 2 and mc.moe_enable_routing_replay is None
    assert megatron_replay_enabled(off) is False


def test_a_megatron_node_built_in_python_keeps_the_old_default() -> None:
    # Worker tests and scripts build MegatronConfig() directly: null is replay on.
    assert megatron_replay_enabled(MegatronConfig()) is True
    assert megatron_replay_enabled(MegatronConfig(moe_enable_routing_replay=True)) is True
    assert megatron_replay_enabled(MegatronConfig(moe_enable_routing_replay=False)) is False


def test_replay_off_in_the_node_lifts_the_megatron_replay_refusals() -> None:
    # check_megatron sees the node's mode, not the null alias (which means on).
    kwargs = f"+{MC}.transformer_config_kwargs.moe_router_fusion=true"
    with pytest.raises(ConfigValidationError, match="bypasses RouterReplay"):
        validate_cfg(load_config([kwargs]))
    validate_cfg(load_config([kwargs, f"{NODE}.enabled=false"]))


def test_a_bad_alias_value_is_named_as_the_alias() -> None:
    cfg, _warned = _composed([f"{MC}.routing_replay_source=engine"])
    assert cfg.trainer.policy.routing_replay.source == "rollout"  # not copied
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert info.value.path == f"{MC}.routing_replay_source"
    assert info.value.reason == "expected one of ['rollout', 'old_policy'], got 'engine'"


def test_r3_without_engine_routes_names_the_new_key() -> None:
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config(["generator.inference_engine.enable_return_routed_experts=false"]))
    assert info.value.path == f"{NODE}.enabled"
    validate_cfg(
        load_config(
            [
                "generator.inference_engine.enable_return_routed_experts=false",
                f"{NODE}.enabled=false",
            ]
        )
    )


def test_check_routing_replay_stays_importable_from_megatron_rules() -> None:
    assert megatron_rules.check_routing_replay is routing_replay.check_routing_replay

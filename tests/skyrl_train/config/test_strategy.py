"""``trainer.strategy`` at launch: a key of the backend the run does not use is refused
naming the key, its default and the strategy; the data-parallel size is the backend's;
the Megatron rules run only for Megatron; the run config records the active backend."""

from __future__ import annotations

import json

import pytest

from skyrl_train.config import load_config, parse_config, validate_cfg
from skyrl_train.config import validate as validate_module
from skyrl_train.config.schema import STRATEGIES, FSDPConfig, MegatronConfig
from skyrl_train.config.strategy import BACKEND_NODES, data_parallel_size
from skyrl_train.errors import ConfigValidationError
from skyrl_train.trainer.policy_group import run_config_record

MC = "trainer.policy.megatron_config"
FSDP = "trainer.policy.fsdp_config"
ON_FSDP = ["trainer.strategy=fsdp"]
MICRO = "trainer.micro_train_batch_size_per_gpu"
TWO_RANKS = ["trainer.placement.num_trainers=2", "trainer.micro_train_batch_size_per_gpu=16"]


def _refusal(overrides: list[str]) -> ConfigValidationError:
    cfg = load_config(overrides)
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert str(info.value).startswith(info.value.path + ": ")
    return info.value


def test_every_strategy_has_its_node() -> None:
    assert set(BACKEND_NODES) == set(STRATEGIES)
    assert BACKEND_NODES["megatron"] == ("megatron_config", MegatronConfig)
    assert BACKEND_NODES["fsdp"] == ("fsdp_config", FSDPConfig)


@pytest.mark.parametrize(
    ("overrides", "key", "expected", "got"),
    [
        ([*ON_FSDP, f"{MC}.tensor_model_parallel_size=2"], f"{MC}.tensor_model_parallel_size", "1", "2"),
        ([*ON_FSDP, f"{MC}.virtual_pipeline_model_parallel_size=2"], f"{MC}.virtual_pipeline_model_parallel_size", "null", "2"),
        ([*ON_FSDP, f"+{MC}.transformer_config_kwargs.moe_router_fusion=true"], f"{MC}.transformer_config_kwargs.moe_router_fusion", "null", "true"),
        # The deprecated replay aliases are Megatron keys too.
        ([*ON_FSDP, f"{MC}.moe_enable_routing_replay=false"], f"{MC}.moe_enable_routing_replay", "null", "false"),
        ([*ON_FSDP, f"{MC}.routing_replay_source=old_policy"], f"{MC}.routing_replay_source", "null", "'old_policy'"),
        ([f"{FSDP}.param_dtype=bfloat16"], f"{FSDP}.param_dtype", "'float32'", "'bfloat16'"),
        ([f"{FSDP}.activation_checkpointing=true"], f"{FSDP}.activation_checkpointing", "false", "true"),
    ],
)  # fmt: skip
def test_a_key_of_the_other_backend_is_refused_naming_it_and_the_strategy(
    overrides: list[str], key: str, expected: str, got: str
) -> None:
    strategy = "fsdp" if overrides[0] == ON_FSDP[0] else "megatron"
    err = _refusal(overrides)
    assert err.path == key
    assert err.reason.startswith(
        f"expected {expected} (its default) with trainer.strategy={strategy}"
    )
    assert err.reason.endswith(f", got {got}")


def test_each_backend_takes_its_own_keys() -> None:
    validate_cfg(load_config([*ON_FSDP, f"{FSDP}.reshard_after_forward=false"]))
    validate_cfg(load_config([f"{MC}.expert_model_parallel_size=2", *TWO_RANKS]))
    # The replay mode is neither backend's: the FSDP backend takes it too.
    validate_cfg(load_config([*ON_FSDP, "trainer.policy.routing_replay.source=old_policy"]))


def test_an_unknown_strategy_is_refused_naming_the_choices() -> None:
    err = _refusal(["trainer.strategy=deepspeed"])
    assert err.path == "trainer.strategy"
    assert err.reason == "expected one of ['megatron', 'fsdp'], got 'deepspeed'"


def test_the_data_parallel_size_is_the_backends() -> None:
    megatron = load_config(
        [f"{MC}.tensor_model_parallel_size=2", "trainer.placement.num_trainers=4"]
    )
    assert data_parallel_size(megatron.trainer) == 2  # two TP pairs
    fsdp = load_config([*ON_FSDP, "trainer.placement.num_trainers=4"])
    assert data_parallel_size(fsdp.trainer) == 4  # every rank holds a shard of one copy


def test_fsdp_batch_sizes_divide_over_every_rank() -> None:
    four = [*ON_FSDP, "trainer.policy_mini_batch_size=4"]
    # 4 prompts x 8 samples per optimizer step do not split over 3 FSDP ranks.
    err = _refusal([*four, "trainer.placement.num_trainers=3"])
    assert err.path == "trainer.policy_mini_batch_size"
    assert "divisible by the data-parallel size (3)" in err.reason
    # Over 4 ranks each takes 8 trajectories, which 3-row micro-batches cannot split.
    err = _refusal([*four, "trainer.placement.num_trainers=4", f"{MICRO}=3"])
    assert err.path == MICRO
    assert "per-rank mini-batch (8 trajectories)" in err.reason
    # A micro-batch at or above a rank's mini-batch takes it whole: one microbatch.
    for micro in (8, 32):
        validate_cfg(load_config([*four, "trainer.placement.num_trainers=4", f"{MICRO}={micro}"]))


@pytest.mark.parametrize("placement", ["PACK", "SPREAD", "STRICT_PACK"])
def test_fsdp_places_its_ranks_as_megatron_does(placement: str) -> None:
    overrides = [*TWO_RANKS, f"trainer.placement.strategy={placement}"]
    validate_cfg(load_config([*ON_FSDP, *overrides]))
    validate_cfg(load_config(overrides))
    err = _refusal([*ON_FSDP, *TWO_RANKS, "trainer.placement.strategy=STRICT_SPREAD"])
    assert err.path == "trainer.placement.strategy"


def test_the_megatron_rules_run_only_for_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(
        validate_module, "check_megatron", lambda cfg, *a: seen.append(cfg.trainer.strategy)
    )
    validate_cfg(load_config(ON_FSDP))
    validate_cfg(load_config())
    assert seen == ["megatron"]


@pytest.mark.parametrize(
    ("strategy", "node", "other"),
    [("megatron", "megatron_config", "fsdp_config"), ("fsdp", "fsdp_config", "megatron_config")],
)
def test_the_run_config_records_the_strategy_and_its_node(
    strategy: str, node: str, other: str
) -> None:
    cfg = load_config([f"trainer.strategy={strategy}", "trainer.placement.num_trainers=2"])
    record = json.loads(run_config_record(cfg))
    assert record["trainer"]["strategy"] == strategy
    assert list(record["trainer"]["policy"]) == ["optimizer_config", "routing_replay", node]
    assert other not in record["trainer"]["policy"]
    # An export reads it back as the same backend and layout.
    back = parse_config(record)
    assert back.trainer.strategy == strategy and back.trainer.placement.num_trainers == 2
    assert getattr(back.trainer.policy, node) == getattr(cfg.trainer.policy, node)

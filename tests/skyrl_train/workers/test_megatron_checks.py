"""Refusals that need no model: the megatron_config node, VPP/fusion/sinkhorn with
replay, route checks, and the contiguous re-layout of left-padded rows."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _megatron_batches import make_batch

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.errors import ConfigValidationError, RouteReplayError
from skyrl_train.workers.megatron.layout import (
    make_contiguous,
    shard_for_data_parallel_rank,
    shift_rows,
)
from skyrl_train.workers.megatron.model import refuse_unsupported_on_cpu, transformer_config_kwargs
from skyrl_train.workers.megatron.replay import LocalRouters, validate_routes
from skyrl_train.workers.megatron.worker import MegatronPolicyWorker

KEY = "trainer.policy.megatron_config"
CFG = TinyMoEConfig()
ARCH = CFG.architecture()


def _setup(**values: Any) -> None:
    MegatronPolicyWorker(ARCH, MegatronConfig(**values)).setup()


def test_worker_refuses_unproven_vpp_with_replay_naming_the_key() -> None:
    with pytest.raises(ConfigValidationError) as err:
        _setup(moe_enable_routing_replay=True, virtual_pipeline_model_parallel_size=2)
    assert err.value.path == f"{KEY}.virtual_pipeline_model_parallel_size"
    assert "got 2 at pipeline size 1" in str(err.value)
    # Refused before any process group or model exists (PP=2 needs two ranks).
    with pytest.raises(ConfigValidationError) as err:
        _setup(
            moe_enable_routing_replay=True,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            transformer_config_kwargs={"recompute_granularity": "selective"},
        )
    assert err.value.path == f"{KEY}.transformer_config_kwargs.recompute_granularity"


def test_worker_refuses_vpp_resolved_from_passthrough_kwargs() -> None:
    kwargs = {"virtual_pipeline_model_parallel_size": 2}
    with pytest.raises(ConfigValidationError) as err:
        _setup(moe_enable_routing_replay=True, transformer_config_kwargs=kwargs)
    assert err.value.path == f"{KEY}.transformer_config_kwargs.virtual_pipeline_model_parallel_size"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"moe_router_fusion": True}, "moe_router_fusion"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type"),
    ],
)
def test_worker_refuses_replay_bypassing_router_settings(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigValidationError) as err:
        _setup(moe_enable_routing_replay=True, transformer_config_kwargs=kwargs)
    assert err.value.path == f"{KEY}.transformer_config_kwargs.{field}"


def test_worker_refuses_a_passthrough_moe_layer_pattern_unlike_the_checkpoints() -> None:
    with pytest.raises(ConfigValidationError) as err:
        _setup(transformer_config_kwargs={"moe_layer_freq": [0, 1, 1, 1]})
    assert err.value.path == f"{KEY}.transformer_config_kwargs.moe_layer_freq"
    assert "expected MoE layers [0, 1, 2, 3] (the checkpoint's), got [1, 2, 3]" in str(err.value)


def test_worker_checks_the_nodes_constraints() -> None:
    # A node built in Python never went through Hydra or validate_cfg.
    with pytest.raises(ConfigValidationError, match=rf"^{KEY}\.expert_model_parallel_size"):
        MegatronPolicyWorker(ARCH, MegatronConfig(expert_model_parallel_size=0))
    with pytest.raises(ConfigValidationError, match=rf"^{KEY}\.routing_replay_source"):
        MegatronPolicyWorker(ARCH, MegatronConfig(routing_replay_source="engine"))


def test_expert_tensor_parallel_size_reaches_the_transformer_config() -> None:
    assert "expert_tensor_parallel_size" not in transformer_config_kwargs(ARCH, MegatronConfig())
    mc = MegatronConfig(expert_tensor_parallel_size=2)
    assert transformer_config_kwargs(ARCH, mc)["expert_tensor_parallel_size"] == 2
    mc.transformer_config_kwargs = {"expert_tensor_parallel_size": 1}  # the passthrough wins
    assert transformer_config_kwargs(ARCH, mc)["expert_tensor_parallel_size"] == 1


def test_pipelines_refuse_tied_embeddings() -> None:
    tied = dataclasses.replace(ARCH, tie_word_embeddings=True)
    with pytest.raises(ConfigValidationError, match=rf"^{KEY}\.pipeline_model_parallel_size: "):
        MegatronPolicyWorker(tied, MegatronConfig(pipeline_model_parallel_size=2)).setup()


def test_cpu_path_refuses_tensor_and_context_parallelism_not_pipelines() -> None:
    for key in ("tensor_model_parallel_size", "context_parallel_size"):
        with pytest.raises(ConfigValidationError, match=rf"^{KEY}\.{key}: expected 1 on CPU"):
            refuse_unsupported_on_cpu(MegatronConfig(**{key: 2}))
    refuse_unsupported_on_cpu(MegatronConfig(pipeline_model_parallel_size=2))


# ---- route checks --------------------------------------------------------------

ROUTERS = LocalRouters(
    modules=(),
    layers=(0, 1, 2, 3),
    moe_layers=(0, 1, 2, 3),
    num_experts=8,
    top_k=2,
    replay_enabled=True,
    chunks=(0, 0, 0, 0),
)


def _routes(batch: int = 2, seq: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.rand(batch, seq, 4, 8, generator=gen).argsort(-1)[..., :2]


def test_valid_routes_pass() -> None:
    validate_routes(_routes(), ROUTERS, trajectory_ids=["a", "b"])


def test_route_id_out_of_range_names_trajectory_and_layer() -> None:
    routes = _routes()
    routes[1, 3, 2, 0] = 8
    with pytest.raises(RouteReplayError, match=r"trajectory 'b' \(batch row 1\), layer 2, token 3"):
        validate_routes(routes, ROUTERS, trajectory_ids=["a", "b"])
    routes[1, 3, 2, 0] = -1
    with pytest.raises(RouteReplayError, match=r"expert ids in \[0, 8\), got -1"):
        validate_routes(routes, ROUTERS)


def test_route_row_with_repeated_expert_is_refused() -> None:
    routes = _routes()
    routes[0, 4, 1] = torch.tensor([5, 5])
    with pytest.raises(
        RouteReplayError, match=r"batch row 0, layer 1, token 4: expected 2 distinct"
    ):
        validate_routes(routes, ROUTERS)


def test_repeated_expert_is_found_wherever_it_sits_in_the_row() -> None:
    routers = LocalRouters(
        modules=(),
        layers=(0, 1, 2, 3),
        moe_layers=(0, 1, 2, 3),
        num_experts=8,
        top_k=3,
        replay_enabled=True,
        chunks=(0, 0, 0, 0),
    )
    gen = torch.Generator().manual_seed(0)
    routes = torch.rand(2, 5, 4, 8, generator=gen).argsort(-1)[..., :3]
    validate_routes(routes, routers)
    routes[1, 2, 3] = torch.tensor([5, 2, 5])  # the repeats are not neighbours
    with pytest.raises(RouteReplayError, match=r"batch row 1, layer 3, token 2: expected 3"):
        validate_routes(routes, routers)


@pytest.mark.parametrize("shape", [(2, 5, 3, 2), (2, 5, 4, 3), (2, 5, 4)])
def test_route_shape_must_match_model(shape: tuple[int, ...]) -> None:
    routes = torch.zeros(shape, dtype=torch.int64)
    with pytest.raises(RouteReplayError, match=r"^routed_experts"):
        validate_routes(routes, ROUTERS)


def test_layer_of_all_zeros_is_refused_padding_ignored() -> None:
    routes = _routes()
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 3:] = True
    routes[0, :, 3] = torch.tensor([0, 1])  # padding rows: arange(K)
    routes[0, :3, 3] = 0  # every real token of trajectory 0, layer 3
    with pytest.raises(RouteReplayError, match=r"'t0' \(batch row 0\), layer 3: .*all zeros"):
        validate_routes(routes, ROUTERS, padding_mask=padding, trajectory_ids=["t0", "t1"])
    single = LocalRouters(
        modules=(),
        layers=(0, 1, 2, 3),
        moe_layers=(0, 1, 2, 3),
        num_experts=8,
        top_k=1,
        replay_enabled=True,
        chunks=(0, 0, 0, 0),
    )
    ones = _routes()[..., :1]
    ones[1, :, 0] = 0  # top-1 rows of zeros are each valid; the whole layer is not
    with pytest.raises(RouteReplayError, match=r"batch row 1, layer 0: .*all zeros"):
        validate_routes(ones, single)


def test_dense_first_models_take_moe_layers_only_and_name_both_numbers() -> None:
    routers = LocalRouters(
        modules=(),
        layers=(1, 2),
        moe_layers=(1, 2),
        num_experts=8,
        top_k=2,
        replay_enabled=True,
        chunks=(0, 0),
    )
    assert routers.num_layers == 2 and routers.route_layers == (0, 1)
    with pytest.raises(RouteReplayError, match=r"expected 2 MoE layers x top-2 .*got 4 layers"):
        validate_routes(_routes(), routers)
    routes = _routes()[:, :, :2].clone()
    routes[0, 1, 0, 1] = 9
    with pytest.raises(RouteReplayError, match=r"MoE layer 0 \(decoder layer 1\), token 1"):
        validate_routes(routes, routers)


def test_float_routes_are_refused() -> None:
    with pytest.raises(RouteReplayError, match=r"routed_experts.dtype"):
        validate_routes(_routes().float(), ROUTERS)


# ---- layout ------------------------------------------------------------------------


def test_left_padded_rows_become_contiguous_with_their_routes() -> None:
    routes = [
        torch.full((3, 4, 2), 5) + torch.tensor([0, 1]),
        torch.full((5, 4, 2), 3) + torch.tensor([0, 1]),
    ]
    batch = make_batch(
        [[10, 11], [20, 21, 22, 23]], [[12, 13], [24]], num_layers=4, top_k=2, routes=routes
    )
    layout = make_contiguous(batch, pad_token_id=0)
    assert layout.tokens[0].tolist() == [10, 11, 12, 13, 0, 0]
    assert layout.tokens[1].tolist() == [20, 21, 22, 23, 24, 0]
    assert layout.prompt_lens.tolist() == [2, 4]
    assert layout.routes is not None
    assert layout.routes[0, :3, 0].tolist() == [[5, 6]] * 3
    assert layout.routes[0, 3:, 0].tolist() == [[0, 1]] * 3  # uncaptured and filler
    assert layout.padding_mask[0].tolist() == [False] * 3 + [True] * 3
    assert layout.padding_mask[1].tolist() == [False] * 5 + [True]
    back = shift_rows(layout.routes, -layout.shifts, torch.tensor([0, 1]))
    assert torch.equal(
        back[batch.router_padding_mask == 0], batch.routed_experts[batch.router_padding_mask == 0]
    )


def test_holes_in_left_padding_are_refused() -> None:
    batch = make_batch([[10, 11, 12]], [[13]], num_layers=4, top_k=2)
    batch.attention_mask[0, 1] = 0
    with pytest.raises(ValueError, match=r"attention_mask\[0, :3\]"):
        make_contiguous(batch)


def test_each_data_parallel_rank_gets_only_its_rows_and_routes() -> None:
    routes = [torch.full((2, 4, 2), b) + torch.tensor([0, 1]) for b in range(4)]
    batch = make_batch([[1, 2]] * 4, [[3]] * 4, num_layers=4, top_k=2, routes=routes)
    shard = shard_for_data_parallel_rank(batch, rank=1, world_size=2)
    assert shard.batch_size == 2
    assert shard.routed_experts is not None
    assert shard.routed_experts[:, 0, 0, 0].tolist() == [2, 3]
    with pytest.raises(ValueError, match="batch_size"):
        shard_for_data_parallel_rank(batch, rank=0, world_size=3)

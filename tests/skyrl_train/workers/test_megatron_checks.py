"""Refusals that need no model: the megatron_config node, every Megatron setting replay
cannot honour (at worker build), route checks, a ragged dispatch, and the contiguous
re-layout of left-padded rows."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _megatron_batches import make_batch, random_routes

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config import refuse_replay_incompatible
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.config.validate import UNSUPPORTED_MEGATRON_SETTINGS
from skyrl_train.dataset.batch import shard_for_data_parallel_rank
from skyrl_train.errors import ConfigValidationError, RouteReplayError
from skyrl_train.workers.megatron.layout import make_contiguous, shift_rows
from skyrl_train.workers.megatron.model import build_transformer_config, transformer_config_kwargs
from skyrl_train.workers.megatron.replay import DispatchCapture, LocalRouters, validate_routes
from skyrl_train.workers.megatron.worker import MegatronPolicyWorker

KEY = "trainer.policy.megatron_config"
KW = "transformer_config_kwargs"
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


def test_context_parallelism_is_refused_on_any_device_and_tensor_parallelism_built() -> None:
    # CP is refused in build_transformer_config whatever the device and with replay off
    # too (megatron-core's CP attention is Transformer Engine's); TP builds, with
    # sequence parallelism on, as the two-process tests run it.
    for replay in (True, False):
        mc = MegatronConfig(moe_enable_routing_replay=replay, context_parallel_size=2)
        with pytest.raises(
            ConfigValidationError, match=rf"^{KEY}\.context_parallel_size: expected 1 \("
        ):
            build_transformer_config(ARCH, mc)
        tp = MegatronConfig(moe_enable_routing_replay=replay, tensor_model_parallel_size=2)
        assert build_transformer_config(ARCH, tp).sequence_parallel is True
    build_transformer_config(ARCH, MegatronConfig(pipeline_model_parallel_size=2))


def test_a_whole_projection_qk_norm_refuses_tensor_parallelism() -> None:
    # OLMoE's q/k norm spans every head; a TP rank holds only some of them.
    olmoe_like = dataclasses.replace(ARCH, qk_norm="full")
    with pytest.raises(ConfigValidationError, match="q/k RMSNorm over the whole projection") as err:
        build_transformer_config(olmoe_like, MegatronConfig(tensor_model_parallel_size=2))
    assert err.value.path == f"{KEY}.tensor_model_parallel_size"


def test_tensor_parallelism_without_sequence_parallelism_is_refused_naming_the_key() -> None:
    mc = MegatronConfig(
        tensor_model_parallel_size=2, transformer_config_kwargs={"sequence_parallel": False}
    )
    with pytest.raises(ConfigValidationError, match="refuses to train tensor-parallel") as err:
        build_transformer_config(ARCH, mc)
    assert err.value.path == f"{KEY}.{KW}.sequence_parallel"


LAYOUT = "pipeline_model_parallel_layout"

# One case per row of UNSUPPORTED_MEGATRON_SETTINGS: the MegatronConfig (replay on) and
# the key its refusal names.
WORKER_REFUSALS = [
    ({"transformer_config_kwargs": {"moe_expert_capacity_factor": 1.0}}, f"{KW}.moe_expert_capacity_factor"),
    ({"transformer_config_kwargs": {"moe_router_force_load_balancing": True}}, f"{KW}.moe_router_force_load_balancing"),
    ({"transformer_config_kwargs": {"enable_cuda_graph": True}}, f"{KW}.enable_cuda_graph"),
    ({"transformer_config_kwargs": {"external_cuda_graph": True}}, f"{KW}.external_cuda_graph"),
    ({"transformer_config_kwargs": {"cuda_graph_impl": "local"}}, f"{KW}.cuda_graph_impl"),
    ({"transformer_config_kwargs": {"moe_router_fusion": True}}, f"{KW}.moe_router_fusion"),
    ({"transformer_config_kwargs": {"moe_router_load_balancing_type": "sinkhorn"}}, f"{KW}.moe_router_load_balancing_type"),
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
      "transformer_config_kwargs": {"recompute_granularity": "selective"}}, f"{KW}.recompute_granularity"),
    ({"transformer_config_kwargs": {LAYOUT: "Ett|ttL"}}, f"{KW}.{LAYOUT}"),  # VPP=2 at PP=1
    ({"context_parallel_size": 2}, "context_parallel_size"),
    ({"transformer_config_kwargs": {"sequence_parallel": True}}, f"{KW}.sequence_parallel"),
    ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),  # ETP != TP at EP=1
    ({"transformer_config_kwargs": {"moe_token_dispatcher_type": "flex"}}, f"{KW}.moe_token_dispatcher_type"),
    ({"transformer_config_kwargs": {"fp8": "e4m3"}}, f"{KW}.fp8"),
    ({"transformer_config_kwargs": {"fp4": "nvfp4"}}, f"{KW}.fp4"),
    ({"transformer_config_kwargs": {"tp_comm_overlap": True}}, f"{KW}.tp_comm_overlap"),
    ({"transformer_config_kwargs": {"moe_grouped_gemm": True}}, f"{KW}.moe_grouped_gemm"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "key"), WORKER_REFUSALS)
def test_worker_build_refuses_each_setting_replay_cannot_honour(values: dict, key: str) -> None:
    with pytest.raises(ConfigValidationError) as err:
        build_transformer_config(ARCH, MegatronConfig(moe_enable_routing_replay=True, **values))
    assert err.value.path == f"{KEY}.{key}"
    assert err.value.reason.startswith("expected ") and ", got " in err.value.reason


def test_every_unsupported_setting_is_refused_at_worker_build() -> None:
    covered = {key.rsplit(".", 1)[-1] for _values, key in WORKER_REFUSALS}
    assert covered == {rule.field for rule in UNSUPPORTED_MEGATRON_SETTINGS}


def test_the_built_configs_derived_virtual_stages_are_checked_too() -> None:
    # megatron-core turns the layout into an object and sets VPP from it while building;
    # the rule reads both from the built config.
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = TinyMoEConfig(num_layers=10).architecture()
    mc = MegatronConfig(
        pipeline_model_parallel_size=2,
        transformer_config_kwargs={LAYOUT: "Et|t|t|t|t|t|t|t|t|tL"},
    )
    built = TransformerConfig(**transformer_config_kwargs(arch, mc))
    assert built.virtual_pipeline_model_parallel_size == 5
    refuse_replay_incompatible(mc, key_prefix=KEY, resolved=vars(built))  # any VPP >= 2
    # The same derived size with the pipeline taken away: interleaving without one.
    resolved = {**vars(built), "pipeline_model_parallel_size": 1, LAYOUT: None}
    with pytest.raises(ConfigValidationError, match="5 at pipeline size 1") as err:
        refuse_replay_incompatible(mc, key_prefix=KEY, resolved=resolved)
    assert err.value.path == f"{KEY}.virtual_pipeline_model_parallel_size"


def test_a_capacity_factor_is_refused_before_any_model_is_built() -> None:
    # Megatron would drop replayed routes over capacity; DispatchCapture's reshape of
    # the ragged dispatch is never reached because no model is built.
    worker = MegatronPolicyWorker(
        ARCH,
        MegatronConfig(transformer_config_kwargs={"moe_expert_capacity_factor": 1.0}),
    )
    with pytest.raises(ConfigValidationError, match=rf"^{KEY}\.{KW}\.moe_expert_capacity_factor"):
        worker.setup()
    assert worker.chunks == [] and worker.routers is None


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


def test_a_layer_of_zeros_is_judged_by_its_ids_alone() -> None:
    # An uncaptured layer is refused where routes are made (RouteCapture.end() raises
    # when a layer's hook did not fire); here zeros are only what the ids say.
    routes = _routes()
    routes[0, :, 3] = torch.tensor([0, 1])  # padding rows: arange(K)
    routes[0, :3, 3] = 0  # every real token of trajectory 0, layer 3
    with pytest.raises(
        RouteReplayError,
        match=r"'t0' \(batch row 0\), layer 3, token 0: expected 2 distinct experts, got \[0, 0\]",
    ):
        validate_routes(routes, ROUTERS, trajectory_ids=["t0", "t1"])
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
    ones[1, :, 0] = 0  # top-1: every token of trajectory 1 really went to expert 0
    validate_routes(ones, single)
    ones[1, 2, 0] = 8  # the id checks still hold in that layer
    with pytest.raises(RouteReplayError, match=r"batch row 1, layer 0, token 2: expected expert"):
        validate_routes(ones, single)


class _FixedRouter(torch.nn.Module):
    """Returns ``(probs, routing_map)`` as Megatron's router does, with a given map."""

    def __init__(self, routing_map: torch.Tensor) -> None:
        super().__init__()
        self.routing_map = routing_map

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routing_map.float(), self.routing_map


def test_a_ragged_dispatch_is_named_not_reshaped() -> None:
    # 3 positions x 2 rows = 6 tokens, top-2, as a capacity factor would leave them.
    routing_map = torch.zeros(6, 8, dtype=torch.bool)
    routing_map[:, 4:6] = True
    router = _FixedRouter(routing_map)
    routers = LocalRouters(
        modules=(router,),
        layers=(1,),
        moe_layers=(1,),
        num_experts=8,
        top_k=2,
        replay_enabled=False,
        chunks=(0,),
    )
    capture = DispatchCapture(routers)
    capture.begin(0, batch=2, seq=3)
    router(torch.zeros(1))
    assert capture.got[0][0].tolist() == [[[4, 5]] * 3] * 2
    capture.begin(1, batch=2, seq=3)
    routing_map[3, 4] = False  # token 3 dropped by one expert: 11 routes
    with pytest.raises(
        RouteReplayError,
        match=r"MoE layer 0 \(decoder layer 1\), microbatch 1: expected 6 tokens x top-2 = 12 "
        r"routes, got 11 \(1 of the 6 tokens",
    ):
        router(torch.zeros(1))
    routing_map[0, 1] = True  # 12 routes again, which a reshape would misgroup
    with pytest.raises(RouteReplayError, match=r"= 12 routes, got 12 \(2 of the 6 tokens"):
        router(torch.zeros(1))
    assert list(capture.got) == [0]  # the ragged microbatch left nothing behind
    capture.close()


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


def test_the_worker_replays_by_its_routing_replay_argument_alone() -> None:
    # A Python-built node may still hold the deprecated alias: one that disagrees with
    # the argument is refused, not silently overridden, before anything is built.
    with pytest.raises(ConfigValidationError) as err:
        MegatronPolicyWorker(
            ARCH, MegatronConfig(moe_enable_routing_replay=True), routing_replay=False
        )
    assert err.value.path == f"{KEY}.moe_enable_routing_replay"
    off = MegatronPolicyWorker(ARCH, MegatronConfig(), routing_replay=False).setup()
    assert off.routers is not None and not off.routers.replay_enabled
    L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok
    routes = [random_routes(1, 3, L, E, K, seed=0)[0, :2]]
    batch = make_batch([[72, 105]], [[33]], num_layers=L, top_k=K, routes=routes)
    # Both backends refuse a replay naming the one key the run sets.
    with pytest.raises(RouteReplayError, match=r"^trainer\.policy\.routing_replay\.enabled: "):
        off.forward(batch, replay_routes=True)
    assert off.forward(batch, capture_routes=True).routes is not None  # native routing runs

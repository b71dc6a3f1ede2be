"""validate_cfg: each refusal names the key to change and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_train.config import (
    MegatronConfig,
    load_config,
    refuse_replay_incompatible,
    validate_cfg,
)
from skyrl_train.config.validate import UNSUPPORTED_MEGATRON_SETTINGS
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, begin_save, commit_save
from skyrl_train.utils.durable import write_file

POLICY = "trainer.policy.megatron_config"
KW = "transformer_config_kwargs"


def _refusal(overrides: list[str]) -> ConfigValidationError:
    cfg = load_config(overrides)
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert str(info.value).startswith(info.value.path + ": ")
    return info.value


def test_default_config_is_valid() -> None:
    validate_cfg(load_config())


def test_r3_off_everywhere_is_valid_even_with_vpp_and_fusion() -> None:
    validate_cfg(
        load_config(
            [
                "generator.inference_engine.enable_return_routed_experts=false",
                f"{POLICY}.moe_enable_routing_replay=false",
                f"+{POLICY}.{KW}.moe_router_fusion=true",
                f"+{POLICY}.{KW}.moe_router_load_balancing_type=sinkhorn",
            ]
        )
    )


# ------------------------------------------------------------------ R3 refusals


PP2 = [f"{POLICY}.pipeline_model_parallel_size=2", "trainer.placement.num_trainers=2"]
PP4 = [f"{POLICY}.pipeline_model_parallel_size=4", "trainer.placement.num_trainers=4"]


@pytest.mark.parametrize(
    ("pp", "vpp", "layers"), [(2, 2, 4), (2, 3, 6), (2, 4, 8), (2, 5, 10), (4, 2, 8)]
)
def test_replay_accepts_every_interleaved_schedule_the_layers_divide(
    pp: int, vpp: int, layers: int
) -> None:
    # Replay is keyed by (chunk, microbatch), whatever the sizes: the layout grid runs
    # PP=4 x VPP=2 on 8 ranks beside PP=2 x VPP=2 to 4 (docs/parallel-layouts.md).
    validate_cfg(
        load_config(
            [
                f"{POLICY}.pipeline_model_parallel_size={pp}",
                f"trainer.placement.num_trainers={pp}",
                f"model.builtin.num_layers={layers}",
                f"{POLICY}.virtual_pipeline_model_parallel_size={vpp}",
            ]
        )
    )
    validate_cfg(
        load_config(
            [
                *PP2,
                f"{POLICY}.virtual_pipeline_model_parallel_size=2",
                f"+{POLICY}.{KW}.recompute_granularity=full",
                f"+{POLICY}.{KW}.recompute_method=uniform",
                f"+{POLICY}.{KW}.recompute_num_layers=1",
            ]
        )
    )


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        # VPP=1 is no interleaving at all, but Megatron would still take the
        # interleaved path, which no test runs.
        ([*PP2, f"{POLICY}.virtual_pipeline_model_parallel_size=1"], "virtual_pipeline_model_parallel_size", "no test runs"),
        ([*PP2, f"{POLICY}.virtual_pipeline_model_parallel_size=2", f"+{POLICY}.{KW}.recompute_granularity=selective"], f"{KW}.recompute_granularity", "proven"),
    ],
)  # fmt: skip
def test_replay_refuses_interleaving_no_test_proves(
    overrides: list[str], key: str, fragment: str
) -> None:
    err = _refusal(overrides)
    assert err.path == f"{POLICY}.{key}"
    assert "routing replay" in err.reason and fragment in err.reason


MICRO4 = ["trainer.micro_train_batch_size_per_gpu=4", "trainer.micro_forward_batch_size_per_gpu=4"]
WIDE = "model=tiny_layouts"


@pytest.mark.parametrize(
    "overrides",
    [
        [*PP4, *MICRO4],
        [*PP4, *MICRO4, f"{POLICY}.moe_enable_routing_replay=false"],
        [*PP2, *MICRO4, "trainer.placement.num_trainers=4", f"{POLICY}.expert_model_parallel_size=2"],
        [*PP2, *MICRO4, "trainer.placement.num_trainers=4", f"{POLICY}.virtual_pipeline_model_parallel_size=2", f"{POLICY}.expert_model_parallel_size=2"],
        # PP x DP: two pipelines of two stages.
        [*PP2, *MICRO4, "trainer.placement.num_trainers=4"],
        [WIDE, *PP4, *MICRO4, "trainer.placement.num_trainers=8", f"{POLICY}.virtual_pipeline_model_parallel_size=2"],
        [WIDE, *PP2, *MICRO4, "trainer.placement.num_trainers=8", f"{POLICY}.tensor_model_parallel_size=2", f"{POLICY}.expert_model_parallel_size=2"],
    ],
)  # fmt: skip
def test_pipeline_layouts_are_accepted_by_rule(overrides: list[str]) -> None:
    # PP=4, PP x EP, PP x VPP x EP, PP x DP, PP x TP x EP: the layout grid's rows.
    validate_cfg(load_config(overrides))
    # 10 stages at PP=2 imply VPP=5, which virtual_pipeline_model_parallel_size never shows.
    layout = f"+{POLICY}.{KW}.pipeline_model_parallel_layout='Et|t|t|t|t|t|t|t|t|tL'"
    validate_cfg(load_config([*PP2, "model.builtin.num_layers=10", layout]))


def test_same_vpp_without_replay_is_valid() -> None:
    validate_cfg(
        load_config(
            [
                f"{POLICY}.pipeline_model_parallel_size=2",
                "trainer.placement.num_trainers=2",
                f"{POLICY}.virtual_pipeline_model_parallel_size=2",
                f"{POLICY}.moe_enable_routing_replay=false",
            ]
        )
    )


def test_replay_refuses_vpp_hidden_in_transformer_kwargs() -> None:
    err = _refusal([f"+{POLICY}.{KW}.virtual_pipeline_model_parallel_size=1"])
    assert err.path == f"{POLICY}.{KW}.virtual_pipeline_model_parallel_size"
    assert "routing replay" in err.reason
    # A size replay accepts is still the node's to set, not the passthrough's.
    err = _refusal([*PP2, f"+{POLICY}.{KW}.virtual_pipeline_model_parallel_size=2"])
    assert err.path == f"{POLICY}.{KW}.virtual_pipeline_model_parallel_size"
    assert "not inside transformer_config_kwargs" in err.reason


def test_replay_refuses_router_fusion() -> None:
    err = _refusal([f"+{POLICY}.{KW}.moe_router_fusion=true"])
    assert err.path == f"{POLICY}.{KW}.moe_router_fusion"
    assert "bypasses RouterReplay" in err.reason


@pytest.mark.parametrize("value", ["sinkhorn", "[aux_loss,sinkhorn]"])
def test_replay_refuses_sinkhorn(value: str) -> None:
    err = _refusal([f"+{POLICY}.{KW}.moe_router_load_balancing_type={value}"])
    assert err.path == f"{POLICY}.{KW}.moe_router_load_balancing_type"
    assert "sinkhorn" in err.reason


def test_replay_refuses_missing_routes() -> None:
    err = _refusal(["generator.inference_engine.enable_return_routed_experts=false"])
    assert err.path == "trainer.policy.routing_replay.enabled"
    assert "generator.inference_engine.enable_return_routed_experts" in err.reason
    assert "routing_replay.source=old_policy" in err.reason  # names the way out


def test_r2_needs_no_routes_from_the_engine() -> None:
    validate_cfg(
        load_config(
            [
                "generator.inference_engine.enable_return_routed_experts=false",
                f"{POLICY}.routing_replay_source=old_policy",
            ]
        )
    )


def test_the_reference_has_no_megatron_settings_of_its_own() -> None:
    # It swaps its weights into the policy's model, so a second layout would be a lie.
    with pytest.raises(ConfigValidationError) as info:
        load_config(["trainer.ref.megatron_config.context_parallel_size=1"])
    assert info.value.path.startswith("trainer.ref.megatron_config")
    validate_cfg(load_config(["trainer.algorithm.use_kl_loss=true", "trainer.ref.log_kl=false"]))


def test_refuse_replay_incompatible_for_resolved_worker_settings() -> None:
    mc = MegatronConfig()
    refuse_replay_incompatible(
        mc,
        key_prefix=POLICY,
        resolved={"moe_enable_routing_replay": True, "virtual_pipeline_model_parallel_size": None,
                  "moe_router_fusion": False, "moe_router_load_balancing_type": "aux_loss"},
    )  # fmt: skip
    with pytest.raises(ConfigValidationError) as info:
        refuse_replay_incompatible(
            mc,
            key_prefix=POLICY,
            resolved={"moe_enable_routing_replay": True, "virtual_pipeline_model_parallel_size": 1},
        )
    assert info.value.path == f"{POLICY}.virtual_pipeline_model_parallel_size"


LAYOUT = f"+{POLICY}.{KW}.pipeline_model_parallel_layout"

# One case per row of UNSUPPORTED_MEGATRON_SETTINGS (the test below checks that), each
# with a fragment of the reason the message gives.
REPLAY_REFUSALS = [
    ([f"+{POLICY}.{KW}.moe_expert_capacity_factor=1.0"], f"{KW}.moe_expert_capacity_factor", "drops the tokens over an expert's capacity"),
    ([f"+{POLICY}.{KW}.moe_router_force_load_balancing=true"], f"{KW}.moe_router_force_load_balancing", "random logits"),
    ([f"+{POLICY}.{KW}.enable_cuda_graph=true"], f"{KW}.enable_cuda_graph", "captured CUDA graph"),
    ([f"+{POLICY}.{KW}.external_cuda_graph=true"], f"{KW}.external_cuda_graph", "captured CUDA graph"),
    ([f"+{POLICY}.{KW}.cuda_graph_impl=local"], f"{KW}.cuda_graph_impl", "got 'local'"),
    ([f"+{POLICY}.{KW}.moe_router_fusion=true"], f"{KW}.moe_router_fusion", "bypasses RouterReplay"),
    ([f"+{POLICY}.{KW}.moe_router_load_balancing_type=sinkhorn"], f"{KW}.moe_router_load_balancing_type", "sinkhorn"),
    ([*PP2, f"{POLICY}.virtual_pipeline_model_parallel_size=1"], "virtual_pipeline_model_parallel_size", "got 1 at pipeline size 2"),
    ([*PP2, f"{POLICY}.virtual_pipeline_model_parallel_size=2", f"+{POLICY}.{KW}.recompute_granularity=selective"], f"{KW}.recompute_granularity", "got 'selective'"),
    ([*PP2, f"{LAYOUT}='Et|t|tL'"], f"{KW}.pipeline_model_parallel_layout", "cannot split over pipeline size 2"),
    ([*PP2, f"{LAYOUT}='Et|t|t|tL'", f"+{POLICY}.{KW}.recompute_granularity=selective"], f"{KW}.recompute_granularity", "got 'selective'"),
    (["trainer.placement.num_trainers=2", f"{POLICY}.context_parallel_size=2"], "context_parallel_size", "only supported by TEDotProductAttention"),
    ([f"+{POLICY}.{KW}.sequence_parallel=true"], f"{KW}.sequence_parallel", "got true"),
    (["trainer.placement.num_trainers=2", f"{POLICY}.expert_tensor_parallel_size=2"], "expert_tensor_parallel_size", "marks expert weights as dense"),
    ([f"+{POLICY}.{KW}.moe_token_dispatcher_type=flex"], f"{KW}.moe_token_dispatcher_type", "DeepEP or HybridEP"),
    ([f"+{POLICY}.{KW}.fp8=e4m3"], f"{KW}.fp8", "local layer spec"),
    ([f"+{POLICY}.{KW}.fp4=nvfp4"], f"{KW}.fp4", "local layer spec"),
    ([f"+{POLICY}.{KW}.tp_comm_overlap=true"], f"{KW}.tp_comm_overlap", "userbuffers"),
    ([f"+{POLICY}.{KW}.moe_grouped_gemm=true"], f"{KW}.moe_grouped_gemm", "grouped_gemm package"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "key", "fragment"), REPLAY_REFUSALS)
def test_replay_refuses_each_megatron_setting_it_cannot_honour(
    overrides: list[str], key: str, fragment: str
) -> None:
    err = _refusal(overrides)
    assert err.path == f"{POLICY}.{key}"
    assert err.reason.startswith("expected ") and fragment in err.reason
    assert ", got " in err.reason


def test_every_unsupported_setting_has_a_refusal_case() -> None:
    covered = {key.rsplit(".", 1)[-1] for _overrides, key, _fragment in REPLAY_REFUSALS}
    assert covered == {rule.field for rule in UNSUPPORTED_MEGATRON_SETTINGS}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trainer.placement.num_trainers=2", f"{POLICY}.context_parallel_size=2"], "context_parallel_size"),
        (["trainer.placement.num_trainers=2", f"{POLICY}.tensor_model_parallel_size=2", f"+{POLICY}.{KW}.sequence_parallel=false"], f"{KW}.sequence_parallel"),
        ([f"+{POLICY}.{KW}.sequence_parallel=true"], f"{KW}.sequence_parallel"),
        ([f"+{POLICY}.{KW}.moe_token_dispatcher_type=flex"], f"{KW}.moe_token_dispatcher_type"),
        ([f"+{POLICY}.{KW}.fp8=hybrid"], f"{KW}.fp8"),
        # ETP=1 beside TP=2 with no expert parallelism: megatron-core's dense marking.
        (["trainer.placement.num_trainers=2", f"{POLICY}.tensor_model_parallel_size=2", f"{POLICY}.expert_tensor_parallel_size=1"], "expert_tensor_parallel_size"),
    ],
)  # fmt: skip
def test_layouts_refused_without_replay_too(overrides: list[str], key: str) -> None:
    # CP's Transformer Engine attention and megatron-core's TP-needs-SP rule hold with
    # or without replay; only the replay reasons are conditional.
    err = _refusal([*overrides, f"{POLICY}.moe_enable_routing_replay=false"])
    assert err.path == f"{POLICY}.{key}"
    assert "with routing replay" not in err.reason


def test_tensor_parallelism_with_sequence_parallelism_launches() -> None:
    # docs/parallel-layouts.md: TP=2 (SP on by default) is accepted at launch, alone and
    # x EP=2 at expert tensor size 1, with either dispatcher the worker tests prove.
    tp2 = ["trainer.placement.num_trainers=2", f"{POLICY}.tensor_model_parallel_size=2"]
    validate_cfg(load_config(tp2))
    ep2 = [f"{POLICY}.expert_model_parallel_size=2", f"{POLICY}.expert_tensor_parallel_size=1"]
    validate_cfg(load_config([*tp2, *ep2]))
    for dispatcher in ("allgather", "alltoall"):
        validate_cfg(
            load_config([*tp2, *ep2, f"+{POLICY}.{KW}.moe_token_dispatcher_type={dispatcher}"])
        )


def test_a_vocabulary_tensor_parallelism_does_not_divide_launches_padded() -> None:
    # 381 ids at TP=2: the embedding and output layer are padded (Megatron's rule), as
    # tests/skyrl_train/workers/test_megatron_tensor_parallel.py trains them.
    tp2 = ["trainer.placement.num_trainers=2", f"{POLICY}.tensor_model_parallel_size=2"]
    validate_cfg(load_config([*tp2, "model.builtin.vocab_size=381"]))
    padded = f"{POLICY}.make_vocab_size_divisible_by=128"
    validate_cfg(load_config([*tp2, "model.builtin.vocab_size=381", padded]))
    err = _refusal([f"{POLICY}.make_vocab_size_divisible_by=0"])
    assert err.path == f"{POLICY}.make_vocab_size_divisible_by"


TP2 = ["trainer.placement.num_trainers=4", f"{POLICY}.tensor_model_parallel_size=2"]
SLIME = [
    WIDE,
    "trainer.placement.num_trainers=8",
    f"{POLICY}.tensor_model_parallel_size=4",
    f"{POLICY}.expert_model_parallel_size=8",
    f"{POLICY}.expert_tensor_parallel_size=1",
]
"""slime's Qwen3-30B-A3B layout on the test model: attention TP=4 x DP=2, experts EP=8."""


@pytest.mark.parametrize(
    "overrides",
    [
        [*TP2, f"{POLICY}.pipeline_model_parallel_size=2"],
        [*TP2, f"{POLICY}.expert_model_parallel_size=2"],
        [*TP2, f"{POLICY}.expert_model_parallel_size=2", f"{POLICY}.expert_tensor_parallel_size=1"],
        [*TP2, f"{POLICY}.expert_model_parallel_size=4", f"{POLICY}.expert_tensor_parallel_size=1"],
        TP2,
        SLIME,
        [*SLIME, f"+{POLICY}.{KW}.moe_token_dispatcher_type=alltoall"],
        [WIDE, "trainer.placement.num_trainers=4", f"{POLICY}.tensor_model_parallel_size=4"],
    ],
)  # fmt: skip
def test_tensor_parallel_layouts_are_accepted_by_rule(overrides: list[str]) -> None:
    # TP x PP, TP x EP x ETP=TP, MoE parallel folding at EP=2 and 4, TP x DP, TP=4.
    validate_cfg(load_config([*overrides, "trainer.micro_train_batch_size_per_gpu=4"]))


def test_an_expert_tensor_size_between_one_and_tp_is_refused_by_key() -> None:
    layout = [*SLIME[:3], f"{POLICY}.expert_model_parallel_size=2"]
    err = _refusal([*layout, f"{POLICY}.expert_tensor_parallel_size=2"])
    assert err.path == f"{POLICY}.expert_tensor_parallel_size"
    assert "1 or tensor_model_parallel_size (4)" in err.reason and err.reason.endswith("got 2")


def test_without_replay_the_replay_only_settings_are_valid() -> None:
    validate_cfg(
        load_config(
            [
                f"{POLICY}.moe_enable_routing_replay=false",
                f"+{POLICY}.{KW}.moe_expert_capacity_factor=1.0",
                f"+{POLICY}.{KW}.moe_router_force_load_balancing=true",
                f"+{POLICY}.{KW}.cuda_graph_impl=local",
            ]
        )
    )


def test_replay_accepts_layouts_without_virtual_stages_or_with_proven_ones() -> None:
    validate_cfg(load_config([*PP2, f"{LAYOUT}='Ett|ttL'"]))  # one stage per rank
    validate_cfg(load_config([*PP2, f"{LAYOUT}='Et|t|t|tL'"]))  # VPP=2 at PP=2, proven
    validate_cfg(
        load_config(
            [
                *PP2,
                f"{LAYOUT}=[[embedding,decoder],[decoder],[decoder],[decoder,loss]]",
                f"+{POLICY}.{KW}.recompute_granularity=full",
            ]
        )
    )


# ---------------------------------------------------------- transformer kwargs


def test_transformer_kwargs_must_be_transformer_config_fields() -> None:
    validate_cfg(load_config([f"+{POLICY}.{KW}.moe_aux_loss_coeff=0.01"]))
    err = _refusal([f"+{POLICY}.{KW}.not_a_megatron_field=1"])
    assert err.path == f"{POLICY}.{KW}.not_a_megatron_field"
    assert "TransformerConfig" in err.reason


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("tensor_model_parallel_size", f"{POLICY}.tensor_model_parallel_size"),
        ("num_layers", "model.builtin.num_layers"),
        ("num_moe_experts", "model.builtin.num_experts"),
    ],
)
def test_transformer_kwargs_cannot_override_owned_keys(name: str, where: str) -> None:
    # 1, not 2: tensor parallelism > 1 is refused as such before the owner is named.
    err = _refusal([f"+{POLICY}.{KW}.{name}=1"])
    assert err.path == f"{POLICY}.{KW}.{name}"
    assert where in err.reason


# ------------------------------------------------- ordinary consistency checks


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["trainer.policy_mini_batch_size=3"], "trainer.policy_mini_batch_size", "divisor of trainer.train_batch_size"),
        (["trainer.micro_train_batch_size_per_gpu=5"], "trainer.micro_train_batch_size_per_gpu", "per-rank mini-batch (8"),
        (["trainer.placement.num_trainers=2", "trainer.policy_mini_batch_size=4", "trainer.micro_train_batch_size_per_gpu=3"], "trainer.micro_train_batch_size_per_gpu", "(16 trajectories)"),
        (["trainer.placement.num_trainers=3", "trainer.policy_mini_batch_size=2", "trainer.train_batch_size=2"], "trainer.policy_mini_batch_size", "data-parallel size (3)"),
        ([f"{POLICY}.tensor_model_parallel_size=2"], "trainer.placement.num_trainers", "= 2), got 1"),
        ([f"{POLICY}.expert_model_parallel_size=2"], f"{POLICY}.expert_model_parallel_size", "divide trainer.placement.num_trainers"),
        (["trainer.placement.num_trainers=3", f"{POLICY}.expert_model_parallel_size=3", "trainer.train_batch_size=3", "trainer.policy_mini_batch_size=3", "trainer.micro_train_batch_size_per_gpu=1"], f"{POLICY}.expert_model_parallel_size", "expert count (8)"),
        (["trainer.placement.num_trainers=4", f"{POLICY}.tensor_model_parallel_size=4"], f"{POLICY}.tensor_model_parallel_size", "KV head count (2)"),
        (["trainer.placement.num_trainers=3", f"{POLICY}.pipeline_model_parallel_size=3"], f"{POLICY}.pipeline_model_parallel_size", "layer count (4)"),
        (["trainer.placement.num_trainers=0"], "trainer.placement.num_trainers", ">= 1"),
        ([f"{POLICY}.moe_enable_routing_replay=false", f"{POLICY}.virtual_pipeline_model_parallel_size=2"], f"{POLICY}.virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size >= 2"),
        (["generator.n_samples_per_prompt=1"], "generator.n_samples_per_prompt", "no baseline"),
        (["generator.n_samples_per_prompt=1", "trainer.algorithm.advantage_estimator=rloo"], "generator.n_samples_per_prompt", "advantage_estimator 'rloo'"),
        (["trainer.algorithm.policy_loss_type=gspo", "trainer.algorithm.clip_ratio_c=3.0"], "trainer.algorithm.clip_ratio_c", "policy_loss_type 'gspo'"),
        (["generator.max_response_tokens=4096"], "generator.max_response_tokens", "max_position_embeddings (2048)"),
        (["generator.max_response_tokens=3", "generator.max_tokens_per_turn=4"], "generator.max_response_tokens", "expected >= generator.max_tokens_per_turn (4), got 3"),
        (["generator.sampling_params.top_p=0"], "generator.sampling_params.top_p", "expected a number in (0, 1], got 0.0"),
        (["generator.eval_sampling_params.top_k=0"], "generator.eval_sampling_params.top_k", "expected -1 (no cut) or an int >= 1, got 0"),
        (["generator.sampling_params.temperature=-1"], "generator.sampling_params.temperature", "0 (greedy) or a number in [1e-06, 100]"),
        (["generator.sampling_params.temperature=1e-39"], "generator.sampling_params.temperature", "got 1e-39"),
        (["generator.eval_sampling_params.temperature=1e4"], "generator.eval_sampling_params.temperature", "0 (greedy) or a number in [1e-06, 100]"),
        (["generator.inference_engine.port=70000"], "generator.inference_engine.port", ">= 0 and <= 65535, got 70000"),
        (["environment.env_class="], "environment.env_class", "environment name"),
        (["environment.env_class=no_such_env"], "environment.env_class", "registered environment"),
        (["trainer.policy.optimizer_config.lr=0"], "trainer.policy.optimizer_config.lr", "> 0"),
        (["trainer.policy.optimizer_config.adam_betas=[0.9,1.0]"], "trainer.policy.optimizer_config.adam_betas[1]", ">= 0.0 and < 1.0, got 1.0"),
        (["trainer.algorithm.eps_clip_high=1.5"], "trainer.algorithm.eps_clip_high", "< 1"),
        (["trainer.algorithm.clip_ratio_c=1.0"], "trainer.algorithm.clip_ratio_c", "> 1"),
        (["trainer.algorithm.tis_imp_ratio_cap=0"], "trainer.algorithm.tis_imp_ratio_cap", "> 0"),
        (["trainer.num_steps=0"], "trainer.num_steps", ">= 1"),
        (["trainer.eval_interval=-1"], "trainer.eval_interval", ">= 0"),
        (["model.builtin.rope_theta=0"], "model.builtin.rope_theta", "expected a finite number > 0.0, got 0.0"),
        (["model.builtin.rms_norm_eps=inf"], "model.builtin.rms_norm_eps", "got inf"),
        (["model.builtin.initializer_range=-0.1"], "model.builtin.initializer_range", "> 0.0, got -0.1"),
        (["model.path=/nonexistent/ckpt"], "model.path", "existing checkpoint folder"),
        (["trainer.resume_from=/nonexistent/ckpt"], "trainer.resume_from", "existing checkpoint folder"),
        (["ray.num_cpus=0"], "ray.num_cpus", ">= 1"),
    ],
)  # fmt: skip
def test_consistency_refusals(overrides: list[str], key: str, fragment: str) -> None:
    err = _refusal(overrides)
    assert err.path == key
    assert fragment in err.reason


def test_parallel_layouts_that_fit_are_valid(tmp_path: Path) -> None:
    validate_cfg(
        load_config(
            [
                "trainer.placement.num_trainers=2",
                f"{POLICY}.expert_model_parallel_size=2",  # EP=2 on 2 ranks, as measured
                "trainer.micro_train_batch_size_per_gpu=4",
            ]
        )
    )
    # PP=2 x VPP=4 on 8 layers fits 2.
    validate_cfg(
        load_config(
            [
                *PP2,
                "model.builtin.num_layers=8",
                f"{POLICY}.virtual_pipeline_model_parallel_size=4",
                "trainer.micro_train_batch_size_per_gpu=16",
            ]
        )
    )


def test_data_parallel_split_counts_trajectories_not_prompts() -> None:
    # One prompt per optimizer step, 4 samples each: 4 trajectories split over 2 ranks.
    validate_cfg(
        load_config(
            [
                "trainer.placement.num_trainers=2",
                "trainer.train_batch_size=2",
                "trainer.policy_mini_batch_size=1",
                "generator.n_samples_per_prompt=4",
                "trainer.micro_train_batch_size_per_gpu=2",
            ]
        )
    )


def test_env_settings_the_environment_does_not_read_are_refused_before_launch() -> None:
    # repeat_letter's turns are its letters; it reads no max_turns.
    err = _refusal(
        ["environment.env_class=repeat_letter", "+environment.skyrl_gym.repeat_letter.max_turns=3"]
    )
    assert err.path == "environment.skyrl_gym.repeat_letter"
    assert "max_turns" in err.reason and "format_credit" in err.reason
    ok = load_config(
        [
            "environment.env_class=repeat_letter",
            "+environment.skyrl_gym.repeat_letter.format_credit=0.5",
        ]
    )
    validate_cfg(ok)
    validate_cfg(
        load_config(
            [
                "environment.env_class=guess_number",
                "+environment.skyrl_gym.guess_number.max_turns=3",
            ]
        )
    )
    # The key SkyRL's configs don't have is refused with where it went.
    with pytest.raises(ConfigValidationError) as info:
        load_config(["+environment.kwargs.format_credit=0.5"])
    assert info.value.path.startswith("environment.kwargs")
    # The guess_number preset of docs/configuration.md (the settings that took it furthest).
    preset = load_config(["environment=guess_number"])
    validate_cfg(preset)
    assert preset.environment.env_class == "guess_number"
    assert (preset.trainer.num_steps, preset.trainer.policy_mini_batch_size) == (60, 8)
    assert preset.trainer.micro_train_batch_size_per_gpu == 64
    assert preset.trainer.algorithm.norm_adv_by_std_in_grpo is False
    assert preset.trainer.algorithm.entropy_loss_coef == 0.01
    assert preset.trainer.algorithm.advantage_estimator == "grpo"
    assert preset.trainer.policy.optimizer_config.lr == 0.001


def test_algorithm_choices() -> None:
    # REINFORCE++ has no group baseline, so one sample a prompt is fine.
    validate_cfg(
        load_config(
            [
                "trainer.algorithm.advantage_estimator=reinforce++",
                "generator.n_samples_per_prompt=1",
                "trainer.micro_train_batch_size_per_gpu=4",
            ]
        )
    )
    validate_cfg(
        load_config(
            [
                "trainer.algorithm.policy_loss_type=gspo",
                "trainer.algorithm.eps_clip_low=3e-4",
                "trainer.algorithm.eps_clip_high=4e-4",
            ]
        )
    )


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("policy_loss_type", "dapo", "['regular', 'gspo']"),
        ("advantage_estimator", "gae", "['grpo', 'rloo', 'reinforce++', 'turn_grpo']"),
    ],
)
def test_unknown_algorithm_names_are_refused_naming_the_key(
    name: str, value: str, allowed: str
) -> None:
    key = f"trainer.algorithm.{name}"
    err = _refusal([f"{key}={value}"])
    assert str(err) == f"{key}: expected one of {allowed}, got '{value}'"
    # A config built in Python is refused the same way: the rule sits on the field.
    cfg = load_config()
    setattr(cfg.trainer.algorithm, name, value)
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert str(info.value) == f"{key}: expected one of {allowed}, got '{value}'"


@pytest.mark.parametrize(
    ("override", "key", "reason"),
    [
        (
            "dynamic_sampling.max_sample_batches=0",
            "max_sample_batches",
            "expected an int >= 1, got 0",
        ),
        ("dynamic_sampling.min_replace_ratio=1.5", "min_replace_ratio", "got 1.5"),
        ("entropy_loss_coef=-0.1", "entropy_loss_coef", "-0.1"),
    ],
)
def test_regularizers_and_dynamic_sampling_are_range_checked(
    override: str, key: str, reason: str
) -> None:
    err = _refusal([f"trainer.algorithm.{override}"])
    assert err.path.endswith(key) and reason in err.reason


def test_dynamic_sampling_type_is_one_of_its_names() -> None:
    first = _refusal(["trainer.algorithm.dynamic_sampling.type=dapo"])
    assert first.path == "trainer.algorithm.dynamic_sampling.type"
    assert "'filter'" in str(first) and "'dapo'" in str(first)
    err = _refusal(
        ["trainer.algorithm.dynamic_sampling.type=filter", "generator.n_samples_per_prompt=1",
         "trainer.algorithm.advantage_estimator=reinforce++"]
    )  # fmt: skip
    assert err.path == "trainer.algorithm.dynamic_sampling.type"
    assert "n_samples_per_prompt 1" in err.reason


@pytest.mark.parametrize("estimator", ["turn_grpo", "reinforce++"])
@pytest.mark.parametrize("name", ["skip_flat_steps", "zero_variance_filter"])
def test_flat_group_options_are_refused_where_no_group_is_flat(estimator: str, name: str) -> None:
    # Both were accepted and ignored under the default turn_grpo (issue 49, item 6).
    err = _refusal(
        [f"trainer.algorithm.advantage_estimator={estimator}", f"trainer.algorithm.{name}=true"]
    )
    assert err.path == f"trainer.algorithm.{name}" and err.got == "true"
    assert f"advantage_estimator {estimator!r}" in err.reason and "grpo or rloo" in err.reason


def test_flat_group_options_default_to_what_each_estimator_does() -> None:
    # Null: the estimator decides; false is honest everywhere, true where groups go flat.
    assert load_config().trainer.algorithm.skip_flat_steps is None
    for estimator in ("grpo", "rloo", "turn_grpo", "reinforce++"):
        for extra in ([], ["trainer.algorithm.skip_flat_steps=false"]):
            validate_cfg(
                load_config([f"trainer.algorithm.advantage_estimator={estimator}", *extra])
            )
    for estimator in ("grpo", "rloo"):
        validate_cfg(
            load_config(
                [f"trainer.algorithm.advantage_estimator={estimator}",
                 "trainer.algorithm.skip_flat_steps=true",
                 "trainer.algorithm.zero_variance_filter=true"]
            )
        )  # fmt: skip
    validate_cfg(load_config(["environment=guess_number"]))  # the grpo preset


@pytest.mark.parametrize(
    ("override", "missing"),
    [
        ("use_entropy_loss=false", "trainer.algorithm.use_entropy_loss false"),
        ("entropy_loss_coef=0", "trainer.algorithm.entropy_loss_coef 0"),
    ],
)
@pytest.mark.parametrize("name", ["entropy_target", "entropy_ceiling"])
def test_entropy_target_or_ceiling_without_a_bonus_is_refused(
    name: str, override: str, missing: str
) -> None:
    err = _refusal([f"trainer.algorithm.{name}=0.3", f"trainer.algorithm.{override}"])
    assert err.path == f"trainer.algorithm.{name}" and err.got == "0.3"
    assert err.expected is not None and err.expected.startswith(f"null with {missing}")
    validate_cfg(load_config([f"trainer.algorithm.{name}=0.3"]))  # the default bonus


def test_a_bonus_schedule_without_a_bonus_is_refused() -> None:
    err = _refusal(
        ["trainer.algorithm.entropy_loss_coef_end=0.05", "trainer.algorithm.use_entropy_loss=false"]
    )
    assert err.path == "trainer.algorithm.entropy_loss_coef_end" and err.got == "0.05"
    assert err.expected is not None
    assert err.expected.startswith("null or 0 with trainer.algorithm.use_entropy_loss false")
    # The default's end of 0 agrees with no bonus: turning the bonus off is one key.
    validate_cfg(load_config(["trainer.algorithm.use_entropy_loss=false"]))
    # A bonus that starts at 0 and rises is a schedule too.
    validate_cfg(
        load_config(
            ["trainer.algorithm.entropy_loss_coef=0", "trainer.algorithm.entropy_loss_coef_end=0.1"]
        )
    )


@pytest.mark.parametrize("ceiling", ["0.5", "0.3"])
def test_entropy_ceiling_at_or_below_the_target_is_refused(ceiling: str) -> None:
    err = _refusal(
        ["trainer.algorithm.entropy_target=0.5", f"trainer.algorithm.entropy_ceiling={ceiling}"]
    )
    assert err.path == "trainer.algorithm.entropy_ceiling" and err.got == ceiling
    assert (
        err.expected is not None and "above trainer.algorithm.entropy_target (0.5" in err.expected
    )
    validate_cfg(
        load_config(["trainer.algorithm.entropy_target=0.5", "trainer.algorithm.entropy_ceiling=3"])
    )


def test_validate_cfg_takes_a_composed_hydra_config_too() -> None:
    from hydra import compose, initialize_config_dir

    from skyrl_train.config.compose import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        raw = compose(config_name="ppo_base_config")
        validate_cfg(raw)
        bad = compose(
            config_name="ppo_base_config",
            overrides=["trainer.policy.megatron_config.virtual_pipeline_model_parallel_size=2"],
        )
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(bad)
    assert info.value.path == "trainer.policy.megatron_config.virtual_pipeline_model_parallel_size"


def test_a_run_dir_holding_another_runs_metrics_is_refused_unless_resuming(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    validate_cfg(load_config([f"trainer.run_dir={run_dir}"]))  # empty: fine
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    err = _refusal([f"trainer.run_dir={run_dir}"])
    assert err.path == "trainer.run_dir"
    # Metrics alone, no checkpoint and no run.json: no resume could continue it, so
    # the refusal suggests only a new folder.
    assert "pick a new trainer.run_dir" in err.reason and str(run_dir) in err.reason
    assert "trainer.resume_from" not in err.reason
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1  # left as it was
    folder = begin_save(run_dir / "checkpoints", step=1)
    write_file(folder / DRIVER_FILE, json.dumps({"step": 1, "world_size": 1}).encode())
    checkpoint = commit_save(folder, step=1)
    assert "trainer.resume_from=latest" in _refusal([f"trainer.run_dir={run_dir}"]).reason
    validate_cfg(load_config([f"trainer.run_dir={run_dir}", f"trainer.resume_from={checkpoint}"]))


def test_ranks_strictly_spread_need_a_cluster() -> None:
    # A local Ray has one node: Ray would wait forever for the second.
    spread = [
        "trainer.placement.num_trainers=2",
        "trainer.placement.strategy=STRICT_SPREAD",
        f"{POLICY}.expert_model_parallel_size=2",
        "trainer.micro_train_batch_size_per_gpu=16",
    ]
    err = _refusal(spread)
    assert err.path == "trainer.placement.strategy"
    assert "got 'STRICT_SPREAD' with 2 ranks" in str(err)
    validate_cfg(load_config([*spread, "ray.address=127.0.0.1:6379"]))
    validate_cfg(load_config(["trainer.placement.strategy=STRICT_SPREAD"]))  # one rank
    assert _refusal(["trainer.placement.strategy=spread"]).path == "trainer.placement.strategy"


def test_the_readme_slime_shape_on_this_machine_validates_as_written() -> None:
    # README "Larger layouts": the default recipe at slime's layout on 8 CPU ranks.
    validate_cfg(load_config([*SLIME, "trainer.placement.cpus_per_trainer=0.125"]))


def test_an_environment_that_generates_no_prompts_needs_dataset_files() -> None:
    err = _refusal(["environment.env_class=text2sql"])
    assert err.path == "data.train_data"
    assert "'text2sql' generates no prompts" in err.reason


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["min_lr=0.01", "lr_decay_steps=10"], "at most trainer.policy.optimizer_config.lr"),
        (
            ["min_lr=0.0001", "lr_decay_steps=0"],
            "0 with trainer.policy.optimizer_config.lr_decay_steps 0",
        ),
    ],
)
def test_a_min_lr_the_decay_cannot_reach_is_refused(overrides: list[str], expected: str) -> None:
    opt = "trainer.policy.optimizer_config"
    err = _refusal([f"{opt}.{o}" for o in overrides])
    assert err.path == f"{opt}.min_lr" and err.expected is not None
    assert err.expected.startswith(expected)
    validate_cfg(load_config([f"{opt}.min_lr=0.0001", f"{opt}.lr_decay_steps=10"]))

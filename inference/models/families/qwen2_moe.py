"""Qwen2-MoE: q/k/v bias, no q/k norm, an always-on shared expert scaled by
``sigmoid(shared_expert_gate(x))``, optional dense layers, top-k not renormalised
unless ``norm_topk_prob``."""

from __future__ import annotations

from typing import Any

from inference.models.architecture import Family, MoEArchitecture, TinySizes
from inference.models.families import _common as c

_SHARED_TABLE = {
    "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
}
_SHARED_FUSED = {
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    )
}


def describe(cfg: Any) -> MoEArchitecture:
    shared = int(c.field(cfg, "shared_expert_intermediate_size", 0))
    if shared < 1:
        c.refuse("shared_expert_intermediate_size", shared, "a positive width (Qwen2-MoE)")
    return MoEArchitecture(
        family=FAMILY.name,
        **c.common_fields(cfg),
        moe_ffn_hidden_size=int(cfg.moe_intermediate_size),
        moe_layers=c.qwen_moe_layers(cfg),
        dense_ffn_hidden_size=int(c.field(cfg, "intermediate_size", 0)),
        norm_topk_prob=bool(cfg.norm_topk_prob),
        qk_norm="none",
        qkv_bias=bool(c.field(cfg, "qkv_bias", True)),
        shared_expert_ffn_hidden_size=shared,
    )


def tiny_config(sizes: TinySizes) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **c.tiny_fields(sizes, FAMILY.architectures),
        intermediate_size=sizes.dense_ffn_hidden_size,
        moe_intermediate_size=sizes.moe_ffn_hidden_size,
        shared_expert_intermediate_size=sizes.shared_expert_ffn_hidden_size,
        num_experts=sizes.num_experts,
        norm_topk_prob=False,
        qkv_bias=True,
        mlp_only_layers=[0] if sizes.dense_first_layer else [],
        decoder_sparse_step=1,
    )


FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_type="qwen2_moe",
    describe=describe,
    tiny_config=tiny_config,
    layer_table={**c.ATTENTION_TABLE, **c.ROUTER_TABLE, **c.DENSE_MLP_TABLE, **_SHARED_TABLE},
    fused_table={**c.DENSE_MLP_FUSED, **_SHARED_FUSED},
)

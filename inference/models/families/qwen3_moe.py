"""Qwen3-MoE: per-head q/k RMSNorm, no biases, optional dense layers, top-k renormalised
when ``norm_topk_prob`` (the released checkpoints set it)."""

from __future__ import annotations

from typing import Any

from inference.models.architecture import Family, MoEArchitecture, TinySizes
from inference.models.families import _common as c


def describe(cfg: Any) -> MoEArchitecture:
    if c.field(cfg, "attention_bias", False):
        c.refuse("attention_bias", True, "false (Qwen3-MoE checkpoints have no q/k/v/o bias)")
    return MoEArchitecture(
        family=FAMILY.name,
        **c.common_fields(cfg),
        moe_ffn_hidden_size=int(cfg.moe_intermediate_size),
        moe_layers=c.qwen_moe_layers(cfg),
        dense_ffn_hidden_size=int(c.field(cfg, "intermediate_size", 0)),
        norm_topk_prob=bool(cfg.norm_topk_prob),
        qk_norm="per_head",
    )


def tiny_config(sizes: TinySizes) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **c.tiny_fields(sizes, FAMILY.architectures),
        intermediate_size=sizes.dense_ffn_hidden_size,
        moe_intermediate_size=sizes.moe_ffn_hidden_size,
        num_experts=sizes.num_experts,
        norm_topk_prob=True,
        mlp_only_layers=[0] if sizes.dense_first_layer else [],
        decoder_sparse_step=1,
    )


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_type="qwen3_moe",
    describe=describe,
    tiny_config=tiny_config,
    layer_table={**c.ATTENTION_TABLE, **c.QK_NORM_TABLE, **c.ROUTER_TABLE, **c.DENSE_MLP_TABLE},
    fused_table=dict(c.DENSE_MLP_FUSED),
)

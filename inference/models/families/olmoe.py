"""OLMoE: q/k RMSNorm over the whole projection (``heads * head_dim`` wide, not per
head), every layer MoE, top-k softmax weights not renormalised."""

from __future__ import annotations

from typing import Any

from inference.models.architecture import Family, MoEArchitecture, TinySizes
from inference.models.families import _common as c


def describe(cfg: Any) -> MoEArchitecture:
    if c.field(cfg, "attention_bias", False):
        c.refuse("attention_bias", True, "false (OLMoE checkpoints have no q/k/v/o bias)")
    if c.field(cfg, "clip_qkv", None) is not None:
        c.refuse("clip_qkv", cfg.clip_qkv, "null (Megatron has no q/k/v clamp)")
    fields = c.common_fields(cfg)
    if fields["head_dim"] * fields["num_attention_heads"] != fields["hidden_size"]:
        # transformers sizes OLMoE's q/k norms from hidden_size, so only this shape loads.
        c.refuse("head_dim", fields["head_dim"], "hidden_size / num_attention_heads")
    return MoEArchitecture(
        family=FAMILY.name,
        **fields,
        moe_ffn_hidden_size=int(cfg.intermediate_size),
        moe_layers=tuple(range(fields["num_layers"])),
        norm_topk_prob=bool(c.field(cfg, "norm_topk_prob", False)),
        qk_norm="full",
    )


def tiny_config(sizes: TinySizes) -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(
        **c.tiny_fields(sizes, FAMILY.architectures),
        intermediate_size=sizes.moe_ffn_hidden_size,
        num_experts=sizes.num_experts,
        norm_topk_prob=False,
        pad_token_id=None,
        eos_token_id=None,
    )


FAMILY = Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    model_type="olmoe",
    describe=describe,
    tiny_config=tiny_config,
    layer_table={**c.ATTENTION_TABLE, **c.QK_NORM_TABLE, **c.ROUTER_TABLE},
)

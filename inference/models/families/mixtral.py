"""Mixtral: plain attention (no bias, no q/k norm), every layer MoE, top-k softmax
weights always renormalised."""

from __future__ import annotations

from typing import Any

from inference.models.architecture import Family, MoEArchitecture, TinySizes
from inference.models.families import _common as c


def describe(cfg: Any) -> MoEArchitecture:
    if c.field(cfg, "sliding_window", None) is not None:
        c.refuse(
            "sliding_window", cfg.sliding_window, "null (sliding-window attention is not mapped)"
        )
    fields = c.common_fields(cfg)
    return MoEArchitecture(
        family=FAMILY.name,
        **fields,
        moe_ffn_hidden_size=int(cfg.intermediate_size),
        moe_layers=tuple(range(fields["num_layers"])),
        norm_topk_prob=True,
        qk_norm="none",
    )


def tiny_config(sizes: TinySizes) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        **c.tiny_fields(sizes, FAMILY.architectures),
        intermediate_size=sizes.moe_ffn_hidden_size,
        num_local_experts=sizes.num_experts,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
    )


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_type="mixtral",
    describe=describe,
    tiny_config=tiny_config,
    layer_table={**c.ATTENTION_TABLE, **c.ROUTER_TABLE},
)

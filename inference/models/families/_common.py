"""What the four families share: config fields spelled alike, refusals, weight tables."""

from __future__ import annotations

from typing import Any

from inference.errors import CheckpointFormatError
from inference.models.architecture import TinySizes

# HF suffix inside ``model.layers.{i}`` -> Megatron suffix inside ``decoder.layers.{i}``.
ATTENTION_TABLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
}
QK_NORM_TABLE = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
ROUTER_TABLE = {"mlp.gate.weight": "mlp.router.weight"}
# Dense layers (Qwen ``mlp_only_layers``): Megatron's gated fc1 is [gate; up].
DENSE_MLP_TABLE = {"mlp.down_proj.weight": "mlp.linear_fc2.weight"}
DENSE_MLP_FUSED = {"mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def tiny_fields(sizes: TinySizes, architectures: tuple[str, ...]) -> dict[str, Any]:
    """The config keyword arguments every family spells alike, from ``TinySizes``;
    a family's ``tiny_config`` adds its experts, widths and switches."""
    return dict(
        architectures=list(architectures),
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_attention_heads,
        num_key_value_heads=sizes.num_kv_heads,
        # Not in every config's typed signature, but every family's attention reads it.
        head_dim=sizes.head_dim,
        num_experts_per_tok=sizes.num_experts_per_tok,
        max_position_embeddings=sizes.max_position_embeddings,
        initializer_range=sizes.initializer_range,
        tie_word_embeddings=False,
    )


def field(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, default)
    return default if value is None else value


def num_experts(cfg: Any) -> int:
    """Families spell it ``num_experts`` or ``num_local_experts``."""
    value = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not isinstance(value, int) or value < 1:
        raise CheckpointFormatError("config.json:num_experts", "a positive expert count", value)
    return value


def refuse(name: str, value: Any, expected: str) -> None:
    raise CheckpointFormatError(f"config.json:{name}", expected, value)


def common_fields(cfg: Any) -> dict[str, Any]:
    """The ``MoEArchitecture`` fields every family spells the same way.

    Refuses what neither the trainer nor the converter maps: another activation, a
    RoPE scaling that rescales positions, sliding-window attention.
    """
    act = field(cfg, "hidden_act", "silu")
    if act != "silu":
        refuse("hidden_act", act, "'silu' (SwiGLU experts)")
    rope = dict(field(cfg, "rope_parameters", {}) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        refuse("rope_parameters.rope_type", rope_type, "'default' (plain RoPE)")
    if field(cfg, "use_sliding_window", False):
        refuse("use_sliding_window", True, "false (sliding-window attention is not mapped)")
    heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    return dict(
        vocab_size=int(cfg.vocab_size),
        hidden_size=hidden,
        num_layers=int(cfg.num_hidden_layers),
        num_attention_heads=heads,
        num_kv_heads=int(field(cfg, "num_key_value_heads", heads)),
        head_dim=int(field(cfg, "head_dim", hidden // heads)),
        num_experts=num_experts(cfg),
        num_experts_per_tok=int(cfg.num_experts_per_tok),
        rope_theta=float(rope.get("rope_theta", field(cfg, "rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.rms_norm_eps),
        tie_word_embeddings=bool(field(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.max_position_embeddings),
        initializer_range=float(field(cfg, "initializer_range", 0.02)),
    )


def qwen_moe_layers(cfg: Any) -> tuple[int, ...]:
    """Qwen's rule: a layer is sparse unless listed in ``mlp_only_layers``, and then
    only every ``decoder_sparse_step``-th one."""
    step = int(field(cfg, "decoder_sparse_step", 1))
    if step < 1:
        refuse("decoder_sparse_step", step, "an int >= 1")
    dense = set(field(cfg, "mlp_only_layers", []) or [])
    return tuple(
        i for i in range(int(cfg.num_hidden_layers)) if i not in dense and (i + 1) % step == 0
    )

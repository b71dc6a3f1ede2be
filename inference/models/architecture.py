"""One family-independent description of an MoE decoder, read from a checkpoint's config.

The engine, the trainer and the weight converter all work from ``MoEArchitecture``;
a family module (``inference.models.families``) is the only place that knows how a
Hugging Face ``config.json`` spells each field, and it refuses what it cannot map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.errors import CheckpointFormatError

__all__ = ["Family", "MoEArchitecture", "QKNorm", "TinySizes"]

QKNorm = Literal["none", "per_head", "full"]
"""Where q/k RMSNorm sits: none, over each head's ``head_dim`` (Qwen3-MoE), or over the
whole projection (OLMoE: ``heads * head_dim`` wide)."""


@dataclass(frozen=True)
class MoEArchitecture:
    """What building, converting and routing need to know about a checkpoint."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    """Experts each token is routed to (the router's top-k)."""
    moe_ffn_hidden_size: int
    moe_layers: tuple[int, ...]
    """0-based decoder layers that have a router, ascending; the others are dense."""
    dense_ffn_hidden_size: int = 0
    """The dense layers' MLP width (0 when every layer is MoE)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k softmax weights (Megatron: ``moe_router_pre_softmax=False``)."""
    qk_norm: QKNorm = "none"
    qkv_bias: bool = False
    shared_expert_ffn_hidden_size: int | None = None
    """Width of an always-on shared expert, gated by ``sigmoid(x @ w)`` (Qwen2-MoE)."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if not self.moe_layers:
            raise CheckpointFormatError("config.json", "at least one MoE layer", "none")
        if list(self.moe_layers) != sorted(set(self.moe_layers)) or not (
            0 <= self.moe_layers[0] and self.moe_layers[-1] < self.num_layers
        ):
            raise CheckpointFormatError(
                "config.json",
                f"MoE layers ascending in [0, {self.num_layers})",
                list(self.moe_layers),
            )
        if self.num_experts_per_tok > self.num_experts:
            raise CheckpointFormatError(
                "config.json:num_experts_per_tok",
                f"<= the expert count ({self.num_experts})",
                self.num_experts_per_tok,
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise CheckpointFormatError(
                "config.json:num_key_value_heads",
                f"a divisor of num_attention_heads ({self.num_attention_heads})",
                self.num_kv_heads,
            )
        if self.dense_layers and self.dense_ffn_hidden_size < 1:
            raise CheckpointFormatError(
                "config.json:intermediate_size",
                f"a positive dense MLP width (layers {list(self.dense_layers)} are dense)",
                self.dense_ffn_hidden_size,
            )

    @property
    def num_moe_layers(self) -> int:
        """The route tensor's layer axis: routes exist for MoE layers only."""
        return len(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)


@dataclass(frozen=True)
class TinySizes:
    """Sizes for a small random checkpoint of any family (``scripts/make_checkpoint.py``).

    Deliberately unlike the built-in model (48 wide, 6 heads of 8, 6 experts, top-3,
    a dense first layer where the family has dense layers), so a test that passes on
    both cannot be leaning on one set of numbers.
    """

    vocab_size: int = 512
    hidden_size: int = 48
    num_layers: int = 3
    num_attention_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 8
    num_experts: int = 6
    num_experts_per_tok: int = 3
    moe_ffn_hidden_size: int = 32
    dense_ffn_hidden_size: int = 80
    shared_expert_ffn_hidden_size: int = 40
    dense_first_layer: bool = True
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2
    """As the built-in model: a sharp random router, so R3 has near-ties to fix."""


LAYOUT_TEST_SIZES = TinySizes(
    hidden_size=64,
    num_layers=8,
    num_attention_heads=8,
    num_kv_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    dense_ffn_hidden_size=64,
    shared_expert_ffn_hidden_size=32,
)
"""``TinySizes`` with room for TP=4, EP=8, PP=4 and PP x VPP in every family (as
``tiny_moe.LAYOUT_TEST_MODEL`` for the built-in model): heads, KV heads, experts, MLP
widths and the 512-id vocabulary divide by 4 (and 8 where EP or the vocabulary splits)."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face MoE family: how to read its config and where its weights live.

    Weight names are the transformers module's own (``model.named_parameters()``), which
    is what the engine loads and exports; ``layer_table`` maps one-to-one tensors inside
    a decoder layer, ``fused_table`` Megatron tensors concatenated (dim 0) from several
    HF ones. q/k/v fusion and the stacked experts are common to every family and live
    in the converter.
    """

    name: str
    architectures: tuple[str, ...]
    model_type: str
    describe: Callable[[Any], MoEArchitecture]
    """HF config -> architecture; raises ``CheckpointFormatError`` for what it cannot map."""
    tiny_config: Callable[[TinySizes], Any]
    """A transformers config of this family with the given sizes."""
    layer_table: Mapping[str, str] = field(default_factory=dict)
    fused_table: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    capture_point: str = "mlp.gate"
    """Module under each MoE decoder layer whose output is ``(logits, weights, ids)``."""

"""The one description of the tiny MoE architecture shared by the engine and the trainer.

Both sides build from ``TinyMoEConfig`` so their layouts cannot drift: the engine
builds a transformers Qwen3-MoE model from it, the trainer a megatron-core GPTModel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from inference.models.architecture import MoEArchitecture


@dataclass
class TinyMoEConfig:
    """Architecture of a Qwen3-MoE-style model (RMSNorm, SwiGLU, RoPE, GQA, QK norm).

    ``vocab_size`` must cover the tokenizer's ids (256 bytes plus specials).
    """

    vocab_size: int = 264
    hidden_size: int = 64
    num_layers: int = 4
    num_experts: int = 8
    num_experts_per_tok: int = 2
    """Experts each token is routed to (the router's top-k; Hugging Face's name)."""
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # norm_topk_prob=True pairs with Megatron's moe_router_pre_softmax=False; the
    # wrong pairing cost up to 9 in logits when this was measured.
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.2
    # Not the usual 0.02: a random router that near-uniform agrees between the bf16
    # engine and the fp32 trainer on 99.8% of token-layer choices, and R3 then has
    # nothing to show (measured mismatch 0.0027 with or without replay; at 0.2 replay
    # halves the mean |dlogp| and cuts the max ~10x).

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_experts",
            "num_experts_per_tok",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "moe_intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyMoEConfig.{name}: expected a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"TinyMoEConfig.num_experts_per_tok: expected <= num_experts "
                f"({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyMoEConfig.num_kv_heads: expected a divisor of num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_kv_heads}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TinyMoEConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"TinyMoEConfig: unknown keys {unknown}; expected some of {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def architecture(self) -> MoEArchitecture:
        """The family-independent description, read back through the Qwen3-MoE family."""
        from inference.models.families import describe

        return describe(self.to_hf_config())

    def to_hf_config(self) -> Any:
        from transformers import Qwen3MoeConfig

        # head_dim is not in Qwen3MoeConfig's signature but its attention reads it
        # (without it head_dim would silently be hidden_size / heads).
        extra: dict[str, Any] = {"head_dim": self.head_dim}
        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            output_router_logits=False,
            **extra,
        )


LAYOUT_TEST_MODEL = TinyMoEConfig(
    num_layers=8, num_attention_heads=8, num_kv_heads=4, head_dim=8, moe_intermediate_size=32
)
"""The built-in model with room for the layouts published recipes use
(``model=tiny_layouts``): 8 heads and 4 KV heads for TP=4, 8 experts at top-2 for
EP=8, 8 layers for PP=4 and PP x VPP, expert and vocabulary widths (32, 264) that
TP and ETP up to 8 and 4 divide. Still ~0.5M parameters: the layout grid
(tests/skyrl_train/workers/test_megatron_layout_grid.py) runs it on 8 CPU ranks."""


def build_hf_model(config: TinyMoEConfig, *, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """A randomly initialised transformers Qwen3-MoE model, reproducible from ``seed``."""
    from transformers import Qwen3MoeForCausalLM

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model: Any = Qwen3MoeForCausalLM(config.to_hf_config())
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype).eval()

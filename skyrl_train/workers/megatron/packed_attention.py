"""Core attention for packed rows (``trainer.remove_microbatch_padding``) without
Transformer Engine.

With ``PackedSeqParams(qkv_format="thd")`` megatron-core hands the core attention
``[T, heads, head_dim]`` query, key and value (the dummy batch axis squeezed out) and
reshapes what it returns to ``[T, 1, heads * head_dim]``; rotary positions were
already applied per document from ``cu_seqlens`` (``rope_utils._apply_rotary_pos_emb_thd``,
plain torch, restarting at 0 in every document). megatron-core 0.16.1's local
``DotProductAttention`` asserts ``packed_seq_params is None`` (THD is Transformer
Engine's there), so ``PackedDotProductAttention`` runs each document's causal attention
alone (``scaled_dot_product_attention`` on that document's tokens): no token sees
another document, and the cost is the sum of the documents' squares, not the packed
row's square. Without ``packed_seq_params`` it is megatron-core's own module, so the
padded path computes exactly what it did.

Where Transformer Engine is installed, ``core_attention_for_packing`` picks its
``TEDotProductAttention`` (its THD kernels take the same ``PackedSeqParams``); that
GPU path is not exercised by this project's tests (docs/r3-and-pipeline.md).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from skyrl_train.workers.packed_layout import document_attention

__all__ = ["core_attention_for_packing", "packed_dot_product_attention"]

PACKING_KEY = "trainer.remove_microbatch_padding"


@functools.cache
def packed_dot_product_attention() -> type:
    """megatron-core's ``DotProductAttention`` that also takes THD ``packed_seq_params``
    (built lazily: megatron-core imports after the CPU shim)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is None:
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias
                )
            if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
                raise ValueError(
                    "packed_seq_params: expected qkv_format 'thd' and no attention bias, "
                    f"got {packed_seq_params.qkv_format!r}"
                    + (" with a bias" if attention_bias is not None else "")
                )
            # megatron-core squeezes the dummy batch axis for THD: [T, heads, head_dim].
            # With apply_query_key_layer_scaling the scores are divided by the layer
            # number and the softmax multiplies it back (its ``scale``).
            coeff = self.scale_mask_softmax.scale
            return document_attention(
                query,
                key,
                value,
                packed_seq_params.cu_seqlens_q.to(query.device),
                scale=self.softmax_scale * (coeff if coeff is not None else 1.0),
                dropout=self.attention_dropout.p if self.training else 0.0,
            )

    return PackedDotProductAttention


def core_attention_for_packing(config: Any) -> type:
    """Transformer Engine's ``TEDotProductAttention`` where it imports (its THD path;
    untested here), else ``packed_dot_product_attention()``, which refuses (by
    ``trainer.remove_microbatch_padding``) what megatron-core's local attention does
    and it does not: a sliding window, and a softmax with an offset."""
    # megatron-core's extension module imports without Transformer Engine too, and then
    # hands out a MagicMock for TEDotProductAttention (seen with 0.16.1): ask for TE itself.
    if importlib.util.find_spec("transformer_engine") is None:
        if config.window_size is not None or config.softmax_type != "vanilla":
            from skyrl_train.errors import ConfigValidationError

            raise ConfigValidationError(
                PACKING_KEY,
                expected="false with a sliding window or a softmax offset "
                "(transformer_config_kwargs: window_size, softmax_type); the packed "
                "attention without Transformer Engine is plain causal per row",
                got=f"true (window_size={config.window_size!r}, "
                f"softmax_type={config.softmax_type!r})",
            )
        return packed_dot_product_attention()
    from megatron.core.extensions.transformer_engine import (  # pragma: no cover - a GPU
        TEDotProductAttention,
    )

    return TEDotProductAttention  # pragma: no cover - needs Transformer Engine (a GPU)

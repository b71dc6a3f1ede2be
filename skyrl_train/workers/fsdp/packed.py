"""Packed microbatches on the FSDP backend (``trainer.remove_microbatch_padding``): the
model runs one row ``[1, T]`` (``workers/packed_layout.py``) with positions restarting
per document and attention that never crosses a document boundary.

The model gets the documents' boundaries as transformers' varlen kwargs
(``cu_seq_lens_q/k``, ``max_length_q/k``), which every family here forwards untouched
from ``model(...)`` to its attention function. Two kernels read them:

- ``flash_attention_2`` where a CUDA device and the ``flash_attn`` package are present
  and the compute is bf16: transformers' own varlen path (untested here: no such
  machine in this project's CI);
- else this module's ``skyrl_packed_eager`` / ``skyrl_packed_sdpa``, registered with
  transformers' ``AttentionInterface``: the configured kernel (``fsdp_config.
  attn_implementation``) run on each document's own slice of the row, so the cost is
  the sum of the documents' squared lengths, never ``T^2``. These names are not in
  transformers' mask interface, so the model builds no ``[T, T]`` mask either
  (``masking_utils._preprocess_mask_arguments`` returns early for them).

A per-document loop, not flex_attention's document ``BlockMask``: torch 2.13's flex
attention refuses a backward on the CPU ("FlexAttention does not support backward on
CPU"), so it could not train here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from skyrl_train.workers.packed_layout import PackedBatch, document_attention

__all__ = ["attention_implementation", "model_kwargs", "register_attention"]

PACKED_KERNELS = {"eager": "skyrl_packed_eager", "sdpa": "skyrl_packed_sdpa"}
"""The configured kernel's per-document version, by ``fsdp_config.attn_implementation``."""

_VARLEN = "flash_attention_2"


def attention_implementation(configured: str, *, device_type: str, param_dtype: str) -> str:
    """The attention the packed model is built with: flash attention's varlen kernel on
    CUDA when installed and the compute is bf16 (it has no fp32 kernel), else the
    configured kernel per document (registered here)."""
    if device_type == "cuda" and param_dtype == "bfloat16" and flash_attention_installed():
        return _VARLEN
    if configured not in PACKED_KERNELS:
        raise ValueError(
            f"trainer.policy.fsdp_config.attn_implementation: expected one of "
            f"{sorted(PACKED_KERNELS)} with trainer.remove_microbatch_padding, got {configured!r}"
        )
    register_attention()
    return PACKED_KERNELS[configured]


def flash_attention_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def register_attention() -> None:
    """Register the per-document kernels with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_KERNELS["eager"], _eager_documents)
    AttentionInterface.register(PACKED_KERNELS["sdpa"], _sdpa_documents)


def model_kwargs(packed: PackedBatch, device: torch.device) -> dict[str, Any]:
    """``model(...)``'s inputs for ``packed``: the row, its per-document positions and
    the documents' boundaries as transformers' varlen kwargs."""
    cu = packed.cu_seqlens.to(device=device, dtype=torch.int32)
    longest = packed.max_seqlen
    return {
        "input_ids": packed.tokens.to(device),
        "position_ids": packed.positions.to(device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _documents(kwargs: dict[str, Any], query: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of the packed row, checked against ``query``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(
            "cu_seq_lens_q: expected the packed row's document boundaries (the packed "
            "attention runs only on a PackedBatch's model_kwargs), got none"
        )
    bounds = [int(b) for b in cu.tolist()]
    total = query.shape[2]
    if query.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"cu_seq_lens_q: expected 0..{total} over one packed row, got {bounds[0]}.."
            f"{bounds[-1]} over {query.shape[0]} rows"
        )
    window = kwargs.get("sliding_window")
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    if window is not None and 0 < window < longest:
        # A window narrower than a document needs a banded mask the loop does not build.
        raise ValueError(
            f"config.json:sliding_window: expected none or at least the longest packed row "
            f"({longest} tokens), got {window}"
        )
    return list(zip(bounds, bounds[1:], strict=False))


def _grouped(module: Any, key: torch.Tensor, value: torch.Tensor) -> tuple[Any, Any]:
    """Keys and values repeated to the query heads (grouped-query attention)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def _eager_documents(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' eager attention (the full score matrix, fp32 softmax) on each
    document alone; ``[1, H, T, D]`` in, ``[1, T, H, D]`` out."""
    key, value = _grouped(module, key, value)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    outputs = []
    for start, end in _documents(kwargs, query):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        outputs.append(torch.matmul(probs, v))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _sdpa_documents(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """torch's fused causal attention on each document alone (as ``_eager_documents``):
    ``packed_layout.document_attention``, the Megatron backend's too."""
    _documents(kwargs, query)  # the boundaries and window checked as the eager kernel's
    _batch, heads, total, dim = query.shape
    out = document_attention(  # [1, heads, T, dim] -> [T, heads, dim]
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs["cu_seq_lens_q"],
        scale=scaling,
        dropout=dropout if module.training else 0.0,
    )
    return out.view(1, total, heads, dim), None

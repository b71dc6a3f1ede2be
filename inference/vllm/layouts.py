"""Weight names a vLLM server loads, from the engine layout the trainer exports.

The trainer exports transformers' in-memory layout (``inference.engine.weights``: what
the builtin engine loads). vLLM's ``load_weights`` takes the names a checkpoint has on
disk. For qwen3_moe, olmoe and qwen2_moe vLLM 0.32 also accepts transformers' fused
expert tensors (``mlp.experts.gate_up_proj``), measured by pushing them and serving
fp32 tokens equal to transformers' (tests/inference/vllm_engine/test_vllm_families.py).
Its Mixtral does not: it knows only ``block_sparse_moe.experts.N.w1/w2/w3`` and
refuses ``mlp`` (``There is no module or parameter named 'layers.0.mlp'``), so Mixtral
tensors are renamed and split per expert here, as transformers' own save does
(``core_model_loading.revert_weight_conversion`` is the oracle in the tests).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["to_vllm_layout"]

_MIXTRAL_MOE = re.compile(
    r"(?P<layer>.*\.layers\.\d+)\.mlp\.(?P<what>gate\.weight|experts\.gate_up_proj|experts\.down_proj)"
)


def to_vllm_layout(
    family: str | None, named_tensors: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """``named_tensors`` (engine layout) under the names vLLM loads for ``family``;
    unchanged for families whose names vLLM takes as they are, or ``None`` (unknown)."""
    if family != "mixtral":
        yield from named_tensors
        return
    for name, tensor in named_tensors:
        match = _MIXTRAL_MOE.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix = f"{match['layer']}.block_sparse_moe"
        what = match["what"]
        if what == "gate.weight":
            yield f"{prefix}.gate.weight", tensor
        elif what == "experts.gate_up_proj":
            # [experts, 2 * ffn, hidden]: gate (w1) rows first, then up (w3).
            ffn = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.experts.{e}.w1.weight", tensor[e, :ffn]
                yield f"{prefix}.experts.{e}.w3.weight", tensor[e, ffn:]
        else:  # [experts, hidden, ffn]
            for e in range(tensor.shape[0]):
                yield f"{prefix}.experts.{e}.w2.weight", tensor[e]

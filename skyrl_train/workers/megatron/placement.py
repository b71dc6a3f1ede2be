"""Where each of a Megatron rank's parameters sits in the whole model: the placement
records a rank file carries so another layout can resume it (``runs/reshard.py``,
docs/parallel-layouts.md "Resharding").

A parameter's layout-free key is its Megatron name with the global layer number and
the global expert index and no virtual-stage prefix; a tensor-parallel shard adds its
partition dim, TP rank and TP size.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from skyrl_train.runs.reshard import Placement
from skyrl_train.workers.megatron.tensor_parallel import is_gated, tensor_parallel_of

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def placements(chunks: Sequence[Any]) -> dict[str, Placement]:
    """Every parameter of this rank's ``chunks``, by its name in the worker's model
    (``"<chunk>."``-prefixed under virtual stages), in ``named_parameters`` order."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    found: dict[str, Placement] = {}
    for index, chunk in enumerate(chunks):
        prefix = f"{index}." if len(chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            key = name
            layer_match = _LAYER.match(name)
            if layer_match is not None:
                layer = chunk.decoder.layers[int(layer_match.group(1))]
                rest = layer_match.group(2)
                expert_match = _EXPERT.match(rest)
                if expert_match is not None:
                    local = len(layer.mlp.experts.local_experts)
                    number = ep_rank * local + int(expert_match.group(1))
                    rest = f"mlp.experts.local_experts.{number}.{expert_match.group(2)}"
                # Megatron numbers layers from 1, globally.
                key = f"decoder.layers.{layer.layer_number - 1}.{rest}"
            tp_rank, tp_size, _group = tensor_parallel_of(param)
            found[prefix + name] = Placement(
                key=key,
                dim=int(getattr(param, "partition_dim", 0)) if tp_size > 1 else 0,
                tp_rank=tp_rank,
                tp_size=tp_size,
                gated=is_gated(name),
            )
    return found


def placement_record(chunks: Sequence[Any]) -> list[dict[str, Any]]:
    """``placements`` as a rank file stores them: plain data, in parameter order (the
    order of AdamW's state indexes)."""
    return [{"name": name, **dataclasses.asdict(p)} for name, p in placements(chunks).items()]

"""Where each of a Megatron rank's parameters sits in the whole model: the placement
records a rank file carries so another layout can resume it (``runs/reshard.py``,
docs/parallel-layouts.md "Resharding"), and the layout a rank reports
(``parallel_layout``).

A parameter's layout-free key is its Megatron name with the global layer number and
the global expert index and no virtual-stage prefix; a tensor-parallel shard adds its
partition dim, TP rank and TP size.

A state to load is checked whole first (``check_state``): torch's ``load_state_dict``
copies every tensor that fits before it raises on one that does not, and its optimizer
loader takes moments of any shape, so a rank file of another layout left a half-loaded
model behind a bare size-mismatch ``RuntimeError``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from skyrl_train.runs.rank_contract import (
    STRATEGY_KEY,
    UNNAMED_STRATEGY,
    ParallelLayout,
    Placement,
    StateMismatch,
)
from skyrl_train.workers.megatron.tensor_parallel import is_gated, tensor_parallel_of

if TYPE_CHECKING:
    from skyrl_train.config.schema import MegatronConfig

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


def parallel_layout(mc: MegatronConfig, *, world: int) -> ParallelLayout:
    """The layout a Megatron rank of ``world`` ranks reports (``RankInfo.layout``) and its
    rank files record: ``trainer.policy.megatron_config``'s sizes, ETP resolved (null
    is TP, megatron-core's rule)."""
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    return ParallelLayout(
        backend=UNNAMED_STRATEGY,
        world=world,
        tp=tp,
        pp=pp,
        vpp=mc.virtual_pipeline_model_parallel_size,
        ep=mc.expert_model_parallel_size,
        etp=mc.expert_tensor_parallel_size or tp,
        dp=world // (tp * pp * mc.context_parallel_size),
    )


def placement_record(chunks: Sequence[Any]) -> list[dict[str, Any]]:
    """``placements`` as a rank file stores them: plain data, in parameter order (the
    order of AdamW's state indexes)."""
    return [{"name": name, **dataclasses.asdict(p)} for name, p in placements(chunks).items()]


_MOMENTS = ("exp_avg", "exp_avg_sq")


def check_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Refuse, before anything is loaded, a ``checkpoint_state`` that does not fit
    ``model`` and its AdamW ``optimizer``: another backend's, a missing or extra model
    entry, a tensor of another shape, AdamW state of another parameter count or shape.
    ``StateMismatch`` names the entry; the resume names the rank file."""
    strategy = state.get(STRATEGY_KEY, UNNAMED_STRATEGY)
    if strategy != UNNAMED_STRATEGY:
        raise StateMismatch(STRATEGY_KEY, expected=repr(UNNAMED_STRATEGY), got=repr(strategy))
    live = model.state_dict()
    saved = _mapping(state.get("model"), "model")
    extra = sorted(str(k) for k in saved.keys() - live.keys())
    if extra:
        raise StateMismatch(
            f"model[{extra[0]!r}]", expected="an entry of this model", got="an extra entry"
        )
    for key, target in live.items():
        if key not in saved:
            raise StateMismatch(f"model[{key!r}]", expected="an entry", got="nothing")
        if isinstance(target, torch.Tensor):
            _same_shape(saved[key], target, f"model[{key!r}]")
    params = list(model.parameters())
    optim = _mapping(state.get("optimizer"), "optimizer")
    groups = optim.get("param_groups")
    indexes = list(range(len(params)))
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        raise StateMismatch(
            "optimizer['param_groups']", expected="one AdamW parameter group", got=repr(groups)
        )
    if groups[0].get("params") != indexes:
        raise StateMismatch(
            "optimizer['param_groups'][0]['params']",
            expected=f"the indexes of this model's {len(params)} parameters",
            got=repr(groups[0].get("params")),
        )
    for index, fields in _mapping(optim.get("state"), "optimizer['state']").items():
        where = f"optimizer['state'][{index!r}]"
        if type(index) is not int or not 0 <= index < len(params):
            raise StateMismatch(
                "optimizer['state']",
                expected=f"parameter indexes in [0, {len(params)})",
                got=repr(index),
            )
        fields = _mapping(fields, where)
        for moment in _MOMENTS:
            _same_shape(fields.get(moment), params[index], f"{where}[{moment!r}]")


def _same_shape(value: Any, target: torch.Tensor, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        kind = "nothing" if value is None else f"a {type(value).__name__}"
        raise StateMismatch(where, expected=f"a tensor of shape {list(target.shape)}", got=kind)
    if value.shape != target.shape:
        raise StateMismatch(
            where,
            expected=f"a tensor of shape {list(target.shape)}",
            got=f"shape {list(value.shape)}",
        )


def _mapping(value: Any, where: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        kind = "nothing" if value is None else f"a {type(value).__name__}"
        raise StateMismatch(where, expected="a dict", got=kind)
    return value

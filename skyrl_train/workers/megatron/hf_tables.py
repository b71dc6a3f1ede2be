"""Which Megatron tensor each HF tensor of a family's decoder layer becomes, for both
directions of ``convert.py``.

Names on the HF side are the transformers model's own (``named_parameters()``). A
family's ``layer_table`` (``inference.models.families``) maps one-to-one tensors inside
a decoder layer and its ``fused_table`` Megatron tensors concatenated on dim 0 from
several HF ones (a dense or shared-expert MLP's ``[gate; up]``). q/k/v fusion and the
stacked experts are common to every family; ``linear_qkv`` (and its bias, Qwen2-MoE) is
laid out per KV group: that group's query heads, then its key head, then its value
head (concatenating all-q/all-k/all-v cost 0.77 in logits). ``FusedParts`` holds a
fused tensor's parts while a load waits for its siblings, which may come in any order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.models.architecture import Family, MoEArchitecture

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
"""An HF decoder layer's tensor: (layer number, suffix inside the layer)."""
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""transformers 5.x's fused experts: ``[E, 2I, H]`` (gate rows first) and ``[E, H, I]``."""


@dataclass(frozen=True)
class Fused:
    """One Megatron tensor built from several HF tensors of the same layer."""

    parts: tuple[str, ...]
    """HF suffixes, in concatenation order."""
    fuse: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    part_rows: Callable[[torch.Tensor], list[int]]
    """Rows (dim 0) of each part, given the Megatron parameter."""


def _qkv_rows(arch: MoEArchitecture) -> list[int]:
    return [
        arch.num_attention_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
    ]


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: MoEArchitecture
) -> torch.Tensor:
    """HF q/k/v projections (weights ``[rows, H]`` or biases ``[rows]``) -> Megatron
    ``linear_qkv`` (per KV group: q heads, k, v)."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups
    rest = tuple(q.shape[1:])
    q = q.reshape(groups, per_group * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, arch: MoEArchitecture
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron ``linear_qkv`` weight or bias -> HF (q, k, v) projections."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fused_entries(arch: MoEArchitecture, family: Family) -> dict[str, Fused]:
    """Megatron suffix -> how it is built: q/k/v (weights, and biases when the family
    has them) and the family's ``fused_table`` (equal parts concatenated on dim 0)."""

    def qkv(kind: str) -> Fused:
        return Fused(
            parts=tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv"),
            fuse=lambda ts: fuse_qkv(ts[0], ts[1], ts[2], arch),
            split=lambda t: list(split_qkv(t, arch)),
            part_rows=lambda _param: _qkv_rows(arch),
        )

    def concat(parts: tuple[str, ...]) -> Fused:
        n = len(parts)
        return Fused(
            parts=parts,
            fuse=lambda ts: torch.cat(ts, dim=0),
            split=lambda t: list(torch.chunk(t, n, dim=0)),
            part_rows=lambda param: [param.shape[0] // n] * n,
        )

    entries = {"self_attention.linear_qkv.weight": qkv("weight")}
    if arch.qkv_bias:
        entries["self_attention.linear_qkv.bias"] = qkv("bias")
    for mg_suffix, hf_suffixes in family.fused_table.items():
        entries[mg_suffix] = concat(tuple(hf_suffixes))
    return entries


@dataclass
class FusedParts:
    """The parts of fused Megatron tensors that arrived before their siblings, by
    (layer number, Megatron suffix): the only HF tensors a load holds on to."""

    entries: Mapping[str, Fused]
    waiting: dict[tuple[int, str], dict[int, torch.Tensor]] = field(default_factory=dict)

    def add(
        self, number: int, mg_suffix: str, index: int, part: torch.Tensor
    ) -> torch.Tensor | None:
        """The whole fused tensor once ``part`` was its last missing one; None before."""
        parts = self.waiting.setdefault((number, mg_suffix), {})
        parts[index] = part
        entry = self.entries[mg_suffix]
        if len(parts) < len(entry.parts):
            return None
        del self.waiting[(number, mg_suffix)]
        return entry.fuse([parts[i] for i in range(len(entry.parts))])

    def check_complete(self) -> None:
        """Raise ValueError naming the first fused tensor some of whose parts never came."""
        if not self.waiting:
            return
        (number, mg_suffix), parts = next(iter(self.waiting.items()))
        names = self.entries[mg_suffix].parts
        raise ValueError(
            f"model.layers.{number}: expected all of {list(names)} (fused into "
            f"{mg_suffix}), got only {[names[i] for i in sorted(parts)]}"
        )


def model_parallel_of(kind: str) -> tuple[int, int, Any]:
    """(rank, size, group) in Megatron's ``expert`` or ``pipeline`` model-parallel
    group; (0, 1, None) before parallel state exists."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        getattr(parallel_state, f"get_{kind}_model_parallel_rank")(),
        getattr(parallel_state, f"get_{kind}_model_parallel_world_size")(),
        getattr(parallel_state, f"get_{kind}_model_parallel_group")(),
    )

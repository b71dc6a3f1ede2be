"""Weights both ways between a Megatron GPTModel and a Hugging Face MoE family's layout.

Names on the HF side are the transformers model's own (``named_parameters()``), which
is what the engine loads and exports. Which tensors exist is the family's business
(``inference.models.families``; the tables and the q/k/v fusion: ``hf_tables.py``). An
entry applies in a layer where the Megatron parameter exists, so dense and MoE layers
of one model take different entries.

Both directions stream: ``export_hf_weights`` yields ``(name, tensor)`` one HF tensor
at a time, ``load_hf_weights`` consumes any iterable of them and only buffers what a
fused Megatron tensor needs (``FusedParts``: a layer's q/k/v until all three
arrived). Loading dispatches each name through a table of small handlers keyed by its
pattern (``_HANDLERS``, then the layer's suffix), so a family's new kind of tensor is
one entry, not one more branch.

Layouts that must match (measured: fp32 logits within 3e-7 once they did):
- ``linear_qkv`` per KV group (``hf_tables.fuse_qkv``).
- transformers 5.x stores experts fused: ``mlp.experts.gate_up_proj [E, 2I, H]``, gate
  rows first, is each expert's ``linear_fc1`` as is (Megatron's gated unit applies
  silu to the first half); ``mlp.experts.down_proj [E, H, I]`` is ``linear_fc2``.
- With expert parallelism each rank holds experts ``[r*E/ep, (r+1)*E/ep)``; export
  gathers them over the expert-parallel group, so every rank of that group must call
  it in lockstep.
- With pipeline parallelism a rank holds some layers (in one chunk per virtual stage);
  layer numbers are global. Each stage exports its own tensors, broadcast over the
  pipeline group stage by stage, so every rank yields the whole model (and every rank
  of the group must consume the export in lockstep). Loading takes the whole model's
  stream on every rank and keeps the tensors of its own layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference.models.architecture import MoEArchitecture
from inference.models.families import family_named
from skyrl_train.workers.megatron.hf_tables import (
    EXPERTS,
    LAYER,
    FusedParts,
    fused_entries,
    model_parallel_of,
)
from skyrl_train.workers.megatron.tensor_parallel import is_gated, shard_of, unshard, whole_shape_of

_EXPERT_PREFIX = "mlp.experts.local_experts."


def _gather_experts(local: torch.Tensor, ep_size: int, group: Any) -> torch.Tensor:
    if ep_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ep_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def export_hf_weights(
    chunks: Sequence[Any], arch: MoEArchitecture
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the whole model's weights under the family's HF names, one tensor at a
    time (fp32, detached copies, so the consumer may keep or cast them).

    ``chunks``: this rank's model chunks. With PP > 1 each stage's tensors come from
    that stage (``_broadcast_stages``). Every Megatron parameter is exported or this
    raises ValueError naming the one no table maps (a tensor silently left behind
    would reach the engine as its old value).
    """
    own = _export_own(chunks, arch)
    if model_parallel_of("pipeline")[1] == 1:
        return own
    return _broadcast_stages(own)


def _export_own(chunks: Sequence[Any], arch: MoEArchitecture) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensors: the embedding on the first stage, its layers, and the
    final norm and output layer on the last stage."""
    family = family_named(arch.family)
    fused = fused_entries(arch, family)
    _ep_rank, ep_size, ep_group = model_parallel_of("expert")
    if chunks[0].pre_process:
        embedding = chunks[0].embedding.word_embeddings.weight
        yield "model.embed_tokens.weight", _vocab_rows(embedding, arch)
    for layer in (layer for chunk in chunks for layer in chunk.decoder.layers):
        number = layer.layer_number - 1  # Megatron numbers layers from 1, globally
        prefix = f"model.layers.{number}"
        params = {
            name: unshard(p, gated=is_gated(name))
            for name, p in layer.named_parameters()
            if not name.startswith(_EXPERT_PREFIX)
        }
        experts_own = {n for n, _p in layer.named_parameters() if n.startswith(_EXPERT_PREFIX)}
        done: set[str] = set()
        for mg_suffix, entry in fused.items():
            if mg_suffix in params:
                for hf_suffix, part in zip(
                    entry.parts, entry.split(params[mg_suffix]), strict=True
                ):
                    yield f"{prefix}.{hf_suffix}", part.clone()
                done.add(mg_suffix)
        for hf_suffix, mg_suffix in family.layer_table.items():
            if mg_suffix in params:
                yield f"{prefix}.{hf_suffix}", params[mg_suffix].clone()
                done.add(mg_suffix)
        if hasattr(layer.mlp, "experts"):
            experts = layer.mlp.experts.local_experts
            fc1 = torch.stack([unshard(e.linear_fc1.weight, gated=True) for e in experts])
            fc2 = torch.stack([unshard(e.linear_fc2.weight, gated=False) for e in experts])
            yield f"{prefix}.mlp.experts.gate_up_proj", _gather_experts(fc1, ep_size, ep_group)
            yield f"{prefix}.mlp.experts.down_proj", _gather_experts(fc2, ep_size, ep_group)
            done.update(experts_own)
        left = sorted((set(params) | experts_own) - done)
        if left:
            raise ValueError(
                f"decoder.layers.{number}.{left[0]}: expected a mapping to a "
                f"{family.architectures[0]} weight, got none in the family's tables"
            )
    last = chunks[-1]
    if last.post_process:
        yield "model.norm.weight", last.decoder.final_layernorm.weight.detach().clone()
        if not arch.tie_word_embeddings:
            yield "lm_head.weight", _vocab_rows(last.output_layer.weight, arch)


def _broadcast_stages(
    own: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage 0's tensors, then stage 1's, ...: the owner broadcasts each tensor's name,
    shape and dtype, then its bytes; a None header ends a stage. An owner whose export
    fails sends the error instead, so the other stages raise it rather than wait."""
    stage, stages, group = model_parallel_of("pipeline")
    dist = torch.distributed
    for source in range(stages):
        src = dist.get_global_rank(group, source)
        while True:
            header: list[Any] = [None]
            item, failure = None, None
            if source == stage:
                try:
                    item = next(own, None)
                except ValueError as exc:
                    failure = exc
            if failure is not None:
                header = [("error", str(failure))]
            elif item is not None:
                header = [(item[0], tuple(item[1].shape), item[1].dtype)]
            dist.broadcast_object_list(header, src=src, group=group)
            if header[0] is None:
                break
            if header[0][0] == "error":
                if failure is not None:
                    raise failure
                raise ValueError(f"pipeline stage {source}: {header[0][1]}")
            name, shape, dtype = header[0]
            tensor = item[1].contiguous() if item is not None else torch.empty(shape, dtype=dtype)
            dist.broadcast(tensor, src=src, group=group)
            yield name, tensor


def load_hf_weights(
    chunks: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]], arch: MoEArchitecture
) -> int:
    """Copy HF-named tensors into this rank's ``chunks``; returns how many HF tensors
    this rank took (another pipeline stage's layers are passed over).

    Unknown names (including a tensor of a kind this layer does not have, such as a
    router weight for a dense layer) and shape mismatches raise ValueError naming the
    tensor; a fused tensor whose parts did not all arrive is reported at the end.
    """
    target = _Target.of(chunks, arch)
    loaded = 0
    for name, tensor in named_tensors:
        loaded += int(_load_one(target, name, tensor.detach()))
    target.fused.check_complete()
    return loaded


@dataclass(frozen=True)
class _InLayer:
    """An HF tensor of one of this rank's decoder layers."""

    name: str
    number: int
    suffix: str
    layer: Any
    params: dict[str, torch.nn.Parameter]
    tensor: torch.Tensor


_LayerHandler = Callable[["_Target", _InLayer], bool]
"""Copies the tensor and returns True, or returns False when this layer has no
parameter of that kind (the name is then unknown)."""


@dataclass(frozen=True)
class _Target:
    """What one load copies into: this rank's chunks and layers, and the family's tables."""

    arch: MoEArchitecture
    first: Any
    last: Any
    layers: dict[int, Any]
    layer_table: Mapping[str, str]
    part_of: dict[str, tuple[str, int]]
    """HF suffix -> (the Megatron suffix it is fused into, its place among the parts)."""
    by_suffix: dict[str, list[_LayerHandler]]
    fused: FusedParts
    first_expert: int
    """The global index of this rank's first expert (``[r*E/ep, (r+1)*E/ep)``)."""
    what: str

    @classmethod
    def of(cls, chunks: Sequence[Any], arch: MoEArchitecture) -> _Target:
        family = family_named(arch.family)
        fused = fused_entries(arch, family)
        part_of = {hf: (mg, i) for mg, entry in fused.items() for i, hf in enumerate(entry.parts)}
        ep_rank, ep_size, _group = model_parallel_of("expert")
        by_suffix: dict[str, list[_LayerHandler]] = {}
        for suffixes, handler in (
            (family.layer_table, _direct),
            (part_of, _fused_part),
            (EXPERTS, _experts),
        ):
            for suffix in suffixes:
                by_suffix.setdefault(suffix, []).append(handler)
        return cls(
            arch=arch,
            first=chunks[0],
            last=chunks[-1],
            layers={layer.layer_number - 1: layer for c in chunks for layer in c.decoder.layers},
            layer_table=family.layer_table,
            part_of=part_of,
            by_suffix=by_suffix,
            fused=FusedParts(fused),
            first_expert=ep_rank * (arch.num_experts // ep_size),
            what=f"a {family.architectures[0]} weight name of this model",
        )

    def unknown(self, name: str) -> ValueError:
        return ValueError(f"{name}: expected {self.what}")


def _load_one(target: _Target, name: str, tensor: torch.Tensor) -> bool:
    """Whether this rank took ``name``: the first handler whose pattern matches it."""
    for pattern, handler in _HANDLERS:
        match = pattern.match(name)
        if match is not None:
            return handler(target, match, tensor)
    raise target.unknown(name)


def _embedding(target: _Target, match: re.Match[str], tensor: torch.Tensor) -> bool:
    if not target.first.pre_process:
        return False
    weight = target.first.embedding.word_embeddings.weight
    _copy_vocab_rows(weight, tensor, match.string, target.arch)
    return True


def _final_norm(target: _Target, match: re.Match[str], tensor: torch.Tensor) -> bool:
    if not target.last.post_process:
        return False
    _copy(target.last.decoder.final_layernorm.weight, tensor, match.string)
    return True


def _output(target: _Target, match: re.Match[str], tensor: torch.Tensor) -> bool:
    """Taken (and counted) on the last stage even when tied: the embedding is the output."""
    if not target.last.post_process:
        return False
    if not target.arch.tie_word_embeddings:
        _copy_vocab_rows(target.last.output_layer.weight, tensor, match.string, target.arch)
    return True


def _layer_tensor(target: _Target, match: re.Match[str], tensor: torch.Tensor) -> bool:
    """A decoder layer's tensor, by its suffix; another stage's layer is passed over."""
    number, name = int(match.group(1)), match.string
    if number not in target.layers:
        if 0 <= number < target.arch.num_layers:
            return False
        raise target.unknown(name)
    layer = target.layers[number]
    item = _InLayer(name, number, match.group(2), layer, dict(layer.named_parameters()), tensor)
    if not any(handler(target, item) for handler in target.by_suffix.get(item.suffix, ())):
        raise target.unknown(name)
    return True


def _direct(target: _Target, item: _InLayer) -> bool:
    mg_suffix = target.layer_table[item.suffix]
    if mg_suffix not in item.params:
        return False
    _copy_shard(item.params[mg_suffix], item.tensor, item.name, gated=is_gated(mg_suffix))
    return True


def _fused_part(target: _Target, item: _InLayer) -> bool:
    """One part of a fused tensor: checked against its share of the whole now, copied
    once its siblings arrived (in any order)."""
    mg_suffix, index = target.part_of[item.suffix]
    if mg_suffix not in item.params:
        return False
    param = item.params[mg_suffix]
    whole_shape = whole_shape_of(param)
    rows = target.fused.entries[mg_suffix].part_rows(whole_shape)[index]
    _check_shape((rows, *whole_shape.shape[1:]), item.tensor, item.name)
    whole = target.fused.add(item.number, mg_suffix, index, item.tensor)
    if whole is not None:
        label = f"{item.name} (fused into {mg_suffix})"
        _copy_shard(param, whole, label, gated=is_gated(mg_suffix))
    return True


def _experts(target: _Target, item: _InLayer) -> bool:
    """A stacked ``[E, rows, cols]`` experts tensor: this rank's experts of it, each
    into its own ``linear_fc1`` (gate rows first) or ``linear_fc2``."""
    if not hasattr(item.layer.mlp, "experts"):
        return False
    tensor, experts = item.tensor, target.arch.num_experts
    if tensor.dim() != 3 or tensor.shape[0] != experts:
        raise ValueError(
            f"{item.name}.shape: expected [{experts}, rows, cols] (one slice "
            f"per expert), got {tuple(tensor.shape)}"
        )
    start = target.first_expert
    fc1 = item.suffix.endswith("gate_up_proj")
    for j, expert in enumerate(item.layer.mlp.experts.local_experts):
        param = (expert.linear_fc1 if fc1 else expert.linear_fc2).weight
        _copy_shard(param, tensor[start + j], f"{item.name}[{start + j}]", gated=fc1)
    return True


_Handler = Callable[[_Target, re.Match[str], torch.Tensor], bool]
_HANDLERS: tuple[tuple[re.Pattern[str], _Handler], ...] = (
    (re.compile(r"^model\.embed_tokens\.weight$"), _embedding),
    (re.compile(r"^model\.norm\.weight$"), _final_norm),
    (re.compile(r"^lm_head\.weight$"), _output),
    (LAYER, _layer_tensor),
)
"""Name pattern -> handler, first match wins; a handler returns whether this rank took
the tensor (the embedding only on the first stage, the norm and output on the last)."""


def _vocab_rows(param: torch.Tensor, arch: MoEArchitecture) -> torch.Tensor:
    """The whole embedding or output weight with the checkpoint's ``vocab_size`` rows:
    the padded ones (``model.padded_vocab_size``) are no token, so neither the engine
    nor an HF export ever sees them."""
    return unshard(param, gated=False)[: arch.vocab_size].clone()


def _copy_vocab_rows(
    param: torch.Tensor, whole: torch.Tensor, name: str, arch: MoEArchitecture
) -> None:
    """``_copy_shard`` of an HF embedding or output weight (``vocab_size`` rows) into a
    parameter padded to more rows; the padded rows get zeros, which no forward reads
    (no token embeds as them, and their logits are masked: ``layout.VocabShard``)."""
    rows, *rest = whole_shape_of(param).shape
    _check_shape((arch.vocab_size, *rest), whole, name)
    if rows > arch.vocab_size:
        whole = torch.cat([whole, whole.new_zeros(rows - arch.vocab_size, *rest)])
    _copy_shard(param, whole, name)


def _check_shape(expected: tuple[int, ...], value: torch.Tensor, name: str) -> None:
    if tuple(expected) != tuple(value.shape):
        raise ValueError(f"{name}.shape: expected {tuple(expected)}, got {tuple(value.shape)}")


def _copy_shard(
    param: torch.Tensor, whole: torch.Tensor, name: str, *, gated: bool = False
) -> None:
    """Copy this rank's shard of the whole HF tensor ``whole`` into ``param``; the shape
    check is on the whole tensor, so a message names the HF tensor's own shape."""
    _check_shape(tuple(whole_shape_of(param).shape), whole, name)
    _copy(param, shard_of(param, whole, gated=gated), name)


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    _check_shape(tuple(param.shape), value, name)
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))

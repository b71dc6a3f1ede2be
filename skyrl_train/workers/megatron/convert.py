"""Weights both ways between a Megatron GPTModel and a Hugging Face MoE family's layout.

Names on the HF side are the transformers model's own (``named_parameters()``), which
is what the engine loads and exports. Which tensors exist is the family's business
(``inference.models.families``): its ``layer_table`` maps one-to-one tensors inside a
decoder layer and its ``fused_table`` Megatron tensors concatenated on dim 0 from
several HF ones (a dense or shared-expert MLP's ``[gate; up]``). An entry applies in a
layer where the Megatron parameter exists, so dense and MoE layers of one model take
different entries. q/k/v fusion and the stacked experts are common to every family.

Both directions stream: ``export_hf_weights`` yields ``(name, tensor)`` one HF tensor
at a time, ``load_hf_weights`` consumes any iterable of them and only buffers what a
fused Megatron tensor needs (a layer's q/k/v until all three arrived).

Layouts that must match (measured: fp32 logits within 3e-7 once they did):
- ``linear_qkv`` (and its bias, Qwen2-MoE) is laid out per KV group: that group's
  query heads, then its key head, then its value head. Concatenating all-q/all-k/all-v
  cost 0.77 in logits.
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference.models.architecture import Family, MoEArchitecture
from inference.models.families import family_named
from skyrl_train.workers.megatron.tensor_parallel import is_gated, shard_of, unshard, whole_shape_of

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_EXPERT_PREFIX = "mlp.experts.local_experts."


@dataclass(frozen=True)
class _Fused:
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


def _fused_entries(arch: MoEArchitecture, family: Family) -> dict[str, _Fused]:
    """Megatron suffix -> how it is built: q/k/v (weights, and biases when the family
    has them) and the family's ``fused_table`` (equal parts concatenated on dim 0)."""

    def qkv(kind: str) -> _Fused:
        return _Fused(
            parts=tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv"),
            fuse=lambda ts: fuse_qkv(ts[0], ts[1], ts[2], arch),
            split=lambda t: list(split_qkv(t, arch)),
            part_rows=lambda _param: _qkv_rows(arch),
        )

    def concat(parts: tuple[str, ...]) -> _Fused:
        n = len(parts)
        return _Fused(
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


def _group(kind: str) -> tuple[int, int, Any]:
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
    if _group("pipeline")[1] == 1:
        return own
    return _broadcast_stages(own)


def _export_own(chunks: Sequence[Any], arch: MoEArchitecture) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensors: the embedding on the first stage, its layers, and the
    final norm and output layer on the last stage."""
    family = family_named(arch.family)
    fused = _fused_entries(arch, family)
    _ep_rank, ep_size, ep_group = _group("expert")
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
    stage, stages, group = _group("pipeline")
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
    family = family_named(arch.family)
    what = f"a {family.architectures[0]} weight name of this model"
    fused = _fused_entries(arch, family)
    part_of = {hf: (mg, i) for mg, entry in fused.items() for i, hf in enumerate(entry.parts)}
    ep_rank, ep_size, _unused = _group("expert")
    local_experts = arch.num_experts // ep_size
    layers = {layer.layer_number - 1: layer for chunk in chunks for layer in chunk.decoder.layers}
    first, last = chunks[0], chunks[-1]
    pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    loaded = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if name == "model.embed_tokens.weight":
            if not first.pre_process:
                continue
            _copy_vocab_rows(first.embedding.word_embeddings.weight, tensor, name, arch)
        elif name == "model.norm.weight":
            if not last.post_process:
                continue
            _copy(last.decoder.final_layernorm.weight, tensor, name)
        elif name == "lm_head.weight":
            if not last.post_process:
                continue
            if not arch.tie_word_embeddings:
                _copy_vocab_rows(last.output_layer.weight, tensor, name, arch)
        else:
            match = _LAYER.match(name)
            number = int(match.group(1)) if match is not None else -1
            if number not in layers and 0 <= number < arch.num_layers:
                continue  # another pipeline stage's layer
            if match is None or number not in layers:
                raise ValueError(f"{name}: expected {what}")
            suffix = match.group(2)
            layer = layers[number]
            params = dict(layer.named_parameters())
            direct = family.layer_table.get(suffix, "")
            if direct in params:
                _copy_shard(params[direct], tensor, name, gated=is_gated(direct))
            elif suffix in part_of and part_of[suffix][0] in params:
                mg_suffix, index = part_of[suffix]
                entry, param = fused[mg_suffix], params[mg_suffix]
                whole_shape = whole_shape_of(param)
                rows = entry.part_rows(whole_shape)[index]
                _check_shape((rows, *whole_shape.shape[1:]), tensor, name)
                parts = pending.setdefault((number, mg_suffix), {})
                parts[index] = tensor
                if len(parts) == len(entry.parts):
                    whole = entry.fuse([parts[i] for i in range(len(entry.parts))])
                    _copy_shard(
                        param, whole, f"{name} (fused into {mg_suffix})", gated=is_gated(mg_suffix)
                    )
                    del pending[(number, mg_suffix)]
            elif suffix in _EXPERTS and hasattr(layer.mlp, "experts"):
                if tensor.dim() != 3 or tensor.shape[0] != arch.num_experts:
                    raise ValueError(
                        f"{name}.shape: expected [{arch.num_experts}, rows, cols] (one slice "
                        f"per expert), got {tuple(tensor.shape)}"
                    )
                mine = tensor[ep_rank * local_experts : (ep_rank + 1) * local_experts]
                attr = "linear_fc1" if suffix.endswith("gate_up_proj") else "linear_fc2"
                for j, expert in enumerate(layer.mlp.experts.local_experts):
                    _copy_shard(
                        getattr(expert, attr).weight,
                        mine[j],
                        f"{name}[{ep_rank * local_experts + j}]",
                        gated=attr == "linear_fc1",
                    )
            else:
                raise ValueError(f"{name}: expected {what}")
        loaded += 1
    if pending:
        (number, mg_suffix), parts = next(iter(pending.items()))
        names = fused[mg_suffix].parts
        raise ValueError(
            f"model.layers.{number}: expected all of {list(names)} (fused into "
            f"{mg_suffix}), got only {[names[i] for i in sorted(parts)]}"
        )
    return loaded


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

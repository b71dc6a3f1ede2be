"""Weights both ways between a Megatron GPTModel and the engine's HF Qwen3-MoE layout.

Both directions stream: ``export_hf_weights`` yields ``(name, tensor)`` one HF tensor
at a time, ``load_hf_weights`` consumes any iterable of them and only buffers what a
fused Megatron tensor needs (a layer's q/k/v until all three arrived).

Layouts that must match (measured: fp32 logits within 3e-7 once they did):
- ``linear_qkv`` is laid out per KV group: that group's query heads, then its key
  head, then its value head. Concatenating all-q/all-k/all-v cost 0.77 in logits.
- transformers 5.x stores experts fused: ``mlp.experts.gate_up_proj [E, 2I, H]``, gate
  rows first, is each expert's ``linear_fc1`` as is (Megatron's gated unit applies
  silu to the first half); ``mlp.experts.down_proj [E, H, I]`` is ``linear_fc2``.
- With expert parallelism each rank holds experts ``[r*E/ep, (r+1)*E/ep)``; export
  gathers them over the expert-parallel group, so every rank of that group must call
  it in lockstep.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from inference.models.tiny_moe import TinyMoEConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# HF name suffix inside a layer -> Megatron name suffix, for one-to-one tensors.
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}


def _ep_layout() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_group(),
    )


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: TinyMoEConfig) -> torch.Tensor:
    """HF q/k/v projections -> Megatron ``linear_qkv`` (per KV group: q heads, k, v)."""
    groups, hd, hidden = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    per_group = cfg.num_attention_heads // groups
    q = q.reshape(groups, per_group * hd, hidden)
    k = k.reshape(groups, hd, hidden)
    v = v.reshape(groups, hd, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(
    qkv: torch.Tensor, cfg: TinyMoEConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron ``linear_qkv`` -> HF (q, k, v) projections."""
    groups, hd, hidden = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    per_group = cfg.num_attention_heads // groups
    grouped = qkv.reshape(groups, (per_group + 2) * hd, hidden)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _gather_experts(local: torch.Tensor, ep_size: int, group: Any) -> torch.Tensor:
    if ep_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ep_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def export_hf_weights(model: Any, cfg: TinyMoEConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's weights in HF Qwen3-MoE names, one tensor at a time (fp32,
    detached copies, so the consumer may keep or cast them)."""
    _ep_rank, ep_size, ep_group = _ep_layout()
    yield "model.embed_tokens.weight", model.embedding.word_embeddings.weight.detach().clone()
    for layer in model.decoder.layers:
        number = layer.layer_number - 1  # Megatron numbers layers from 1, globally
        prefix = f"model.layers.{number}"
        attn, mlp = layer.self_attention, layer.mlp
        q, k, v = split_qkv(attn.linear_qkv.weight.detach(), cfg)
        yield f"{prefix}.self_attn.q_proj.weight", q.clone()
        yield f"{prefix}.self_attn.k_proj.weight", k.clone()
        yield f"{prefix}.self_attn.v_proj.weight", v.clone()
        params = dict(layer.named_parameters())
        for hf_suffix, mg_suffix in _LAYER_DIRECT.items():
            yield f"{prefix}.{hf_suffix}", params[mg_suffix].detach().clone()
        experts = mlp.experts.local_experts
        fc1 = torch.stack([e.linear_fc1.weight.detach() for e in experts])
        fc2 = torch.stack([e.linear_fc2.weight.detach() for e in experts])
        yield f"{prefix}.mlp.experts.gate_up_proj", _gather_experts(fc1, ep_size, ep_group)
        yield f"{prefix}.mlp.experts.down_proj", _gather_experts(fc2, ep_size, ep_group)
    yield "model.norm.weight", model.decoder.final_layernorm.weight.detach().clone()
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", model.output_layer.weight.detach().clone()


def load_hf_weights(
    model: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], cfg: TinyMoEConfig
) -> int:
    """Copy HF-named tensors into ``model``; returns how many HF tensors were consumed.

    Unknown names and shape mismatches raise ValueError naming the tensor; a layer
    whose q/k/v did not all arrive is reported at the end.
    """
    ep_rank, ep_size, _group = _ep_layout()
    local_experts = cfg.num_experts // ep_size
    layers = {layer.layer_number - 1: layer for layer in model.decoder.layers}
    pending_qkv: dict[int, dict[str, torch.Tensor]] = {}
    loaded = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if name == "model.embed_tokens.weight":
            _copy(model.embedding.word_embeddings.weight, tensor, name)
        elif name == "model.norm.weight":
            _copy(model.decoder.final_layernorm.weight, tensor, name)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                _copy(model.output_layer.weight, tensor, name)
        else:
            match = _LAYER.match(name)
            if match is None or int(match.group(1)) not in layers:
                raise ValueError(f"{name}: expected a Qwen3-MoE weight name of this model")
            number, suffix = int(match.group(1)), match.group(2)
            layer = layers[number]
            if suffix in _LAYER_DIRECT:
                _copy(dict(layer.named_parameters())[_LAYER_DIRECT[suffix]], tensor, name)
            elif suffix in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ):
                parts = pending_qkv.setdefault(number, {})
                parts[suffix.split(".")[1][0]] = tensor
                if len(parts) == 3:
                    fused = fuse_qkv(parts["q"], parts["k"], parts["v"], cfg)
                    _copy(layer.self_attention.linear_qkv.weight, fused, f"{name} (fused qkv)")
                    del pending_qkv[number]
            elif suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                if tensor.shape[0] != cfg.num_experts:
                    raise ValueError(
                        f"{name}.shape[0]: expected {cfg.num_experts} experts, got {tensor.shape[0]}"
                    )
                mine = tensor[ep_rank * local_experts : (ep_rank + 1) * local_experts]
                attr = "linear_fc1" if suffix.endswith("gate_up_proj") else "linear_fc2"
                for j, expert in enumerate(layer.mlp.experts.local_experts):
                    _copy(
                        getattr(expert, attr).weight,
                        mine[j],
                        f"{name}[{ep_rank * local_experts + j}]",
                    )
            else:
                raise ValueError(f"{name}: expected a Qwen3-MoE weight name of this model")
        loaded += 1
    if pending_qkv:
        layer, parts = next(iter(pending_qkv.items()))
        raise ValueError(
            f"model.layers.{layer}.self_attn: expected q_proj, k_proj and v_proj, "
            f"got only {sorted(parts)}"
        )
    return loaded


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{name}.shape: expected {tuple(param.shape)}, got {tuple(value.shape)}")
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))

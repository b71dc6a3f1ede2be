"""Batch-invariant forward for the transformers MoE families on CPU, still in bf16.

Covers the four families ``inference.models.families`` serves (Qwen3-MoE, Qwen2-MoE,
OLMoE, Mixtral); the causes and fixes below were found on Qwen3-MoE and hold for the
others because they share every op class (RMSNorm, RoPE, SDPA, top-k router, fused
SwiGLU experts); each family's extra parts are listed after the fixes.

With the stock forward a bf16 request's output depends on the requests batched with it:
61 of 64 seeded prompts (lengths 3..120) changed tokens, logprobs and routes between
running alone and in one batch of 64, and the server batches whatever arrives within
5 ms, so identical training runs diverged. Comparing every module's output for one
prompt alone and inside batches found three causes:

- **Attention over left padding.** The first module to differ was always the attention
  core: padding to the longest prompt moves a row's keys to other offsets of a longer
  key axis, and SDPA's blocked, vectorised reductions over keys then add them in
  another order. Two rows of equal length batched bit-identically.
- **GEMM kernels chosen by the row count M.** fp32 ``F.linear`` falls in three classes
  here (M = 1, M in {2, 3}, M >= 4) that disagree in the last bit, so "fp32 GEMM of
  bf16 values" is not row-invariant either; bf16 GEMMs switch kernels at larger M
  (from M = 256 here; 3 of 2048 rows then round differently). MoE experts are GEMMs
  over however many tokens the batch sent to each expert.
- **Elementwise kernels depend on the position in the tensor**: vectorised bodies and
  scalar tails disagree in the last bit of fp32 silu and sigmoid (3% of elements), and
  grouping tokens by expert moves each token's position.

The fix keeps the engine a bf16 engine (weights stored in bf16, activations rounded to
bf16 between ops) and makes each row's arithmetic independent of the other rows:

- Linear layers, the router and the experts multiply in fp64 and round once to bf16.
  A bf16 x bf16 product has at most 16 significant bits, so a K-term dot product is
  exact in fp64's 53 whenever the products span fewer than 38 - log2(K) binades (31
  for K = 64): then every kernel, blocking and thread count gives the same sum, and the
  bf16 output is the rounded exact product. Past that span the fp64 sums differ only in
  their last bits, which change the bf16 rounding with probability ~2^-44 per output.
- RMSNorm's sum of squares is exact in fp64 the same way; silu and the rotary cos/sin
  are evaluated in fp64 and rounded once, so last-bit kernel differences vanish.
- Attention runs one SDPA call per request on that request's own queries and keys,
  which is the call it makes alone (see ``_attention``).

Softmax, top-k and the sampler reduce within one row of fixed length and were checked
invariant; they are unchanged. Cost: scripts/bench_batch_invariance.py.

Per family, the parts beyond the shared ones:

- **Routers.** All four return ``(logits, top-k weights, top-k ids)``; Qwen3-MoE,
  Qwen2-MoE and OLMoE renormalise the top-k weights when ``norm_topk_prob``, Mixtral
  always (it has no such flag) and keeps its weights in fp32.
- **Dense MLPs** (Qwen ``mlp_only_layers``, Qwen2-MoE's shared expert): their Linears are
  swapped like all others, and their silu is evaluated in fp64 and rounded once, as the
  experts' is: the stock silu's vector body and scalar tail disagree in the last fp32
  bit (above).
- **Qwen2-MoE's shared-expert gate**: ``sigmoid(x @ w)`` scales the shared expert per
  token; the sigmoid is evaluated in fp64 and rounded once for the same reason (the
  gate is ``[tokens, 1]``, so a token's position decides body or tail).

  Both matter for an fp32 engine: with the stock silu 10 of 10 mixed-length requests
  to the tiny Qwen checkpoints changed between alone and batched, with the stock
  sigmoid 1 of 10. In bf16 the fp32 last-bit difference did not reach the bf16
  rounding in 200k elements (nor change a request); fp64 keeps it that way by design.

Anything else under a decoder layer's ``mlp`` (another router, MLP or MoE block) is
refused by name, and so is a sliding window, which ``_attention`` does not apply.

Kept whole: each replacement forward answers one cause above, and
enable_batch_invariance installs them and refuses any module it does not cover as one
set; in one file a reader can check that every op class of every family's decoder layer
is covered, which is the property the module exists for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["IMPLEMENTATION", "enable_batch_invariance", "exact_linear", "is_batch_invariant"]

IMPLEMENTATION = "r3_batch_invariant"
"""The name registered with transformers' attention, mask and experts interfaces."""

_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
# "dynamic" and "longrope" rescale inv_freq from the longest position in the batch:
# batch-dependent by design, so they are refused.


def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` computed in fp64 and rounded once to ``x.dtype``: row-invariant.

    ``weight`` and ``bias`` may already be fp64 (see ``_fp64``)."""
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out.to(x.dtype)


def _fp64(module: torch.nn.Module, name: str) -> torch.Tensor:
    """An fp64 copy of parameter ``name``, remade when the parameter changes.

    Converting every weight on every decode step cost more than the GEMMs at batch 1.
    ``load_weights`` copies in place, which bumps the version counter checked here.
    """
    param = getattr(module, name)
    if param.is_inference():  # built under inference_mode: no version counter to watch
        return param.double()
    key = (param._version, param.data_ptr(), param.dtype)
    cache = module.__dict__.setdefault("_fp64_weights", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, param.detach().double())
    return hit[1]


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else _fp64(self, "bias")
    return exact_linear(x, _fp64(self, "weight"), bias)


def _rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # The stock norm's fp32 mean of squares; here the sum is exact in fp64.
    dtype = hidden_states.dtype
    x = hidden_states.float()
    variance = x.double().square().mean(-1, keepdim=True).float()
    x = x * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * x.to(dtype)


def _top_k_route(
    self: Any, hidden_states: torch.Tensor, *, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k router with an exact logit GEMM: ``(logits, fp32 top-k weights, ids)``,
    the stock routers' outputs (RouteCapture reads the ids)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = exact_linear(hidden_states, _fp64(self, "weight"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
    if renormalise:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return logits, top_weights, top_ids


def _router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Qwen3-MoE, Qwen2-MoE, OLMoE: renormalise when configured; weights in the logits' dtype.
    logits, top_weights, top_ids = _top_k_route(
        self, hidden_states, renormalise=self.norm_topk_prob
    )
    return logits, top_weights.to(logits.dtype), top_ids


def _mixtral_router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Mixtral always renormalises and, like its stock router, keeps the weights in fp32.
    return _top_k_route(self, hidden_states, renormalise=True)


def _silu_fp64(self: Any, gate: torch.Tensor) -> torch.Tensor:
    return self.act_fn(gate.double()).to(gate.dtype)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    # A dense SwiGLU MLP (its Linears are exact already); the activation as the experts'.
    return self.down_proj(_silu_fp64(self, self.gate_proj(x)) * self.up_proj(x))


def _qwen2_moe_block_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # Qwen2MoeSparseMoeBlock.forward with the shared-expert gate's sigmoid in fp64.
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    flat = hidden_states.view(-1, hidden_dim)
    shared = self.shared_expert(flat)
    _, routing_weights, selected_experts = self.gate(flat)
    routed = self.experts(flat, selected_experts, routing_weights)
    gate = self.shared_expert_gate(flat)
    shared = torch.sigmoid(gate.double()).to(gate.dtype) * shared
    return (routed + shared).reshape(batch_size, sequence_length, hidden_dim)


def _rotary_forward(
    self: Any, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].float() * self.inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1).double()
    cos = angles.cos() * self.attention_scaling
    sin = angles.sin() * self.attention_scaling
    return cos.float().to(x.dtype), sin.float().to(x.dtype)


def _key_counts(
    *, batch_size: int, kv_length: int, attention_mask: torch.Tensor | None = None, **_: Any
) -> torch.Tensor | None:
    """Mask builder for ``IMPLEMENTATION``: each row's number of real keys, ``[B]``.

    Built once per forward from the 2D left-padding mask (``None``: no padding) and
    handed to every layer's ``_attention`` in place of a 4D mask.
    """
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (batch_size, kv_length):
        raise ValueError(
            f"batch-invariant attention: expected a [batch, keys] padding mask of shape "
            f"{(batch_size, kv_length)}, got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.bool()
    counts = mask.sum(-1)
    if not torch.equal(mask, torch.arange(kv_length) >= (kv_length - counts)[:, None]):
        raise ValueError(
            "batch-invariant attention: expected left padding (each row's keys a suffix "
            "of the key axis), got a mask with gaps"
        )
    return counts


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    segment_lengths: Sequence[int] | None = None,
    kv_sink: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """One SDPA call per request, on that request's own queries and keys only.

    ``query`` is ``[B, H, Q, D]``, ``key``/``value`` ``[B, KV, K, D]`` (cache included);
    returns ``[B, Q, H, D]``. Two layouts: a packed row of prompts back to back
    (``segment_lengths`` given, from ``inference.engine.prefill``; ``kv_sink``
    collects each layer's keys and values), or a left-padded batch (each row's keys a
    suffix of the key axis; padding queries get zeros).

    Slices are views, not copies: a request's slice differs from its own tensors alone
    only in strides that address whole (row, head) problems. One call per row, never a
    call over several rows of equal length: SDPA's CPU kernel decides to repack K/V
    from the batch size (``need_pack``), so a group could compute differently.
    """
    if dropout:
        raise ValueError(f"batch-invariant attention: expected dropout 0.0, got {dropout}")
    if segment_lengths is not None:
        if kv_sink is not None:
            kv_sink[module.layer_idx] = (key, value)  # type: ignore[index]
        parts, start = [], 0
        for n in segment_lengths:
            seg = slice(start, start + n)
            parts.append(
                _sdpa(query[:, :, seg], key[:, :, seg], value[:, :, seg], scaling, causal=True)
            )
            start += n
        return torch.cat(parts, dim=2).transpose(1, 2), None

    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    if attention_mask is not None and attention_mask.dim() != 1:
        raise ValueError(
            "batch-invariant attention: expected a 2D [batch, keys] padding mask from the "
            f"caller, got a prepared {attention_mask.dim()}D mask"
        )
    counts = [k_len] * batch if attention_mask is None else attention_mask.tolist()
    kv_heads = key.shape[1]
    if q_len == 1:
        # Decode: the heads sharing a KV head become that head's queries, which SDPA
        # then runs without a GQA repeat (1.07 vs 1.39 ms per layer at batch 64).
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        rows = [
            _sdpa(
                grouped[b : b + 1],
                key[b : b + 1, :, k_len - n :],
                value[b : b + 1, :, k_len - n :],
                scaling,
                causal=False,
            )
            for b, n in enumerate(counts)
        ]
        return torch.cat(rows).reshape(batch, 1, heads, head_dim), None
    rows = []
    for b, n_keys in enumerate(counts):
        n_q = min(q_len, n_keys)
        if n_q == 0:
            rows.append(query.new_zeros(1, heads, q_len, head_dim))
            continue
        q = query[b : b + 1, :, q_len - n_q :]
        keys = slice(k_len - n_keys, k_len)
        row = _sdpa(q, key[b : b + 1, :, keys], value[b : b + 1, :, keys], scaling, causal=True)
        if n_q < q_len:
            row = F.pad(row, (0, 0, q_len - n_q, 0))
        rows.append(row)
    return torch.cat(rows).transpose(1, 2), None


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, *, causal: bool
) -> torch.Tensor:
    """One request's attention; ``causal``: the queries are the last ``q.shape[2]`` of
    the ``k.shape[2]`` positions (bottom-right aligned), else all keys are visible."""
    n_q, n_k = q.shape[2], k.shape[2]
    mask = None
    if causal and 1 < n_q < n_k:
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal and 1 < n_q == n_k,
        scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _exact_experts(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Fused-layout experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) with
    exact GEMMs: a token's result does not depend on how many tokens share its expert."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    gate_up_proj, down_proj = _fp64(self, "gate_up_proj"), _fp64(self, "down_proj")
    pair_out = hidden_states.new_zeros(tokens * top_k, hidden)
    gathered = hidden_states[order // top_k]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = exact_linear(gathered[rows], gate_up_proj[expert]).chunk(2, dim=-1)
        act = self.act_fn(gate.double()).to(gate.dtype) * up
        pair_out[order[rows]] = exact_linear(act, down_proj[expert])
        start += n
    weighted = pair_out.view(tokens, top_k, hidden) * top_k_weights[..., None].to(pair_out.dtype)
    return weighted.double().sum(dim=1).to(hidden_states.dtype)


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _swap_forward(module: torch.nn.Module, forward: Any, tag: str) -> None:
    """Gives ``module`` a subclass of its class whose ``forward`` is ``forward``.

    Parameters, buffers, names and hooks (RouteCapture's) stay as they are.
    """
    base = type(module)
    if getattr(base, "_batch_invariant", False):
        return
    key = (base, tag)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(
            f"BatchInvariant{base.__name__}",
            (base,),
            {"forward": forward, "_batch_invariant": True},
        )
    module.__class__ = _SUBCLASSES[key]


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _key_counts)
    ExpertsInterface.register(IMPLEMENTATION, _exact_experts)


def is_batch_invariant(model: Any) -> bool:
    return getattr(model.config, "_attn_implementation", None) == IMPLEMENTATION


def _supported_modules() -> tuple[dict[type, Any], dict[type, Any], dict[type, Any]]:
    """(router -> forward, MoE block -> forward or None, dense MLP -> forward) for the
    four families; ``None``: the stock block forward, which only reshapes and dispatches."""
    from transformers.models.mixtral import modeling_mixtral as mixtral
    from transformers.models.olmoe import modeling_olmoe as olmoe
    from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    routers: dict[type, Any] = {
        qwen3_moe.Qwen3MoeTopKRouter: _router_forward,
        qwen2_moe.Qwen2MoeTopKRouter: _router_forward,
        olmoe.OlmoeTopKRouter: _router_forward,
        mixtral.MixtralTopKRouter: _mixtral_router_forward,
    }
    blocks: dict[type, Any] = {
        qwen3_moe.Qwen3MoeSparseMoeBlock: None,
        qwen2_moe.Qwen2MoeSparseMoeBlock: _qwen2_moe_block_forward,
        olmoe.OlmoeSparseMoeBlock: None,
        mixtral.MixtralSparseMoeBlock: None,
    }
    mlps: dict[type, Any] = {
        qwen3_moe.Qwen3MoeMLP: _mlp_forward,
        qwen2_moe.Qwen2MoeMLP: _mlp_forward,
    }
    return routers, blocks, mlps


def _stock_class(module: torch.nn.Module) -> type:
    """The transformers class of ``module``, also once ``_swap_forward`` subclassed it
    (enabling twice, as two engines over one model do, changes nothing)."""
    cls = type(module)
    return cls.__mro__[1] if getattr(cls, "_batch_invariant", False) else cls


def _names(classes: Any) -> list[str]:
    return sorted(c.__name__ for c in classes)


def _check_static_attention(config: Any) -> None:
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"batch_invariant: expected a static rope_type {sorted(_STATIC_ROPE_TYPES)}, "
            f"got {rope_type!r} (it rescales with the batch's longest sequence)"
        )
    # Qwen2-MoE keeps a window size with every layer "full_attention"; only a layer
    # typed "sliding_attention" (or a config without layer types) would apply it.
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types):
        raise ValueError(
            f"batch_invariant: expected full attention (sliding_window null), got "
            f"sliding_window={window!r}, which the per-request attention does not apply"
        )


def enable_batch_invariance(model: Any) -> None:
    """Switches a transformers Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral causal LM to the
    batch-invariant forward in place.

    Raises ``ValueError`` naming the part it cannot make invariant (a decoder layer's
    ``mlp`` that is no known MoE block or dense MLP, another router or experts layout,
    a batch-dependent RoPE type, a sliding window); nothing is changed then, and the
    engine's ``batch_invariant=False`` runs such a model with the stock forward.
    """
    config = model.config
    _check_static_attention(config)
    routers, blocks, mlps = _supported_modules()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"batch_invariant: expected a causal LM with decoder layers at model.layers, "
            f"got {type(model).__name__}"
        )
    missing = [i for i, layer in enumerate(layers) if getattr(layer, "mlp", None) is None]
    if missing:
        raise ValueError(f"batch_invariant: model.layers{missing}: expected an mlp, got none")
    # Every decoder layer's feed-forward must be a block or MLP whose forward is known:
    # an unknown one could compute anything, invariant or not.
    slots = {id(layer.mlp) for layer in layers}
    plan: list[tuple[torch.nn.Module, Any, str]] = []
    for name, module in model.named_modules():
        cls = _stock_class(module)
        kind = cls.__name__
        if id(module) in slots or name.endswith("mlp.shared_expert"):
            if cls in blocks:
                if blocks[cls] is not None:
                    plan.append((module, blocks[cls], "moe_block"))
            elif cls in mlps:
                plan.append((module, mlps[cls], "mlp"))
            else:
                raise ValueError(
                    f"batch_invariant: {name}: expected an MoE block "
                    f"{_names(blocks)} or a dense MLP {_names(mlps)}, got {kind}"
                )
        elif isinstance(module, torch.nn.Linear):
            plan.append((module, _linear_forward, "linear"))
        elif kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            plan.append((module, _rms_norm_forward, "rms_norm"))
        elif kind.endswith("RotaryEmbedding"):
            plan.append((module, _rotary_forward, "rotary"))
        elif name.endswith("mlp.gate"):
            if cls not in routers:
                raise ValueError(
                    f"batch_invariant: {name}: expected a top-k router {_names(routers)}, "
                    f"got {kind}"
                )
            plan.append((module, routers[cls], "router"))
        elif name.endswith("mlp.experts"):
            layout = (
                getattr(module, "has_gate", False),
                getattr(module, "has_bias", True),
                getattr(module, "is_transposed", True),
                getattr(module, "is_concatenated", False),
            )
            if layout != (True, False, False, True):
                raise ValueError(
                    f"batch_invariant: {name}: expected fused gate_up/down experts without "
                    f"bias (has_gate, has_bias, is_transposed, is_concatenated = "
                    f"True, False, False, True), got {layout}"
                )
    _register()
    for module, forward, tag in plan:
        _swap_forward(module, forward, tag)
    config._attn_implementation = IMPLEMENTATION
    config._experts_implementation = IMPLEMENTATION

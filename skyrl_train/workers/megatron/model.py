"""Build a megatron-core GPTModel that reproduces a Hugging Face MoE checkpoint.

The model is built from ``MoEArchitecture`` (``inference.models.architecture``), so
Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral all go through one path. Every setting below
was needed for Megatron and transformers to agree (fp32 logits within 3e-7 on the
built-in model when measured, identical top-k routes in the same order):

- ``moe_router_pre_softmax = not norm_topk_prob``: softmax over the top-k logits ==
  renormalised top-k of the full softmax; without renormalisation (Qwen2-MoE, OLMoE)
  the pre-softmax router is the match. The wrong pairing cost up to 9 in logits.
- ``layernorm_epsilon`` and ``rotary_base`` come from the checkpoint (Megatron's
  default eps of 1e-5 cost 6e-3 in logits); ``rotary_interleaved=False`` (HF's
  rotate_half layout).
- q/k norm must be in the *layer spec*: without it the norm weights are silently
  dropped. Per-head (Qwen3-MoE) is Megatron's own ``qk_layernorm``; OLMoE normalises
  the whole projection, which ``FullWidthQKSelfAttention`` below adds.
- Dense layers (Qwen ``mlp_only_layers``) come from a 0/1 ``moe_layer_freq`` list and
  use ``ffn_hidden_size``; the experts use ``moe_ffn_hidden_size``.
- Qwen2-MoE's shared expert is Megatron's ``SharedExpertMLP`` with its gate:
  ``sigmoid(x @ gate_weight.T) * mlp(x)``, the same as HF's
  ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (gate weight ``[1, hidden]``).
- SequentialMLP experts (no grouped GEMM), allgather dispatcher, every fusion off and
  ``use_cpu_initialization=True``: the configuration that runs on CPU. The alltoall
  dispatcher (``transformer_config_kwargs.moe_token_dispatcher_type``) gives the same
  numbers with replay at TP=2, EP=2 and TP=2 x EP=2 (docs/parallel-layouts.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.megatron_unsupported import refuse_replay_incompatible
from skyrl_train.config.routing_replay import megatron_replay_enabled
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.errors import ConfigValidationError
from skyrl_train.workers.megatron.cpu_compat import cpu_compat_needed

MEGATRON_CONFIG_KEY = "trainer.policy.megatron_config"
"""Where the worker's ``MegatronConfig`` sits in the config; every message names it.
The reference policy has no node of its own (it swaps its weights into this model)."""


def moe_layer_pattern(arch: MoEArchitecture) -> list[int]:
    """Megatron's ``moe_layer_freq`` as a list: 1 for a layer with a router, 0 dense."""
    moe = set(arch.moe_layers)
    return [1 if i in moe else 0 for i in range(arch.num_layers)]


def padded_vocab_size(vocab_size: int, mc: MegatronConfig) -> int:
    """Rows of the embedding and output layer for a vocabulary of ``vocab_size``:
    rounded up to a multiple of ``make_vocab_size_divisible_by`` x TP (Megatron's
    rule), so each tensor-parallel rank holds an equal shard."""
    multiple = mc.make_vocab_size_divisible_by * mc.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def transformer_config_kwargs(
    arch: MoEArchitecture, mc: MegatronConfig, *, routing_replay: bool | None = None
) -> dict[str, Any]:
    """The TransformerConfig kwargs for ``arch`` and the ``megatron_config`` node ``mc``;
    the passthrough ``transformer_config_kwargs`` win. ``routing_replay``: the run's
    ``trainer.policy.routing_replay.enabled`` (the worker's argument); None reads the
    node's deprecated alias, for a config-level caller that has no node."""
    if routing_replay is None:
        routing_replay = megatron_replay_enabled(mc)
    base: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        # Only dense layers read ffn_hidden_size; an all-MoE model has none.
        ffn_hidden_size=arch.dense_ffn_hidden_size or arch.moe_ffn_hidden_size,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layer_freq=moe_layer_pattern(arch),
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=arch.shared_expert_ffn_hidden_size is not None,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_fusion=False,
        moe_permute_fusion=False,
        moe_enable_routing_replay=routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # Also true for "full": the spec then carries norms, which
        # FullWidthQKSelfAttention replaces by full-width ones.
        qk_layernorm=arch.qk_norm != "none",
        rotary_interleaved=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=arch.initializer_range,
        params_dtype=torch.float32,
        use_cpu_initialization=cpu_compat_needed(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=mc.tensor_model_parallel_size,
        pipeline_model_parallel_size=mc.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=mc.virtual_pipeline_model_parallel_size,
        # Stages exchange fp32 activations; every microbatch of a schedule has one
        # shape (the worker pads them), as the allgather dispatcher requires.
        pipeline_dtype=torch.float32,
        # Batched send/recv on gloo matches two messages between the same two ranks in
        # posting order, and at PP=2 with VPP both neighbours are the same rank: rank 0
        # posts (gradient, activation) where rank 1 expects (activation, gradient), so
        # same-shaped tensors swapped silently (measured: losses of microbatches 2-3
        # off, grad norm 14119 vs 61). Megatron's unbatched path orders by rank parity.
        batch_p2p_comm=not cpu_compat_needed(),
        expert_model_parallel_size=mc.expert_model_parallel_size,
        context_parallel_size=mc.context_parallel_size,
        # On whenever TP > 1, as SkyRL does: megatron-core 0.16's MoELayer raises in
        # training with TP > 1 and no sequence parallelism (moe_layer.py).
        sequence_parallel=mc.tensor_model_parallel_size > 1,
    )
    if mc.expert_tensor_parallel_size is not None:  # None: TransformerConfig's default (= TP)
        base["expert_tensor_parallel_size"] = mc.expert_tensor_parallel_size
    base.update(mc.transformer_config_kwargs)
    return base


def build_transformer_config(
    arch: MoEArchitecture, mc: MegatronConfig, *, routing_replay: bool | None = None
) -> Any:
    """The resolved TransformerConfig (``routing_replay`` as ``transformer_config_kwargs``'s). ``refuse_replay_incompatible`` (launch
    validation's rule) runs again on the kwargs and on the built config: a passthrough
    kwarg or a Python-built node skipped validation, and megatron-core derives some
    values (virtual stages from a pipeline layout) only while it builds the config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if arch.qk_norm == "full" and mc.tensor_model_parallel_size != 1:
        # Each TP rank holds a slice of the heads; a norm over the whole projection
        # would need the other ranks' sums of squares, which nothing here reduces.
        raise ConfigValidationError(
            f"{MEGATRON_CONFIG_KEY}.tensor_model_parallel_size",
            expected=f"1 for a {arch.family} model (q/k RMSNorm over the whole projection)",
            got=str(mc.tensor_model_parallel_size),
        )
    if arch.tie_word_embeddings and mc.pipeline_model_parallel_size > 1:
        # Tied weights live on the first and the last stage, and their gradients would
        # need an all-reduce over the embedding group that nothing here runs.
        raise ConfigValidationError(
            f"{MEGATRON_CONFIG_KEY}.pipeline_model_parallel_size",
            expected="1 for a checkpoint with tie_word_embeddings=true",
            got=str(mc.pipeline_model_parallel_size),
        )
    kwargs = transformer_config_kwargs(arch, mc, routing_replay=routing_replay)
    if mc.tensor_model_parallel_size > 1 and not kwargs["sequence_parallel"]:
        raise ConfigValidationError(
            f"{MEGATRON_CONFIG_KEY}.transformer_config_kwargs.sequence_parallel",
            expected="true with tensor_model_parallel_size > 1 (megatron-core 0.16's MoE "
            "layer refuses to train tensor-parallel without it)",
            got="false",
        )
    # On the kwargs first, so a refused value is named before megatron-core's own
    # checks reject it less clearly (bare asserts on the CUDA-graph flags).
    refuse_replay_incompatible(mc, key_prefix=MEGATRON_CONFIG_KEY, resolved=kwargs)
    config = TransformerConfig(**kwargs)
    refuse_replay_incompatible(mc, key_prefix=MEGATRON_CONFIG_KEY, resolved=vars(config))
    return config


def build_model_chunks(
    arch: MoEArchitecture,
    config: Any,
    *,
    seed: int,
    vocab_rows: int | None = None,
    packed: bool = False,
) -> list[Any]:
    """This pipeline rank's GPTModel chunks for ``arch`` (one per virtual stage, one
    without VPP); parallel state must be initialised. ``vocab_rows``: the embedding's
    and output layer's rows (``padded_vocab_size``; None: the checkpoint's vocabulary).
    ``packed``: the core attention takes packed rows (``packed_attention.py``).

    The layer specs are Megatron's own per-layer dense/MoE specs from
    ``moe_layer_freq`` (local modules, no Transformer Engine), sliced to each chunk's
    layers (with PP=2, VPP=2 on four layers: rank 0 holds layers 1 and 3). Only the
    first stage embeds and only the last has the final norm and output layer.
    RouterReplay registers every router in a process-global list in build order, so
    the list is cleared first: a previous model's routers would otherwise shift the
    index of every layer's replay tensor.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = config.virtual_pipeline_model_parallel_size
    torch.manual_seed(seed)
    chunks = []
    for stage in range(vpp) if vpp else [None]:
        block = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization="RMSNorm",
            vp_stage=stage,
            pp_rank=pp_rank,
        )
        block = with_sequence_parallel_norms(block)
        if arch.qk_norm == "full":
            block.layer_specs = [with_full_width_qk_norm(spec) for spec in block.layer_specs]
        if packed:
            from skyrl_train.workers.megatron.packed_attention import core_attention_for_packing

            core = core_attention_for_packing(config)
            block.layer_specs = [with_core_attention(spec, core) for spec in block.layer_specs]
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=arch.vocab_size if vocab_rows is None else vocab_rows,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,  # a float is fine: only used in arithmetic
            vp_stage=stage,
        )
        if not cpu_compat_needed():  # pragma: no cover - CUDA path, not exercised on CPU
            gpt = gpt.cuda()
        chunks.append(gpt)
    return chunks


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as Megatron builds a norm (``config, hidden_size, eps``),
    that also runs under sequence parallelism.

    megatron-core's local norm (``WrappedTorchNorm``, the spec without Transformer
    Engine) asserts ``not sequence_parallel``, though a per-token norm computes the same
    on a sequence shard; only its weight's gradient is then a partial sum, which the
    worker adds up over the tensor-parallel group for every parameter marked
    ``sequence_parallel`` (``gradients.py``), as Megatron's ``finalize_model_grads`` does.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def with_sequence_parallel_norms(spec: Any) -> Any:
    """``spec`` (a block, layer or submodule spec) with every ``WrappedTorchNorm`` swapped
    for ``SequenceParallelRMSNorm``; the spec objects Megatron shares are not mutated."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelRMSNorm
    if isinstance(spec, list):
        return [with_sequence_parallel_norms(item) for item in spec]
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    changes = {}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        swapped = with_sequence_parallel_norms(value)
        if swapped is not value:
            changes[field.name] = swapped
    return dataclasses.replace(spec, **changes) if changes else spec


class FlatRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over a head-shaped tensor's last two axes (``[..., heads, head_dim]``)
    as one ``heads * head_dim`` vector: OLMoE's q/k norm over the whole projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


@functools.cache
def full_width_qk_attention() -> type:
    """``SelfAttention`` whose ``q_layernorm``/``k_layernorm`` span the whole q and k
    projections (``heads * head_dim`` and ``kv_heads * head_dim`` wide).

    Built lazily (megatron-core imports only after the CPU shim). Megatron's
    ``get_query_key_value_tensors`` applies the two norms right after the projection
    and the q/k/v split, to ``[s, b, heads, head_dim]`` and before RoPE, which is where
    OLMoE applies its norms; ``FlatRMSNorm`` takes the statistic over the flattened
    heads there, so the parent's method is used as it is. The parent is built without
    norms (its would be ``head_dim`` wide) and gets these afterwards, under the same
    names, so weight names and the optimizer's q/k-norm rules stay Megatron's.
    """
    from megatron.core.transformer.attention import SelfAttention

    class FullWidthQKSelfAttention(SelfAttention):
        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            bare = dataclasses.replace(submodules, q_layernorm=None, k_layernorm=None)
            super().__init__(config, bare, *args, **kwargs)
            eps = config.layernorm_epsilon
            heads = self.num_attention_heads_per_partition
            groups = self.num_query_groups_per_partition
            head_dim = self.hidden_size_per_attention_head
            self.q_layernorm = FlatRMSNorm(heads * head_dim, eps=eps)
            self.k_layernorm = FlatRMSNorm(groups * head_dim, eps=eps)

    return FullWidthQKSelfAttention


def with_full_width_qk_norm(layer_spec: Any) -> Any:
    """``layer_spec`` (a TransformerLayer ModuleSpec) with its attention swapped for
    ``full_width_qk_attention()``; the spec objects Megatron shares are not mutated."""
    attention = layer_spec.submodules.self_attention
    submodules = dataclasses.replace(
        layer_spec.submodules,
        self_attention=dataclasses.replace(attention, module=full_width_qk_attention()),
    )
    return dataclasses.replace(layer_spec, submodules=submodules)


def with_core_attention(layer_spec: Any, module: type) -> Any:
    """``layer_spec`` (a TransformerLayer ModuleSpec) with ``module`` as its attention's
    core attention; the spec objects Megatron shares are not mutated."""
    attention = layer_spec.submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=module)
    submodules = dataclasses.replace(
        layer_spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)
    )
    return dataclasses.replace(layer_spec, submodules=submodules)


def causal_attention_mask(seq_len: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, S, S] bool, True where attention is masked out.

    Passed explicitly because Megatron's default causal mask is built on "cuda". Rows
    are laid out contiguously from position 0 (right padding only), so a plain causal
    mask is exact for every real token.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]

